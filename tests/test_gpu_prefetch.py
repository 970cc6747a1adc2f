"""The router's L2 weight prefetch (solo.kernels.prefetch) and unrolled K loop change no result:
with and without PDL, against the plain kernel, bit for bit, on fresh random weights at
Ling-3.0-flash width (512 experts, hidden 2560), for decode and verification (GPU only)."""

from __future__ import annotations

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


@pytest.mark.parametrize("tokens", [1, 4])
def test_prefetching_router_equals_plain_router(tokens):
    from solo.kernels.fused_router import FusedRouter
    from solo.kernels.pdl import LaunchPolicy

    g = torch.Generator(device="cuda").manual_seed(int(torch.randint(0, 2**31, ())))
    w = (torch.randn(512, 2560, device="cuda", generator=g) * 0.02).bfloat16()
    bias = torch.randn(512, device="cuda", generator=g) * 0.01
    norm = (1 + 0.1 * torch.randn(2560, device="cuda", generator=g)).bfloat16()
    x = torch.randn(tokens, 2560, device="cuda", generator=g).bfloat16()
    counters = torch.zeros(2, dtype=torch.int32, device="cuda")
    results = []
    for policy, unroll in (
        (LaunchPolicy(), False),
        (LaunchPolicy(False, True), True),
        (LaunchPolicy(True, True), False),
    ):
        router = FusedRouter(w, bias, norm, 1e-6, 8, 8, 4, True, 2.5, counters[0:1], counters[1:2], policy)
        router.unroll = unroll
        results.append(router(x))
    torch.cuda.synchronize()
    for other in results[1:]:
        assert all(torch.equal(a, b) for a, b in zip(results[0], other, strict=True))

"""The decode step's launch policy really sets the shared memory carveout it asks for on the Triton
kernels it launches: read back from the driver (GPU only). Its effect on the step is measured by
`solo bench decode --configs cuda:fp8:fused+cuda+pdl,cuda:fp8:fused+cuda+pdl+drvcarve`."""

from __future__ import annotations

import ctypes

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def _carveout_of(function: int) -> int:
    from solo.kernels.cuda_runtime import driver

    value = ctypes.c_int()
    assert driver().cuFuncGetAttribute(ctypes.byref(value), 9, ctypes.c_void_p(function)) == 0
    return value.value


def test_the_policy_carveout_reaches_the_driver():
    from solo.kernels.fused_router import rmsnorm
    from solo.kernels.pdl import LaunchPolicy

    class Keeping(LaunchPolicy):
        def record(self, family, compiled):
            super().record(family, compiled)
            self.last = compiled

    x = torch.randn(3, 2560, device="cuda").bfloat16()
    w = (1 + 0.1 * torch.randn(2560, device="cuda")).bfloat16()
    counter = torch.zeros(1, dtype=torch.int32, device="cuda")
    for percent in (25, 50, -1):
        policy = Keeping(carveout=percent)
        out = rmsnorm(x, w, 1e-6, counter, policy)
        assert _carveout_of(policy.last.function) == percent
    torch.cuda.synchronize()
    ref = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-6)
    torch.testing.assert_close(out.float(), (ref.bfloat16().float() * w.float()), atol=0.02, rtol=0.02)

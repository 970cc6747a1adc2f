"""The fused MLA layers against the model's reference MLA layers over a long, filled latent cache.

A decode step at a few positions only runs one split of the attention; this fills the cache with
fresh values up to `context` so that the split over the filled positions and the merge of the
splits' partials (the parts of the fused kernels that short tests never reach) are compared too.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace

import torch

from solo.model.cache import HybridCache

# The reference rounds its scores to bf16 (the einsum's output), the kernels keep them in fp32, so the
# two part by more than elsewhere, growing with the context: 0.8e-2 to 2.8e-2 at 86..150 positions on
# the CPU, 2.2e-2 to 3.4e-2 at 2,000..3,000 on the H200; merging one split too few measured 0.21 to 0.71.
LONG_CONTEXT_BOUND = 5e-2


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float().cpu() - b.float().cpu()).norm() / b.float().cpu().norm())


def mla_layers_against_reference(fast, context: int, tokens: int) -> float:
    """Largest relative error, over the MLA layers of the accelerated model `fast` (a fused decode
    step), of the fused attention's contribution to the residual stream against the reference
    attention's, at `tokens` new tokens after `context` positions of random latent cache. The
    attention alone: the layer's MoE would add its routing's near-ties to the comparison."""
    config, step, device = fast.config, fast.decode_step, fast.device
    positions = torch.arange(context, context + tokens, device=device)
    cos_sin = fast.rotary.cos_sin(positions, torch.bfloat16)
    worst = 0.0
    for fused_layer, layer in zip(step.layers, fast.model.layers, strict=False):
        if not layer.is_mla:
            continue
        caches = [HybridCache(config, context + tokens, device, torch.bfloat16, with_nextn=True) for _ in range(2)]
        src, dst = caches[0].mla[layer.layer], caches[1].mla[layer.layer]
        src.latent.normal_()
        src.rope.normal_()
        dst.latent.copy_(src.latent)
        dst.rope.copy_(src.rope)
        x = torch.randn(tokens, config.hidden_size, device=device).to(torch.bfloat16)
        with torch.inference_mode():
            want = x + layer.attention(layer.input_layernorm(x), positions, cos_sin, src)
            got = x.clone()
            fused_layer.attention(got, positions, caches[1], None)
        worst = max(worst, rel(got - x, want - x))
    return worst


@contextmanager
def mla_launches(fast, one_token: dict | None = None, window: dict | None = None, **changes) -> Iterator[list]:
    """The fused step's MLA layers (solo.kernels.fused_mla.FusedMLA) of the accelerated model `fast`, with
    `changes` made to their AttendLaunch for one token and for several (and `one_token` to the one-token launch
    only, `window` to the several tokens' only); restored on the way out."""
    mlas = [layer.attention.mla for layer in fast.decode_step.layers if hasattr(layer.attention, "mla")]
    saved = [(mla.ONE_TOKEN, mla.WINDOW) for mla in mlas]
    try:
        for mla in mlas:
            mla.ONE_TOKEN = replace(mla.ONE_TOKEN, **changes, **(one_token or {}))
            mla.WINDOW = replace(mla.WINDOW, **changes, **(window or {}))
        yield mlas
    finally:
        for mla, (one, window) in zip(mlas, saved, strict=True):
            mla.ONE_TOKEN, mla.WINDOW = one, window

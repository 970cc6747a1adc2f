"""The router's rows in an attention's input projection (solo.fastpath.experts_ahead): what they compute against the
router itself, and the block-FP8 projection they extend, on fresh random weights (CPU)."""

from __future__ import annotations

import pytest
import torch

from solo.fastpath.experts_ahead import TINY_NORM_WEIGHT, extend_with_rows, router_rows
from solo.quantization.formats import dequantize_fp8_block, quantize_fp8_block


def rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def test_the_rows_on_the_input_norm_give_the_routers_logits_on_the_post_attention_norm():
    """router_rows(W, w_in, w_post) . input_layernorm(x) == W . post_attention_layernorm(x) in fp32, for norm weights
    of either sign; columns whose input norm weight is tiny are left out (weight 0)."""
    g = torch.Generator().manual_seed(int(torch.randint(0, 2**31, ())))
    experts, hidden = 64, 256
    weight = torch.randn(experts, hidden, generator=g) * 0.05
    w_in = torch.sign(torch.randn(hidden, generator=g)) * (0.2 + torch.rand(hidden, generator=g))  # (away from 0)
    w_post = torch.randn(hidden, generator=g)
    x = torch.randn(3, hidden, generator=g) * 4
    rows = router_rows(weight.to(torch.bfloat16), w_in, w_post)
    got = rmsnorm(x, w_in) @ rows.T
    want = rmsnorm(x, w_post) @ weight.to(torch.bfloat16).float().T
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    w_in[:5] = TINY_NORM_WEIGHT / 2
    assert torch.equal(router_rows(weight, w_in, w_post)[:, :5], torch.zeros(experts, 5))


@pytest.mark.parametrize("n", [300, 256, 20512])
def test_extending_a_block_fp8_projection_keeps_its_rows_and_appends_the_new_from_a_whole_block(n):
    g = torch.Generator().manual_seed(int(torch.randint(0, 2**31, ())))
    k = 256
    weight, scales = quantize_fp8_block(torch.randn(n, k, generator=g) * 0.02, scale_fmt=None)
    rows = torch.randn(512, k, generator=g) * 0.01
    wide, wide_scales, start = extend_with_rows(weight, scales, rows)
    assert start == -(-n // 128) * 128 and wide.shape == (start + 512, k)
    assert torch.equal(wide[:n].view(torch.uint8), weight.view(torch.uint8))
    assert torch.equal(wide_scales[: scales.shape[0]], scales)
    assert not wide[n:start].float().any()
    back = dequantize_fp8_block(wide, wide_scales)[start:]
    assert (back - rows).norm() / rows.norm() < 0.05  # (e4m3: 3 mantissa bits)
    with pytest.raises(ValueError, match="block-FP8"):
        extend_with_rows(weight.float(), scales, rows)

"""The router's rows in an attention's input projection, so that one GEMV also gives the router's logits on the
layer's input (a lab switch: FusedDecodeStep.ask_experts_ahead's "predicted" source).

The MoE layer routes on post_attention_layernorm(x + attention(x)); the input projection reads input_layernorm(x).
Both norms divide x by its RMS and multiply by their weight, so the router's weight with its columns scaled by
post_attention_layernorm's weight over input_layernorm's, applied to the projection's normalised input, gives the
router's logits on x itself, before the attention adds to it. They name most of the experts the layer then chooses
(dev/routing_prediction_probe.py: 84% on the bench's random weights), which the output projection asks the L2 for
before its wait (gemv_decode.cu EXPERT_ASK with PREDICT). The rows are block-FP8 like the projection's: a
prediction, so their rounding only moves which experts are named, never a result.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from solo.quantization.formats import quantize_fp8_block

# input_layernorm weights smaller than this in magnitude give their column no weight (the ratio would be huge)
TINY_NORM_WEIGHT = 1e-3


def router_rows(router_weight: torch.Tensor, input_norm: torch.Tensor, post_norm: torch.Tensor) -> torch.Tensor:
    """The router's weight [E, H] with column k scaled by post_norm[k] / input_norm[k] (0 where input_norm[k] is
    tiny), fp32: its product with input_layernorm(x) is the router's logits on post_attention_layernorm(x)."""
    w_in, w_post = input_norm.float(), post_norm.float()
    ratio = torch.where(w_in.abs() < TINY_NORM_WEIGHT, torch.zeros_like(w_in), w_post / w_in)
    return router_weight.float() * ratio[None, :]


def extend_with_rows(
    weight: torch.Tensor, scales: torch.Tensor, rows: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """A block-FP8 projection (weight [N, K] e4m3, scales [ceil(N / 128), K / 128]) with `rows` (fp32 [R, K])
    appended from the next whole 128-row block, quantized in blocks of 128 x 128 (scale amax / 448). Returns the
    new weight and scales and the first appended row. The projection's own rows and scales are unchanged."""
    n, k = weight.shape
    if weight.dtype != torch.float8_e4m3fn or k % 128 or rows.shape[1] != k:
        raise ValueError(f"extend_with_rows: a block-FP8 [N, K] weight with K % 128 == 0 and rows of width {k}")
    start = -(-n // 128) * 128
    q, s = quantize_fp8_block(rows.to(weight.device), (128, 128), scale_fmt=None)
    total = start + rows.shape[0]
    out = torch.zeros((total, k), dtype=weight.dtype, device=weight.device)
    out[:n] = weight
    out[start:] = q
    out_scales = torch.ones((-(-total // 128), k // 128), dtype=torch.float32, device=weight.device)
    out_scales[: scales.shape[0]] = scales
    out_scales[start // 128 :] = s
    return out, out_scales, start


@dataclass
class WideProjection:
    """An input projection with the router's rows: its GEMV (a solo.kernels.cuda_step.CudaGemv), its one-token
    output (a buffer of its own, so the logits' address stays put) and the first of the router's rows in it."""

    gemv: Any
    out: torch.Tensor
    logits_at: int

    def logits(self, experts: int) -> torch.Tensor:
        """The router's logits in the one-token output, bf16 [experts]."""
        return self.out[0, self.logits_at : self.logits_at + experts]

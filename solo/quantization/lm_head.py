"""LM head modes: `bf16` (the checkpoint's precision), `fp32` (FP32 weights and product, like
SGLang's --enable-fp32-lm-head) and `fp8` (quantized online at load, one fp32 scale per vocabulary
row: half the bytes of BF16, which every decode step reads in full).

The head is one module object shared by the target and the NEXTN draft; `describe()` reports what
is really in use so start-up checks can prove it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from solo.quantization import formats

LM_HEAD_MODES = ("bf16", "fp32", "fp8")


class LMHeadModeError(ValueError):
    pass


def validate_mode(mode: str) -> None:
    if mode not in LM_HEAD_MODES:
        raise LMHeadModeError(f"unknown --lm-head '{mode}'; choose one of {', '.join(LM_HEAD_MODES)}.")


class DenseHead(nn.Module):
    """Dense head whose product is computed in the weight's dtype."""

    def __init__(self, weight: torch.Tensor, mode: str) -> None:
        super().__init__()
        self.mode = mode
        self.weight = nn.Parameter(weight, requires_grad=False)

    takes_out_dtype = True  # (see head_logits)

    def forward(self, x: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
        out = F.linear(x.to(self.weight.dtype), self.weight)
        return out if out_dtype is None else out.to(out_dtype)

    def describe(self) -> dict[str, Any]:
        return {
            "mode": self.mode,
            "weight_dtype": str(self.weight.dtype).removeprefix("torch."),
            "shape": list(self.weight.shape),
            "scales": None,
            "bytes": self.weight.nbytes,
        }


class Fp8RowwiseHead(nn.Module):
    """FP8 E4M3 weight with one fp32 scale per output row; activations stay BF16/FP32.

    `kernel(x, weight, scale)` computes x @ (weight * scale)^T; the default dequantizes on the fly
    (the CPU reference); the GPU path plugs in the Triton FP8 GEMV.
    """

    mode = "fp8"

    def __init__(self, weight: torch.Tensor, scale: torch.Tensor, kernel: Callable | None = None) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.scale = nn.Parameter(scale, requires_grad=False)
        self.kernel = kernel or reference_fp8_rowwise_linear

    takes_out_dtype = True  # (see head_logits)

    def forward(self, x: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
        """The product in `out_dtype` (default x's). Its sums are fp32, so fp32 logits are stored by the
        product itself: rounding them to bf16 and widening them again would cost a kernel (about 4 us a
        call on the H200) for a less exact result."""
        return self.kernel(x, self.weight, self.scale, out_dtype=out_dtype)

    def describe(self) -> dict[str, Any]:
        return {
            "mode": "fp8",
            "weight_dtype": str(self.weight.dtype).removeprefix("torch."),
            "shape": list(self.weight.shape),
            "scales": {
                "dtype": str(self.scale.dtype).removeprefix("torch."),
                "shape": list(self.scale.shape),
                "min": float(self.scale.min()),
                "max": float(self.scale.max()),
            },
            "bytes": self.weight.nbytes + self.scale.nbytes,
            "kernel": getattr(self.kernel, "__name__", type(self.kernel).__name__),
        }


_E4M3_TABLES: dict[tuple[torch.device, torch.dtype], torch.Tensor] = {}


def _e4m3_table(device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """The 256 values of FP8 E4M3 (NaN codes included) in `dtype`: all exact in bf16, fp16 and fp32."""
    key = (device, dtype)
    if key not in _E4M3_TABLES:
        codes = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn)
        _E4M3_TABLES[key] = codes.to(torch.float32).to(device=device, dtype=dtype)
    return _E4M3_TABLES[key]


def reference_fp8_rowwise_linear(
    x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, out_dtype: torch.dtype | None = None
) -> torch.Tensor:
    """x @ (weight * scale)^T, as the GPU kernel computes it: the dot product of x with the FP8 values,
    then the row scale (fp32), stored in `out_dtype` (default: x's). The codes are decoded through a
    256-entry table, exactly the values a cast gives and twice as fast on a CPU, where this runs on
    every decoded token."""
    dtype = x.dtype if x.dtype in (torch.float32, torch.bfloat16, torch.float16) else torch.float32
    values = torch.take(_e4m3_table(weight.device, dtype), weight.view(torch.uint8).long())
    return (F.linear(x.to(dtype), values).float() * scale.float()).to(out_dtype or dtype)


def head_logits(head: nn.Module, hidden: torch.Tensor) -> torch.Tensor:
    """fp32 logits of any head module, through its forward (so hooks see every call): heads that take
    an `out_dtype` store fp32 themselves (the FP8 head with no kernel of its own for it), others are widened."""
    if getattr(head, "takes_out_dtype", False):
        return head(hidden, out_dtype=torch.float32)
    return head(hidden).float()


def build(head: nn.Module, mode: str) -> nn.Module:
    """Turn the loaded head (a Linear holding the checkpoint weight) into the requested mode. A
    tensor-parallel rank's head (solo.distributed.layers.VocabParallelHead) keeps its shard and gathering."""
    validate_mode(mode)
    from solo.distributed.layers import VocabParallelHead

    if isinstance(head, VocabParallelHead):
        return head.rebuilt(build(head.inner, mode))
    weight = head.weight.data
    if mode == "fp32":
        return DenseHead(weight.float(), "fp32")
    if mode == "bf16":
        return DenseHead(weight.to(torch.bfloat16), "bf16")
    w8, scale = formats.quantize_fp8_rowwise(weight.float())
    kernel = None
    if w8.is_cuda:  # the GPU path: the Triton FP8 GEMV, compiled for this shape now
        from solo.kernels.triton_fp8 import fp8_rowwise_linear, warmup_fp8_linear

        for out_dtype in (None, torch.float32):  # the module's output, and the logits'
            warmup_fp8_linear("rowwise", w8.shape[0], w8.shape[1], w8.device, out_dtype=out_dtype)
        kernel = fp8_rowwise_linear
    return Fp8RowwiseHead(w8, scale, kernel)

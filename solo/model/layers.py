"""Small building blocks: linear layers, RMS norms and rotary embeddings."""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from solo.config import LingConfig


def block_fp8_linears(module: nn.Module) -> list[Linear]:
    """The Linear layers under ``module`` that keep block-FP8 weights."""
    return [m for m in module.modules() if isinstance(m, Linear) and m.is_block_fp8]


class Linear(nn.Module):
    """y = x W^T. The weight is dense, or (``--block-fp8 on``) the checkpoint's FP8 E4M3 weight with
    one fp32 scale per 128x128 block, multiplied by ``kernel`` (on a GPU the Triton block-FP8 GEMV,
    solo.kernels.triton_fp8.fp8_block_linear): half the bytes of a BF16 copy."""

    def __init__(self, in_features: int, out_features: int) -> None:
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        self.scale_inv: nn.Parameter | None = None  # set for block-FP8 weights
        self.kernel: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor] | None = None
        self.fp8_calls = 0  # eager forwards on the FP8 kernel (start-up checks count them)
        self.folded = False  # the weight was folded into another layer's (never called itself)

    def use_block_fp8(self, weight: torch.Tensor, scale_inv: torch.Tensor, kernel: Callable) -> None:
        """Keep an FP8 E4M3 weight [N, K] with fp32 scales per 128x128 block; ``kernel(x, w, s)``."""
        if weight.dtype != torch.float8_e4m3fn or tuple(weight.shape) != (self.out_features, self.in_features):
            raise ValueError(f"need a float8_e4m3fn [{self.out_features}, {self.in_features}] weight")
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.scale_inv = nn.Parameter(scale_inv.float().contiguous(), requires_grad=False)
        self.kernel = kernel

    def use_dense(self, weight: torch.Tensor) -> None:
        """Keep a dense weight [N, K] (a block-FP8 layer dequantized, when FP8 does not pay)."""
        if tuple(weight.shape) != (self.out_features, self.in_features):
            raise ValueError(f"need a [{self.out_features}, {self.in_features}] weight")
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.scale_inv = None
        self.kernel = None

    @property
    def is_block_fp8(self) -> bool:
        return self.scale_inv is not None

    @property
    def nbytes(self) -> int:
        """Bytes of the weight as kept (with the block scales for FP8)."""
        return self.weight.nbytes + (self.scale_inv.nbytes if self.scale_inv is not None else 0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.scale_inv is not None:
            self.fp8_calls += 1
            return self.kernel(x, self.weight, self.scale_inv)
        return F.linear(x, self.weight)

    def dense_weight(self, dtype: torch.dtype) -> torch.Tensor:
        """The weight as a dense matrix (used where a layer's weight is folded into another)."""
        if self.scale_inv is not None:
            from solo.quantization.formats import dequantize_fp8_block

            return dequantize_fp8_block(self.weight, self.scale_inv, (128, 128), dtype)
        return self.weight.to(dtype)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


class GatedRMSNorm(nn.Module):
    """RMSNorm(x) * w * sigmoid(gate), computed in fp32 (the KDA output norm)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim), requires_grad=False)

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight.float() * xf * torch.sigmoid(gate.float())).to(x.dtype)


def l2_normalize(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(sum x^2 + eps): the epsilon inside the root, as FLA's KDA kernels do."""
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


# ----------------------------------------------------------------------------- rotary
def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def rope_inverse_frequencies(config: LingConfig) -> tuple[torch.Tensor, float]:
    """Inverse frequencies for the rotary half of each MLA head, and the cos/sin amplitude.

    `default`: base^(-2i/d). `linear`: frequencies divided by `factor`. `yarn` (NTK-by-parts):
    dimensions rotating fewer than `beta_slow` times over the original context are interpolated by
    `factor`, those rotating more than `beta_fast` times are kept, a linear ramp in between; the
    amplitude is 0.1 ln(factor) + 1 (or the ratio of the mscale/mscale_all_dim variants).
    """
    params = config.rope_parameters
    base = float(params.get("rope_theta", config.rope_theta))
    dim = config.qk_rope_head_dim
    exponents = torch.arange(0, dim, 2, dtype=torch.float32) / dim
    inv_freq = 1.0 / (base**exponents)
    rope_type = params.get("rope_type", "default")
    if rope_type == "linear":
        return inv_freq / float(params["factor"]), 1.0
    if rope_type != "yarn":
        return inv_freq, 1.0

    factor = float(params["factor"])
    original_len = float(params["original_max_position_embeddings"])
    beta_fast = float(params.get("beta_fast") or 32)
    beta_slow = float(params.get("beta_slow") or 1)

    def dim_for_rotations(rotations: float) -> float:
        return dim * math.log(original_len / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = dim_for_rotations(beta_fast), dim_for_rotations(beta_slow)
    if params.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    keep = 1.0 - ramp  # 1: extrapolate (keep the frequency), 0: interpolate (divide by factor)
    inv_freq = inv_freq / factor * (1 - keep) + inv_freq * keep

    amplitude = params.get("attention_factor")
    if amplitude is None:
        mscale, mscale_all_dim = params.get("mscale"), params.get("mscale_all_dim")
        if mscale and mscale_all_dim:
            amplitude = _yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim)
        else:
            amplitude = _yarn_mscale(factor)
    return inv_freq, float(amplitude)


def mla_softmax_scale(config: LingConfig) -> float:
    """(nope + rope)^-0.5, times mscale(factor, mscale_all_dim)^2 for scaled RoPE types."""
    scale = config.qk_head_dim**-0.5
    params = config.rope_parameters
    if params.get("rope_type", "default") != "default" and params.get("mscale_all_dim"):
        m = _yarn_mscale(float(params["factor"]), float(params["mscale_all_dim"]))
        scale *= m * m
    return scale


class RotaryEmbedding(nn.Module):
    """Interleaved RoPE: consecutive pairs (x0, x1), (x2, x3), ... rotate together.

    The output is written de-interleaved ([rotated evens | rotated odds]); queries and keys get the
    same permutation, so every dot product equals the interleaved one.
    """

    def __init__(self, config: LingConfig) -> None:
        super().__init__()
        inv_freq, amplitude = rope_inverse_frequencies(config)
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.amplitude = amplitude

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        angles = positions.float()[:, None] * self.inv_freq[None, :]
        return (angles.cos() * self.amplitude).to(dtype), (angles.sin() * self.amplitude).to(dtype)

    @staticmethod
    def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x [..., d]; cos/sin [..., d/2] broadcast against x's pairs (e.g. [T, 1, d/2] for x [T, heads, d],
        or for a batch [B, T, heads, d])."""
        even, odd = x[..., 0::2], x[..., 1::2]
        return torch.cat([even * cos - odd * sin, odd * cos + even * sin], dim=-1)

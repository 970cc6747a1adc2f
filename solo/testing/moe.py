"""Random MXFP4 experts and an fp32 MoE reference for kernel tests and A/B scripts."""

from __future__ import annotations

import torch

from solo.kernels.moe import MXFP4Experts, swiglu
from solo.quantization.formats import dequantize_mxfp4


def random_mxfp4_experts(
    experts: int, hidden: int, inter: int, device: str | torch.device = "cuda", scales: tuple[int, int] = (118, 124)
) -> MXFP4Experts:
    """Random E2M1 codes and E8M0 scales drawn from [scales[0], scales[1]), fresh every call."""

    def codes(*shape: int) -> torch.Tensor:
        return torch.randint(0, 256, shape, dtype=torch.uint8, device=device)

    def scale(*shape: int) -> torch.Tensor:
        return torch.randint(scales[0], scales[1], shape, dtype=torch.uint8, device=device)

    return MXFP4Experts(
        gate_up=codes(experts, 2 * inter, hidden // 2),
        gate_up_scale=scale(experts, 2 * inter, hidden // 32),
        down=codes(experts, hidden, inter // 2),
        down_scale=scale(experts, hidden, inter // 32),
    )


def moe_reference_fp32(experts: MXFP4Experts, x, ids, w, limit: float | None = None) -> torch.Tensor:
    """fp32 sum_k w[t,k] * down_k(swiglu(gate_up_k x[t])), dequantizing only the selected experts."""
    flat = ids.reshape(-1)
    gu = dequantize_mxfp4(experts.gate_up[flat], experts.gate_up_scale[flat])  # [a, 2I, H]
    dn = dequantize_mxfp4(experts.down[flat], experts.down_scale[flat])  # [a, H, I]
    k = ids.shape[1]
    i = gu.shape[1] // 2
    h = torch.einsum("ah,aoh->ao", x.float().repeat_interleave(k, 0), gu)
    act = swiglu(h[:, :i], h[:, i:], limit)
    y = torch.einsum("ai,ahi->ah", act, dn).view(ids.shape[0], k, -1)
    return (y * w[..., None].float()).sum(1)

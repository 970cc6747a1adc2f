"""The routed-expert (MoE) backend interface and its PyTorch reference.

A backend computes, for T tokens routed to top-k experts each, the weighted sum of the selected
experts' SwiGLU outputs (the shared expert is not its business). Backends are swappable behind
`MoEBackend` so the reference and the fast paths can be tested against each other, and each counts
the calls it actually executed so start-up checks can prove which one ran.

Weight layout (the Ling-3.0-flash-fp4 checkpoint's, see solo.quantization.formats):
  gate_up [E, 2I, H/2] uint8: rows [0, I) are gate_proj, rows [I, 2I) up_proj; E2M1 codes packed
  two per byte, element 2j in the low nibble; gate_up_scale [E, 2I, H/32] uint8 E8M0 (one per 32).
  down [E, H, I/2] uint8 and down_scale [E, H, I/32] likewise.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch
import torch.nn.functional as F


class _ExpertShapes:
    """E, H and I read off the stacked tensors (the same formulas for dense and packed layouts)."""

    gate_up: torch.Tensor
    down: torch.Tensor

    @property
    def num_experts(self) -> int:
        return self.gate_up.shape[0]

    @property
    def hidden_size(self) -> int:
        return self.down.shape[1]

    @property
    def intermediate_size(self) -> int:
        return self.gate_up.shape[1] // 2


@dataclass
class MXFP4Experts(_ExpertShapes):
    """All routed experts of one layer in MXFP4 (see module docstring for the layout)."""

    gate_up: torch.Tensor
    gate_up_scale: torch.Tensor
    down: torch.Tensor
    down_scale: torch.Tensor


@dataclass
class DenseExperts(_ExpertShapes):
    """All routed experts of one layer as dense matrices: gate_up [E, 2I, H], down [E, H, I]."""

    gate_up: torch.Tensor
    down: torch.Tensor


def swiglu(gate: torch.Tensor, up: torch.Tensor, limit: float | None) -> torch.Tensor:
    """silu(gate) * up, with Ling's optional clamp: silu(gate).clamp(max=L) * up.clamp(-L, L)."""
    act = F.silu(gate)
    if limit is not None:
        act = act.clamp(max=limit)
        up = up.clamp(min=-limit, max=limit)
    return act * up


class MoEBackend(ABC):
    """Computes sum_k w[t,k] * expert_{ids[t,k]}(x[t]) for every token t."""

    name: str = "abstract"

    def __init__(self, swiglu_limit: float | None = None) -> None:
        self.swiglu_limit = swiglu_limit
        self.calls = 0  # forward calls executed eagerly (graph replays are not counted)

    def __call__(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return self.forward(x, topk_ids, topk_weights)

    @abstractmethod
    def forward(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        """x [T, H]; topk_ids [T, k] integer; topk_weights [T, k] float32 -> [T, H] in x.dtype."""

    def probe_prompt_tokens(self) -> int:
        """Shortest prompt whose prefill runs this backend's prefill kernels (for the start-up check)."""
        return 1


class TorchMoE(MoEBackend):
    """Reference backend: dense weights (MXFP4 is dequantized once, at construction).

    Few tokens (decode, verification) gather the selected experts' weights, which has static shapes
    and no host synchronisation; many tokens (prefill) loop over the experts that were hit.
    """

    name = "torch"
    GATHER_MAX_ASSIGNMENTS = 64

    def __init__(
        self,
        experts: MXFP4Experts | DenseExperts,
        dtype: torch.dtype,
        swiglu_limit: float | None = None,
    ) -> None:
        super().__init__(swiglu_limit)
        if isinstance(experts, MXFP4Experts):
            from solo.quantization.formats import dequantize_mxfp4

            experts = DenseExperts(
                gate_up=dequantize_mxfp4(experts.gate_up, experts.gate_up_scale, dtype),
                down=dequantize_mxfp4(experts.down, experts.down_scale, dtype),
            )
        self.gate_up = experts.gate_up.to(dtype)
        self.down = experts.down.to(dtype)

    def forward(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        num_tokens, top_k = topk_ids.shape
        if num_tokens * top_k <= self.GATHER_MAX_ASSIGNMENTS:
            return self._forward_gathered(x, topk_ids, topk_weights)
        return self._forward_looped(x, topk_ids, topk_weights)

    def _forward_gathered(self, x, topk_ids, topk_weights):
        inter = self.gate_up.shape[1] // 2
        w_gate_up = self.gate_up[topk_ids]  # [T, k, 2I, H]
        w_down = self.down[topk_ids]  # [T, k, H, I]
        h = torch.einsum("th,tkoh->tko", x.to(w_gate_up.dtype), w_gate_up)
        act = swiglu(h[..., :inter], h[..., inter:], self.swiglu_limit)
        out = torch.einsum("tki,tkhi->tkh", act, w_down)
        return (out.float() * topk_weights[..., None].float()).sum(1).to(x.dtype)

    def _forward_looped(self, x, topk_ids, topk_weights):
        inter = self.gate_up.shape[1] // 2
        out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
        flat_ids = topk_ids.reshape(-1)
        for expert in torch.unique(flat_ids).tolist():
            token_idx, slot = torch.nonzero(topk_ids == expert, as_tuple=True)
            h = F.linear(x[token_idx].to(self.gate_up.dtype), self.gate_up[expert])
            y = F.linear(swiglu(h[:, :inter], h[:, inter:], self.swiglu_limit), self.down[expert])
            out.index_add_(0, token_idx, y.float() * topk_weights[token_idx, slot, None].float())
        return out.to(x.dtype)

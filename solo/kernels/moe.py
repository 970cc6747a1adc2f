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
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

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


@dataclass
class CompileEvidence:
    """What a backend's kernels run from: the compiled binaries on disk, and what this process built."""

    tool: str  # "triton", "nvrtc", "humming", "triton-interpreter"
    cache_dir: str
    artifacts: list[str] = field(default_factory=list)  # compiled kernel files the backend's kernels load
    compiled_now: int = 0  # built by this process (the rest came from the on-disk cache)
    seconds: float = 0.0  # warm-up time (compiling or loading)

    def summary(self) -> dict[str, Any]:
        return {
            "tool": self.tool,
            "cache_dir": self.cache_dir,
            "artifacts": len(self.artifacts),
            "compiled_now": self.compiled_now,
            "seconds": round(self.seconds, 3),
            "examples": self.artifacts[:3],
        }


class MoEBackend(ABC):
    """Computes sum_k w[t,k] * expert_{ids[t,k]}(x[t]) for every token t.

    Every backend counts what it executed, for the start-up check: `calls` (eager forwards) and,
    for backends with several kernel families, `path_calls` per family; `family_for(T)` says which
    family a T-token call must run. `compile_evidence()` names the compiled kernels it runs from."""

    name: str = "abstract"

    def __init__(self, swiglu_limit: float | None = None) -> None:
        self.swiglu_limit = swiglu_limit
        self.calls = 0  # forward calls executed eagerly (graph replays are not counted)
        self.path_calls: dict[str, int] = {}  # eager forwards per kernel family (empty: one family)

    def __call__(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return self.forward(x, topk_ids, topk_weights)

    @abstractmethod
    def forward(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        """x [T, H]; topk_ids [T, k] integer; topk_weights [T, k] float32 -> [T, H] in x.dtype."""

    def adds_onto_residual_in_kernel(self, tokens: int) -> bool:
        """Whether add_onto_residual's sum onto the residual stream runs inside this backend's own kernels for a
        `tokens`-token call (else it is a separate addition after them)."""
        return False

    def add_onto_residual(
        self,
        x: torch.Tensor,
        topk_ids: torch.Tensor,
        topk_weights: torch.Tensor,
        residual: torch.Tensor,
        shared: torch.Tensor,
        before_down: Callable[[], None] | None = None,
    ) -> None:
        """The MoE layer's end: residual <- (residual + shared) + routed, where routed (this forward) is rounded to
        the residual's dtype first and the sum, in fp32, is rounded once: the order in which the shared expert's
        down projection adds its own output and the routed sum onto the residual stream (its `shared` output here
        computed elsewhere, e.g. beside the router). `before_down` is called before anything that reads `shared`
        runs (here: before the forward; backends that add inside their down kernel call it between their kernels)."""
        if residual.shape != shared.shape or residual.shape[0] != topk_ids.shape[0]:
            raise ValueError(f"residual {tuple(residual.shape)} and shared {tuple(shared.shape)} must be [T, H] alike")
        if before_down is not None:
            before_down()
        routed = self(x, topk_ids, topk_weights).to(residual.dtype)
        residual.copy_(((residual.float() + shared.float()) + routed.float()).to(residual.dtype))

    def _check_onto(self, residual: torch.Tensor, shared: torch.Tensor, tokens: int) -> None:
        """What a kernel that adds onto the residual stream itself needs: bf16 rows alike, contiguous."""
        if residual.shape != shared.shape or residual.shape[0] != tokens or residual.dtype != torch.bfloat16:
            raise ValueError(
                f"residual {tuple(residual.shape)} and shared {tuple(shared.shape)} must be bf16 [{tokens}, H] alike"
            )
        if shared.dtype != torch.bfloat16 or not residual.is_contiguous() or not shared.is_contiguous():
            raise ValueError("the residual stream and the shared expert's output must be contiguous bf16 rows")

    def probe_prompt_tokens(self) -> int:
        """Shortest prompt whose prefill runs this backend's prefill kernels (for the start-up check)."""
        return 1

    def family_for(self, tokens: int) -> str | None:
        """The `path_calls` key of the kernels a `tokens`-token call runs (None: a single family)."""
        return None

    def kernel_evidence(self) -> dict[str, Any]:
        """Facts about how the kernels run (e.g. dependent launch), for the start-up report."""
        return {}

    def compile_evidence(self) -> CompileEvidence | None:
        """The compiled kernels this backend runs from; None when it compiles nothing (the reference)."""
        return None


class TorchMoE(MoEBackend):
    """Reference backend: dense products on the dequantized expert weights.

    Few tokens (decode, verification) gather the selected experts' weights, which has static shapes
    and no host synchronisation; many tokens (prefill) loop over the experts that were hit. MXFP4
    experts are dequantized once at construction when the dense copy is small (at most
    ``DENSE_COPY_MAX_BYTES``); larger layers (a full-size model) dequantize the experts a call uses,
    on the fly: the same values, so the same results. ``source`` keeps the experts as loaded, for
    the fast path to build its kernels from.
    """

    name = "torch"
    GATHER_MAX_ASSIGNMENTS = 64
    DENSE_COPY_MAX_BYTES = 1 << 30

    def __init__(
        self,
        experts: MXFP4Experts | DenseExperts,
        dtype: torch.dtype,
        swiglu_limit: float | None = None,
    ) -> None:
        super().__init__(swiglu_limit)
        self.source = experts
        self.dtype = dtype
        self._dense: DenseExperts | None = None
        if isinstance(experts, DenseExperts):
            self._dense = DenseExperts(experts.gate_up.to(dtype), experts.down.to(dtype))
        else:
            e, two_i, h = experts.num_experts, 2 * experts.intermediate_size, experts.hidden_size
            dense_bytes = e * 3 * (two_i // 2) * h * torch.finfo(dtype).bits // 8
            if dense_bytes <= self.DENSE_COPY_MAX_BYTES:
                self._dense = self._dequantize(slice(None))

    def _dequantize(self, index: torch.Tensor | slice | int) -> DenseExperts:
        """The dense weights of the experts `index` selects (any leading shape)."""
        from solo.quantization.formats import dequantize_mxfp4

        src = self.source
        assert isinstance(src, MXFP4Experts)
        return DenseExperts(
            gate_up=dequantize_mxfp4(src.gate_up[index], src.gate_up_scale[index], self.dtype),
            down=dequantize_mxfp4(src.down[index], src.down_scale[index], self.dtype),
        )

    def _weights(self, index: torch.Tensor | int) -> tuple[torch.Tensor, torch.Tensor]:
        if self._dense is not None:
            return self._dense.gate_up[index], self._dense.down[index]
        dense = self._dequantize(index)
        return dense.gate_up, dense.down

    def forward(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        num_tokens, top_k = topk_ids.shape
        if num_tokens * top_k <= self.GATHER_MAX_ASSIGNMENTS:
            return self._forward_gathered(x, topk_ids, topk_weights)
        return self._forward_looped(x, topk_ids, topk_weights)

    def _forward_gathered(self, x, topk_ids, topk_weights):
        w_gate_up, w_down = self._weights(topk_ids)  # [T, k, 2I, H], [T, k, H, I]
        inter = w_gate_up.shape[2] // 2
        h = torch.einsum("th,tkoh->tko", x.to(w_gate_up.dtype), w_gate_up)
        act = swiglu(h[..., :inter], h[..., inter:], self.swiglu_limit)
        out = torch.einsum("tki,tkhi->tkh", act, w_down)
        return (out.float() * topk_weights[..., None].float()).sum(1).to(x.dtype)

    def _forward_looped(self, x, topk_ids, topk_weights):
        out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
        flat_ids = topk_ids.reshape(-1)
        for expert in torch.unique(flat_ids).tolist():
            token_idx, slot = torch.nonzero(topk_ids == expert, as_tuple=True)
            w_gate_up, w_down = self._weights(expert)
            inter = w_gate_up.shape[0] // 2
            h = F.linear(x[token_idx].to(w_gate_up.dtype), w_gate_up)
            y = F.linear(swiglu(h[:, :inter], h[:, inter:], self.swiglu_limit), w_down)
            out.index_add_(0, token_idx, y.float() * topk_weights[token_idx, slot, None].float())
        return out.to(x.dtype)

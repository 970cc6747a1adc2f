"""The GPU decode step: the reference model's decode and verification forward as a few fused kernels.

Built from a loaded, accelerated `LingForCausalLM` by `FusedDecodeStep.build(model)` (one explicit
step; the reference modules stay and keep serving prefill). Per layer (T = 1 token for decode,
T = the verification window for NEXTN):

  KDA attention   norm + [q|k|v|f|g|b] GEMV (1) -> KDA recurrence (1) -> gated norm + o_proj + residual (1)
  MLA attention   norm + [q|kv_a|g] GEMV (1) -> prep (1) -> split attention (1) -> combine (1) -> dense + residual (1)
  MoE             norm + router + top-k (1) -> shared gate_up + SwiGLU (1) -> routed experts (the
                  backend's 1-2) -> shared down + routed + residual (1); for one token with
                  --moe-backend cuda and the CUDA step kernels, norm + router + top-k + routed experts
                  are one launch (the persistent MoE kernel built with its router: --moe-router)
  dense MLP       norm + gate_up + SwiGLU (1) -> down + residual (1)

plus the embedding lookup and the final norm: about 7 launches per layer instead of about 100. The
fused projections' weights are the reference layers' own bytes: their Linear modules are re-pointed
at slices of the concatenated buffers, so nothing is stored twice. Every kernel family counts its
launches on the device (`launch_counts`), which is how the start-up check proves the fused path ran
inside captured graphs. Static shapes, no host synchronisation, capturable.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from solo.fastpath.availability import (
    STEP_KERNELS,
    DecodeStepUnavailable,
    PDLUnavailable,
    StepKernelsUnavailable,
    fused_step_unavailable,
)
from solo.kernels.cuda_step import BIG_PROJECTION_ROWS, CudaGemv, Handoff, task_order
from solo.kernels.fused_gemv import FusedGemv
from solo.kernels.fused_kda import kda_decode
from solo.kernels.fused_mla import FusedMLA
from solo.kernels.fused_router import FusedRouter, rmsnorm
from solo.kernels.pdl import LaunchPolicy, pdl_unavailable
from solo.model.cache import HybridCache, KDAHistory
from solo.model.kda import KimiDeltaAttention
from solo.model.layers import Linear, mla_softmax_scale
from solo.model.ling import DecoderLayer, LingForCausalLM, NextNLayer
from solo.model.mla import MultiLatentAttention
from solo.model.moe import SparseMoE, SwiGLUMLP

FAMILIES = (
    "gemv",
    "kda",
    "mla_prep",
    "mla_attend",
    "mla_combine",
    "router",
    "router_select",
    "rmsnorm",
    "cuda_gemv",  # projections (decode, verification) on solo/kernels/cuda_step.py (step kernels "cuda")
    "cuda_router",
    "moe_router",  # one token's router inside the persistent MoE kernel (--moe-backend cuda, step kernels cuda)
    "moe_shared",  # ... and the layer's shared expert in the same launch (--moe-shared)
    "cuda_kda_front",  # one token's KDA norm + q|k|v|f|g|b + recurrence in one launch (FusedDecodeStep.fuse_kda_front)
)


# Tokens per call the step's routers take on the CUDA router (more go to the Triton kernels). Its first
# version selected every token in its last block and lost to Triton inside the verification step (4.906
# ms against 5.159 at 4 tokens: dev/verify_kernels_ab.py), so it served one token only; each token now
# has a selecting block of its own (router_decode.cu).
ROUTER_CUDA_TOKENS = 8


def _fuse_rows(linears: list[Linear], name: str) -> tuple[torch.Tensor, torch.Tensor | None, list[int]]:
    """Concatenate the weights of Linears that read the same input into one [sum N, K] matrix (and
    their block scales), re-pointing each Linear at its rows. Returns (weight, scales, row offsets).
    FP8 row groups start on 128-row blocks (zero rows pad the gaps) so every group keeps its scales."""
    fp8 = [m.is_block_fp8 for m in linears]
    if any(fp8) and not all(fp8):
        raise DecodeStepUnavailable(
            f"{name}: its projections mix FP8 and dense weights; the fused GEMV needs one format "
            "(load with --block-fp8 on or off)."
        )
    k = linears[0].in_features
    if any(m.in_features != k for m in linears):
        raise DecodeStepUnavailable(f"{name}: the projections read inputs of different widths")
    block = 128 if all(fp8) else 1
    offsets, rows = [], 0
    for m in linears:
        rows = -(-rows // block) * block
        offsets.append(rows)
        rows += m.out_features
    device = linears[0].weight.device
    weight = torch.zeros((rows, k), dtype=linears[0].weight.dtype, device=device)
    scales = torch.ones((-(-rows // 128), -(-k // 128)), dtype=torch.float32, device=device) if all(fp8) else None
    for m, r0 in zip(linears, offsets, strict=True):
        weight[r0 : r0 + m.out_features].copy_(m.weight)
        view = weight[r0 : r0 + m.out_features]
        if scales is not None:
            b0 = r0 // 128
            scales[b0 : b0 + m.scale_inv.shape[0]].copy_(m.scale_inv)
            m.weight = nn.Parameter(view, requires_grad=False)
            m.scale_inv = nn.Parameter(scales[b0 : b0 + m.scale_inv.shape[0]], requires_grad=False)
        else:
            m.weight = nn.Parameter(view, requires_grad=False)
    return weight, scales, offsets


def _gemv(linear: Linear, step: FusedDecodeStep, name: str) -> FusedGemv:
    scale = linear.scale_inv if linear.is_block_fp8 else None
    weight = linear.weight if linear.is_block_fp8 else linear.weight.to(torch.bfloat16)
    return FusedGemv(weight.contiguous(), scale, "block", counter=step.counter("gemv"), name=name, launch=step.launch)


# Cards (torch.cuda.get_device_name) on which each MoE kernel asks the L2 for the weights the step reads after it
# (FusedDecodeStep.prefetch_next_weights: the shared expert's and the next input projection's first
# L2_NEXT_MEGABYTES, once the block's copies landed). Measured in the whole decode step at full shape, 32K, on the
# H100 (dev/decode_launch_ab.py, two device calls: -44.0 / -33.3 us with 8 MB, -36.4 with 16 MB, -44.0 with 24;
# docs/results/h100_ab_lab28.log, _lab29; as the product, turned off +31.2 / +30.7 us, h100_ab_lab30.log). Asked
# later in the kernel (after its activation exchange, at its end) or at its wait, they lose 94-127 us. Not on the
# H200 until measured there (L2 hints lost on it before).
L2_NEXT_CARDS = ("NVIDIA H100 80GB HBM3",)
L2_NEXT_MEGABYTES = 16.0  # (the KDA projections' first wave of tasks: 792 blocks x 8 rows x 2,560 bytes)


# Cards on which each MoE kernel (one token, router inside) keeps at most GATE_UP_WINDOW of its gate_up tiles in flight
# (DecodeKernelConfig.gate_up_window; all at once they land together near the end of the stream, and the gate_up warps,
# about 0.5 us a tile, then work through five or six in a row). Measured in the whole decode step at full shape, 32K,
# on the H100 (dev/decode_launch_ab.py, three device calls: -10.9, -7.9, -8.8 us; windows of 2 and 4: +16.5, -1.4; the
# window over the down copies too: +21.5 to +22.9 us; docs/results/h100_ab_lab40.log, _lab41; as the product, the tiles
# all at once again +15.4 us at 32K, +16.2 / +16.6 at 4K: h100_ab_lab42.log, h100_ab4k_lab45.log). On the H200
# (twenty-seventh session, two device calls): -14.5, -14.8 us at 32K (h200_ab_lab70.log, h200_ab_lab71.log).
GATE_UP_WINDOW_CARDS = ("NVIDIA H100 80GB HBM3", "NVIDIA H200")
GATE_UP_WINDOW = 3


# Cards on which one token's KDA layer front (norm, q|k|v|f|g|b, the short convolutions, the gates and the recurrence)
# runs as one launch of 4 blocks a head (FusedDecodeStep.fuse_kda_front with KDA_FRONT_BUILD: the weights through a
# ring of 3 task slots of shared memory, the heads' blocks exchanging through global memory, the g rows streamed after
# the recurrence) instead of the CUDA GEMV and the Triton recurrence. Measured in the whole decode step at full shape,
# 32K, on H100s (thirty-third session, dev/decode_launch_ab.py): -41.1 us with the g rows last, against -29.7 and
# about -47 without (docs/results/h100_kda_front_lab83.log); the bench -50 us at 32K, -38 at 4K (h100_bench_lab84.log).
# Not on the H200 until measured there. The layer's output projection inside the same launch (`o_proj`) measured +7 to
# +21 us against the same build without it in three of four comparisons (-6.9 once), and stays a lab switch.
KDA_FRONT_CARDS = ("NVIDIA H100 80GB HBM3",)
KDA_FRONT_BUILD: dict[str, Any] = {"tasks_ahead": 1, "exchange": "global", "ring": 3, "g_last": True}


# Cards on which verification's shared gate_up runs beside its router (FusedDecodeStep.shared_beside_router: on the
# step's side stream, normalising x itself, while the router holds 32 SMs and the routed experts run). Measured in the
# whole verification step at full shape, 32K, on an H100 (thirty-seventh session, dev/decode_launch_ab.py): 4.902 /
# 4.912 -> 4.800 / 4.788 ms, outputs bit for bit, decode unchanged (docs/results/h100_ab_lab91.log). Not on the H200
# until measured there.
SHARED_BESIDE_CARDS = ("NVIDIA H100 80GB HBM3",)


def shared_beside_for(card: str) -> bool:
    """Whether verification's shared gate_up runs beside its router on this card."""
    return card in SHARED_BESIDE_CARDS


# Cards on which, with the shared gate_up beside the router, verification's shared down runs there too, and the routed
# experts' down kernel adds both sums onto the residual stream in the order the shared down's epilogue did
# (FusedDecodeStep.shared_down_beside, MoEBackend.add_onto_residual): the shared down (2.5 us a MoE layer on
# verification's critical path, H100 lab90) leaves it. Empty until measured in the whole step.
SHARED_DOWN_BESIDE_CARDS: tuple[str, ...] = ()


def shared_down_beside_for(card: str) -> bool:
    """Whether verification's shared down runs beside its router too on this card (with shared_beside_for)."""
    return card in SHARED_DOWN_BESIDE_CARDS


def kda_front_for(card: str) -> dict[str, Any] | None:
    """The fused KDA front's build on this card (fuse_kda_front's arguments), or None: the two kernels run there."""
    return dict(KDA_FRONT_BUILD) if card in KDA_FRONT_CARDS else None


def gate_up_window_for(card: str) -> int:
    """The gate_up tiles each MoE kernel keeps in flight on this card (0: all at once)."""
    return GATE_UP_WINDOW if card in GATE_UP_WINDOW_CARDS else 0


def l2_next_for(card: str) -> float | None:
    """The megabytes of the next input projection each MoE kernel asks the L2 for on this card (with the
    shared expert's weights), or None: it asks for nothing there."""
    return L2_NEXT_MEGABYTES if card in L2_NEXT_CARDS else None


def reading_order_bytes(rows: int, row_bytes: int, start_row: int, nbytes: int) -> list[tuple[int, int]]:
    """The byte ranges (first byte, bytes) of a row-major weight's first `nbytes` in the order a one-token
    GEMV reads its rows: from `start_row` on, then from row 0 (a hand-off's rotated task order)."""
    if not 0 <= start_row < rows or row_bytes <= 0:
        raise ValueError(f"the reading order starts at a row of 0..{rows - 1}, not {start_row}")
    size, first = rows * row_bytes, start_row * row_bytes
    nbytes = min(max(nbytes, 0), size)
    head = min(nbytes, size - first)
    ranges = [(first, head)] if head else []
    if nbytes > head:
        ranges.append((0, nbytes - head))
    return ranges


def _weight(kernel: Any) -> torch.Tensor:
    """The weight of a projection: a FusedGemv's, or that of the FusedGemv a CudaGemv runs."""
    return getattr(kernel, "fused", kernel).weight


def _project_handing_over(
    step: FusedDecodeStep, gemv: Any, x: torch.Tensor, norm: torch.Tensor, eps: float, gate_start: int, gate_end: int
) -> tuple[torch.Tensor, tuple[torch.Tensor, int] | None]:
    """An attention's input projection, and the hand-off its next kernel waits for where the CUDA GEMV
    made it with one (FusedDecodeStep.handoff): the output gate's rows [gate_start, gate_end), which
    only a later kernel reads, computed last; None where it ran without (the next kernel waits for its end)."""
    if not (step.handoff and isinstance(gemv, CudaGemv)):
        return gemv(x, norm_weight=norm, eps=eps), None
    counters = step.handoff_counters
    proj = gemv(x, norm_weight=norm, eps=eps, handoff=Handoff(counters, gate_start, gate_end))
    signals = gemv.last_signals  # (0 where the call went to the Triton kernel)
    return proj, (counters, signals) if signals else None


class _KDAAttention:
    def __init__(
        self, attn: KimiDeltaAttention, norm: torch.Tensor, eps: float, index: int, step: FusedDecodeStep
    ) -> None:
        self.index = index
        self.norm, self.eps = norm, eps
        self.heads, self.dim = attn.num_heads, attn.num_heads * attn.head_dim
        if attn.kernel_size != 4:
            raise DecodeStepUnavailable("the fused KDA kernel runs short convolutions of kernel size 4")
        linears = [attn.q_proj, attn.k_proj, attn.v_proj, attn.f_proj, attn.g_proj, attn.b_proj]
        weight, scales, offsets = _fuse_rows(linears, f"layer {index} KDA")
        if offsets != [i * self.dim for i in range(6)]:
            raise DecodeStepUnavailable("the fused KDA kernel needs q, k, v, f, g of heads x head_dim rows each")
        self.proj = FusedGemv(
            weight, scales, "block", counter=step.counter("gemv"), name=f"layer {index} qkvfgb", launch=step.launch
        )
        self.dense = _gemv(attn.dense, step, f"layer {index} o_proj")
        self.handoff_rows = (4 * self.dim, 5 * self.dim)  # (the output gate's rows, computed last with a hand-off)
        self.attn = attn
        self.front: Any = None  # one token's CudaKdaFront where FusedDecodeStep.fuse_kda_front set one
        self.gate_params: tuple[torch.Tensor, torch.Tensor] | None = None  # its fp32 A_log, dt_bias (made once)
        self.counter = step.counter("kda")
        self.sync = step.kda_sync
        self.launch = step.launch
        self.step = step

    def __call__(self, x, positions, cache: HybridCache, history: dict[int, KDAHistory] | None) -> None:
        a = self.attn
        state = cache.kda[self.index]
        # a cache with its own verification history may hold the states there (lazy rollback); a pass
        # into another history reads them from kda_recurrent (settled by `forward`)
        own = cache.verification
        follows = own is not None and (history is None or history is own)
        lazy = (cache.kda_source, own[self.index].states) if follows else None
        o = torch.empty((x.shape[0], self.dim), dtype=torch.bfloat16, device=x.device)
        if self.front is not None and x.shape[0] == 1 and history is None:  # (one launch: fuse_kda_front)
            if self.front.o_proj is not None:  # (the output projection inside: x += the layer's contribution)
                norm = (a.o_norm.weight, a.o_norm.eps)
                self.front(x, self.norm, self.eps, state.conv, state.recurrent, o, self.launch, lazy, norm)
                return
            proj = self.front(x, self.norm, self.eps, state.conv, state.recurrent, o, self.launch, lazy)
        else:
            # (g, which only the output projection reads, may come last: _project_handing_over)
            proj, handoff = _project_handing_over(self.step, self.proj, x, self.norm, self.eps, *self.handoff_rows)
            past = history[self.index] if history is not None else None
            kda_decode(
                proj,
                a.conv_weight,
                state.conv,
                state.recurrent,
                a.A_log.float(),
                a.dt_bias.float(),
                o,
                self.counter,
                a.lower_bound,
                a.safe_gate,
                past.states if past is not None else None,
                past.window if past is not None else None,
                self.sync,
                self.launch,
                lazy,
                handoff,
                # (one token, FusedDecodeStep.kda_l2_ahead) the output projection's weight into the L2 while it runs
                _weight(self.dense) if self.step.kda_l2_ahead and x.shape[0] == 1 else None,
            )
        gate = proj[:, 4 * self.dim : 5 * self.dim]
        self.dense(o, out=x, residual=x, norm_weight=a.o_norm.weight, gate=gate, eps=a.o_norm.eps)


class _MLAAttention:
    def __init__(
        self, attn: MultiLatentAttention, norm: torch.Tensor, eps: float, index: int, step: FusedDecodeStep
    ) -> None:
        if attn.q_lora_rank:
            raise DecodeStepUnavailable("the fused MLA kernels run checkpoints without a q LoRA (q_lora_rank)")
        self.index = index
        self.norm, self.eps = norm, eps
        weight, scales, offsets = _fuse_rows([attn.q_proj, attn.kv_a_proj_with_mqa, attn.g_proj], f"layer {index} MLA")
        self.proj = FusedGemv(
            weight, scales, "block", counter=step.counter("gemv"), name=f"layer {index} q|kv_a|g", launch=step.launch
        )
        self.dense = _gemv(attn.dense, step, f"layer {index} dense")
        model = step.model
        self.mla = FusedMLA(
            attn.w_uk.to(torch.bfloat16),
            attn.w_uv.to(torch.bfloat16),
            attn.kv_a_layernorm.weight,
            model.rotary.inv_freq,
            model.rotary.amplitude,
            mla_softmax_scale(model.config),
            attn.kv_a_layernorm.eps,
            attn.rope_dim,
            step.counter("mla_prep", 3),  # prep, attend, combine
            kv_offset=offsets[1],
            gate_offset=offsets[2],
            launch=step.launch,
        )
        self.out_dim = attn.num_heads * attn.v_dim
        self.handoff_rows = (offsets[2], weight.shape[0])  # (the output gate's rows, computed last with a hand-off)
        self.step = step

    def __call__(self, x, positions, cache: HybridCache, history) -> None:
        proj, handoff = _project_handing_over(self.step, self.proj, x, self.norm, self.eps, *self.handoff_rows)
        o = torch.empty((x.shape[0], self.out_dim), dtype=torch.bfloat16, device=x.device)
        layer_cache = cache.mla[self.index]
        self.mla(proj, positions, layer_cache.latent, layer_cache.rope, o, handoff)
        self.dense(o, out=x, residual=x)


class _MoE:
    def __init__(self, moe: SparseMoE, norm: torch.Tensor, eps: float, index: int, step: FusedDecodeStep) -> None:
        gate = moe.gate
        self.experts = moe.experts
        self.router = FusedRouter(
            gate.weight,
            gate.expert_bias,
            norm,
            eps,
            gate.top_k,
            gate.n_group if gate.topk_group < gate.n_group else 1,
            gate.topk_group if gate.topk_group < gate.n_group else 1,
            gate.renormalize,
            gate.scaling,
            step.counter("router"),
            step.counter("router_select"),  # verification only: the tokens' selections in parallel
            step.launch,
        )
        self.shared_gate_up = self.shared_down = None
        if moe.shared_experts is not None:
            self.shared_gate_up, self.shared_down = _swiglu_pair(moe.shared_experts, step, f"layer {index} shared")
        # set by FusedDecodeStep where the persistent MoE kernel also runs one token's router (no router launch)
        self.routed_in_experts: FusedRouter | None = None
        # ... and the shared expert (no shared gate_up and down launches; the kernel updates x itself)
        self.shared_in_experts: Any = None  # solo.kernels.cuda_moe.SharedExpert
        self.moe_router_counter = step.counter("moe_router", 2)  # moe_router, moe_shared
        self.launch = step.launch
        self.norm, self.eps = norm, eps
        self.step = step

    def __call__(self, x: torch.Tensor) -> None:
        if self.shared_in_experts is not None and x.shape[0] == 1:
            self.experts.routed_forward(
                x, self.routed_in_experts, self.moe_router_counter, self.launch, shared=self.shared_in_experts, out=x
            )
            return
        act = None
        if self.routed_in_experts is not None and x.shape[0] == 1:
            routed, xn, _, _ = self.experts.routed_forward(
                x, self.routed_in_experts, self.moe_router_counter, self.launch
            )
        else:
            if self.step.shared_beside_router and self.shared_gate_up is not None:
                if self._shared_down_beside(x.shape[0]):
                    # (both outputs held until the join: a buffer freed while the side stream still writes or
                    # reads it goes to the next allocation on this stream, e.g. the router's expert ids)
                    act, shared = self._shared_expert_beside(x)
                    xn, ids, weights = self.router(x)
                    self.experts.add_onto_residual(xn, ids, weights, x, shared, self.step.join_side_stream)
                    del act, shared
                    return
                act = self._shared_gate_up_beside(x)
            xn, ids, weights = self.router(x)
            routed = self.experts(xn, ids, weights)
            if act is not None:
                self.step.join_side_stream()
        if self.shared_gate_up is None:
            x.add_(routed)
            return
        late = self.step.shared_late_wait and self.routed_in_experts is not None and x.shape[0] == 1
        if act is None and late and isinstance(self.shared_gate_up, CudaGemv):
            # normalising x itself (written before the persistent MoE kernel, which lets its successor launch
            # only after its own wait), it runs while the MoE kernel ends
            act = self.shared_gate_up(x, norm_weight=self.norm, eps=self.eps, late_wait=True)
        elif act is None:  # (else it ran beside the router)
            act = self.shared_gate_up(xn)
        self.shared_down(act, out=x, residual=x, addend=routed)

    def _shared_down_beside(self, tokens: int) -> bool:
        """Whether the shared down runs beside the router too (FusedDecodeStep.shared_down_beside): where the routed
        experts' own down kernel adds the sums onto x (else that addition would be a launch of its own), or on a CPU,
        where launches cost nothing and everything runs in order."""
        if not self.step.shared_down_beside:
            return False
        return self.experts.adds_onto_residual_in_kernel(tokens) or self.step.side_stream is None

    def _shared_expert_beside(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The shared expert's gate_up (normalising x itself) and down on the step's side stream, beside the router
        and the routed experts' gate_up: (its activations, its output rounded as the down's epilogue rounds it, for
        MoEBackend.add_onto_residual, whose down kernel joins the side stream first). Both are allocated on the
        current stream, so the caller keeps both until that join."""
        act = self._shared_gate_up_beside(x)
        shared = torch.empty((x.shape[0], self.shared_down.rows), dtype=torch.bfloat16, device=x.device)
        with self.step.on_side_stream():
            self.shared_down(act, shared)
        return act, shared

    def _shared_gate_up_beside(self, x: torch.Tensor) -> torch.Tensor:
        """The shared gate_up normalising x itself, launched on the step's side stream after everything before it
        (FusedDecodeStep.shared_beside_router): it runs beside the router, which holds one block an SM on 32 of them
        at 512 experts (router_decode.cu), and the routed experts; the caller joins the side stream before the shared
        down. Its output is allocated on the current stream, which outlives its use."""
        act = torch.empty((x.shape[0], self.shared_gate_up.rows), dtype=torch.bfloat16, device=x.device)
        with self.step.on_side_stream():
            self.shared_gate_up(x, act, norm_weight=self.norm, eps=self.eps)
        return act

    def shared_expert(self) -> Any:
        """The shared expert's weights as the persistent MoE kernel takes them (a
        solo.kernels.cuda_moe.SharedExpert), or None where it has none or its projections are not block-FP8."""
        from solo.kernels.cuda_moe import SharedExpert

        if self.shared_gate_up is None:
            return None
        gate_up, down = (getattr(k, "fused", k) for k in (self.shared_gate_up, self.shared_down))
        if gate_up.scale_mode != 1 or down.scale_mode != 1 or gate_up.weight.dtype != torch.float8_e4m3fn:
            return None
        return SharedExpert(gate_up.weight, gate_up.scale, down.weight, down.scale, gate_up.limit)


def _swiglu_pair(mlp: SwiGLUMLP, step: FusedDecodeStep, name: str) -> tuple[FusedGemv, FusedGemv]:
    weight, scales, offsets = _fuse_rows([mlp.gate_proj, mlp.up_proj], name)
    half = mlp.gate_proj.out_features
    if offsets[1] != half:
        raise DecodeStepUnavailable(f"{name}: SwiGLU halves must be whole 128-row blocks")
    gate_up = FusedGemv(
        weight,
        scales,
        "block",
        swiglu_half=half,
        swiglu_limit=mlp.swiglu_limit,
        counter=step.counter("gemv"),
        name=name,
        launch=step.launch,
    )
    return gate_up, _gemv(mlp.down_proj, step, f"{name} down")


class _DenseMLP:
    def __init__(self, mlp: SwiGLUMLP, norm: torch.Tensor, eps: float, index: int, step: FusedDecodeStep) -> None:
        self.norm, self.eps = norm, eps
        self.gate_up, self.down = _swiglu_pair(mlp, step, f"layer {index} MLP")

    def __call__(self, x: torch.Tensor) -> None:
        act = self.gate_up(x, norm_weight=self.norm, eps=self.eps)
        self.down(act, out=x, residual=x)


class _Layer:
    def __init__(self, layer: DecoderLayer, step: FusedDecodeStep) -> None:
        index = layer.layer
        norm, eps = layer.input_layernorm.weight, layer.input_layernorm.eps
        if isinstance(layer.attention, KimiDeltaAttention):
            self.attention: Any = _KDAAttention(layer.attention, norm, eps, index, step)
        else:
            self.attention = _MLAAttention(layer.attention, norm, eps, index, step)
        post = layer.post_attention_layernorm
        if isinstance(layer.mlp, SparseMoE):
            self.mlp: Any = _MoE(layer.mlp, post.weight, post.eps, index, step)
        else:
            self.mlp = _DenseMLP(layer.mlp, post.weight, post.eps, index, step)

    def __call__(self, x, positions, cache, history) -> None:
        self.attention(x, positions, cache, history)
        self.mlp(x)


class FusedDecodeStep:
    """Decode and verification forwards (a few tokens) of `model` on the fused kernels; see the module
    docstring. `token_counts`: the token counts it serves (others go to the reference layers). `pdl`:
    launch its one-token calls' kernels with programmatic dependent launch (solo.kernels.pdl; sm_90+),
    and verification's too with `pdl_verify` (None: where the CUDA step kernels serve the whole
    verification window, which measured faster under PDL; the Triton ones measured slower).
    `kernels`: "cuda" runs the projections and routers of calls of up to `cuda_tokens` tokens on
    solo.kernels.cuda_step's CUDA kernels (larger calls on Triton), "triton" all on Triton, "auto"
    CUDA where every one of them can run (Hopper, NVRTC, FP8 projections), else Triton with the
    reason in `kernels_note`. `moe_router`: one token's MoE router inside the persistent MoE kernel
    (None: where it can run; True: required; False: not); `moe_shared`: also the shared expert (True:
    in every MoE layer or an error; None or False: not, as it measured slower)."""

    # the KDA recurrence and the MLA prep start once the CUDA GEMV before them has stored the rows they
    # read, while the output gate (computed last) still streams (solo.kernels.handoff); read at each call
    # (a lab switch until measured)
    handoff = False
    # one token's shared gate_up normalises x itself and waits for the MoE kernel only at its end
    # (gemv_decode.cu LATE_WAIT), so it computes while the MoE kernel's last blocks finish (a lab switch)
    shared_late_wait = False
    # one token's KDA kernel asks the L2 for its layer's output projection weight once its wait returns (HBM idles
    # while the recurrence runs; fused_kda.kda_decode's l2_ahead); read at each call. A lab switch: +46.8 us a step
    # at 32K on the H100 (docs/results/h100_ab_lab30.log), the output projection's own loads already stream then
    kda_l2_ahead = False
    # verification's (a separate router's) shared gate_up normalises x itself and runs on a side stream beside the
    # router and the routed experts, instead of after them on the router's normalised x (_MoE._shared_gate_up_beside;
    # read at each call): the router's 9 us a layer leave most SMs idle. Off here; a step sets it for its card
    # (SHARED_BESIDE_CARDS) at construction
    shared_beside_router = False
    # with shared_beside_router, verification's shared down runs on the side stream too, and the routed experts' down
    # kernel adds the routed sum and the shared expert's output onto x, in the order of the shared down's epilogue
    # (_MoE._shared_expert_beside, MoEBackend.add_onto_residual; read at each call). Off here; a step sets it for its
    # card (SHARED_DOWN_BESIDE_CARDS) at construction
    shared_down_beside = False

    def __init__(
        self,
        model: LingForCausalLM,
        token_counts: tuple[int, ...] = (1, 4),
        pdl: bool = False,
        kernels: str = "triton",
        cuda_tokens: int = 8,
        pdl_verify: bool | None = None,
        moe_router: bool | None = None,
        moe_shared: bool | None = None,
    ) -> None:
        _check_model(model)
        if kernels not in STEP_KERNELS:
            raise ValueError(f"unknown step kernels {kernels!r}; choose one of {', '.join(STEP_KERNELS)}")
        if pdl and (reason := pdl_unavailable(model.device)) is not None:
            raise PDLUnavailable(f"--pdl on: {reason}. Use --pdl off.")
        self.launch = LaunchPolicy(pdl, one_token_only=True)  # verification's PDL: set below, once the kernels are
        self.cuda_tokens = cuda_tokens
        self.model = model
        self.config = model.config
        self.token_counts = frozenset(token_counts)
        self.launch_counts = torch.zeros(len(FAMILIES), dtype=torch.int32, device=model.device)
        # the stream of work launched beside the step's own (on_side_stream); made here, not while a graph is captured
        self.side_stream = torch.cuda.Stream(model.device) if model.device.type == "cuda" else None
        # per-head counters the KDA kernels synchronise their programs on (zero between launches)
        self.kda_sync = torch.zeros(model.config.linear_num_heads, dtype=torch.int32, device=model.device)
        # the projections' hand-offs (signals, programs past the wait; zero between launches)
        self.handoff_counters = torch.zeros(2, dtype=torch.int32, device=model.device)
        # the fused KDA fronts' global exchange (fuse_kda_front): q, k and decay of every head, and the heads'
        # arrival and departure counters (zero between launches); made once, so that graphs outlive rebuilds
        heads, dk = model.config.linear_num_heads, model.config.linear_head_dim
        self.kda_exchange = (
            torch.zeros(heads * 3 * dk, dtype=torch.float32, device=model.device),
            torch.zeros(2 * heads + 2, dtype=torch.int32, device=model.device),  # (+ the grid-wide count: o_proj)
        )
        trunk = model.model.layers[: model.config.num_hidden_layers]
        self.layers = [_Layer(layer, self) for layer in trunk]
        self.embedding = model.model.word_embeddings.weight
        self.final_norm = model.model.norm
        self.nextn: _Layer | None = None
        nextn = model.nextn
        if nextn is not None:
            self.nextn = _Layer(nextn, self)
            self.eh_proj = _gemv(nextn.eh_proj, self, "NEXTN eh_proj")
            self.nextn_module: NextNLayer = nextn
        self.kernels, self.kernels_note = "triton", "step kernels triton requested" if kernels == "triton" else ""
        self.moe_router = moe_router
        if moe_router and kernels == "triton":
            raise StepKernelsUnavailable(
                "the router inside the MoE kernel runs with the CUDA step kernels; use --step-kernels auto or cuda"
            )
        if kernels != "triton":
            reason = self._use_cuda_kernels(strict=kernels == "cuda")
            if reason is not None and kernels == "cuda":
                raise StepKernelsUnavailable(f"--step-kernels cuda: {reason}.")
            self.kernels_note = reason or ""
        if moe_router and not self.routers_in_experts():
            raise StepKernelsUnavailable(
                f"--moe-router fused runs with the CUDA step kernels, which cannot run here: {self.kernels_note}. "
                "Use --moe-router auto."
            )
        if moe_shared and moe_router is False:
            raise StepKernelsUnavailable(
                "--moe-shared fused runs inside the MoE kernel with its router; drop --moe-router separate"
            )
        self.moe_shared = moe_shared
        self._shared_into_experts()
        self.l2_next: dict[str, Any] = {"megabytes": 0.0, "shared": False, "at": 0, "layers": 0}
        card = torch.cuda.get_device_name(model.device) if model.device.type == "cuda" else ""
        # the fused KDA front: the build running now (fuse_kda_front's arguments; None: the two kernels), the product's
        # on this card (what the step was made with), and why not where this card's could not run
        self.kda_front_build: dict[str, Any] | None = None
        self.kda_front_product: dict[str, Any] | None = None
        self.kda_front_note = ""
        if self.kernels == "cuda" and not self.kernels_note and (build := kda_front_for(card)) is not None:
            try:
                self.fuse_kda_front(True, **build)
                self.kda_front_product = build
            except StepKernelsUnavailable as exc:  # (a shape or a GPU it cannot run: the two kernels, said so)
                self.kda_front_note = str(exc)
        if self.routers_in_experts():  # (the persistent MoE kernels: this card's choices)
            if ahead := l2_next_for(card):
                self.prefetch_next_weights(ahead, shared=True, at=1)
            if window := gate_up_window_for(card):
                self.set_gate_up_window(window)
        self.shared_beside_router = shared_beside_for(card)  # (the product's on this card; bench modifiers force it)
        self.shared_down_beside = shared_down_beside_for(card)
        if pdl_verify is None:  # where the CUDA GEMV serves the whole window (the kernels share this policy)
            pdl_verify = self.kernels == "cuda" and not self.kernels_note and self.cuda_tokens >= max(self.token_counts)
        self.launch.one_token_only = not pdl_verify

    def _slots(self) -> list[tuple[Any, str]]:
        """(owner, attribute) of every one-token projection and router of the step."""
        slots: list[tuple[Any, str]] = []
        layers = self.layers + ([self.nextn] if self.nextn is not None else [])
        for layer in layers:
            slots += [(layer.attention, "proj"), (layer.attention, "dense")]
            if isinstance(layer.mlp, _MoE):
                slots.append((layer.mlp, "router"))
                if layer.mlp.shared_gate_up is not None:
                    slots += [(layer.mlp, "shared_gate_up"), (layer.mlp, "shared_down")]
            else:
                slots += [(layer.mlp, "gate_up"), (layer.mlp, "down")]
        if self.nextn is not None:
            slots.append((self, "eh_proj"))
        return slots

    def _use_cuda_kernels(self, strict: bool) -> str | None:
        """Put the projections and routers on the CUDA kernels (routers up to ROUTER_CUDA_TOKENS tokens).
        Returns None when all went, else what stayed on Triton and why: with `strict` nothing is changed
        then; otherwise the ones that can run go, and the note names the rest (the launch counters show
        both families)."""
        from solo.kernels.cuda_step import CudaGemv, CudaRouter, cuda_step_unavailable

        reason = cuda_step_unavailable(self.model.device)
        if reason is not None:
            return f"{reason}. Use --step-kernels triton" if strict else reason
        swaps, refused = [], []
        fused_routers = self._moes_that_route_inside()
        for owner, attr in self._slots():
            kernel = getattr(owner, attr)
            try:
                if isinstance(kernel, FusedRouter):
                    router_tokens = min(self.cuda_tokens, ROUTER_CUDA_TOKENS)
                    swaps.append((owner, attr, CudaRouter(kernel, self.counter("cuda_router"), router_tokens)))
                else:
                    cuda = CudaGemv(kernel, self.counter("cuda_gemv"), max_tokens=self.cuda_tokens)
                    swaps.append((owner, attr, cuda))
            except ValueError as exc:
                refused.append(str(exc))
        if refused and strict:
            more = f" (and {len(refused) - 1} more)" if len(refused) > 1 else ""
            return f"{refused[0]}{more}. Load with --block-fp8 on, or use --step-kernels auto or triton"
        for owner, attr, kernel in swaps:
            setattr(owner, attr, kernel)
        for owner in fused_routers:  # one token's router runs inside the MoE kernel, verification's on .router
            router = owner.router
            owner.routed_in_experts = router.fused if isinstance(router, CudaRouter) else router
        if swaps or fused_routers:
            self.kernels = "cuda"
        if refused:
            return f"{len(refused)} of {len(refused) + len(swaps)} projections and routers stay on Triton: {refused[0]}"
        return None

    def _shared_into_experts(self) -> None:
        """With `moe_shared` True, run each MoE layer's shared expert inside its persistent kernel (where
        the router runs there; all, or an error naming why not). Not by default: on the H200 at full shape
        the decode step measured 2.802 ms against 2.520 with the shared expert's own two kernels
        (docs/performance.md): the MoE kernel took 4.9 us longer a layer and the projection after it
        about 1.5 times as long."""
        if not self.moe_shared:
            return
        moes = self.routers_in_experts()
        chosen, refused = [], []
        for moe in moes:
            shared = moe.shared_expert()
            if shared is None:
                refused.append("the shared expert's projections are not block-FP8 (load with --block-fp8 on)")
            elif (reason := moe.experts.shared_unsupported(moe.routed_in_experts.top_k, shared)) is not None:
                refused.append(reason)
            else:
                chosen.append((moe, shared))
        if refused or not moes:
            why = refused[0] if refused else f"no MoE layer runs its router inside the MoE kernel ({self.kernels_note})"
            raise StepKernelsUnavailable(f"--moe-shared fused: {why}. Use --moe-shared auto.")
        for moe, shared in chosen:
            moe.shared_in_experts = shared

    def ring_big_projections(self, blocks_per_sm: int = 2, warps: int = 8) -> int:
        """A lab switch (bench modifier `bulk`): the CUDA projections of many rows (q|k|v|f|g|b, MLA
        q|kv_a|g, the dense MLP's gate_up) stream their weights through a ring of shared-memory slots filled
        by bulk copies (GemvLaunch.bulk), `blocks_per_sm` blocks of `warps` warps an SM. Their sums add K's
        slices in another order than the product's 4 warps (other roundings, as any change of warps). Not
        the product's: on the H100 the decode step ties (docs/performance.md section 0); the H200 is untried.
        Returns how many projections changed; their kernels are built again at the next call."""
        big = [kernel for kernel in self.cuda_projections() if kernel.rows >= BIG_PROJECTION_ROWS]
        for kernel in big:
            kernel.relaunch(dataclasses.replace(kernel.launch_config, bulk=blocks_per_sm, warps=warps))
        return len(big)

    def prefetch_next_weights(self, megabytes: float = L2_NEXT_MEGABYTES, shared: bool = True, at: int = 1) -> int:
        """Each MoE layer's one-token kernel (router inside) asks the L2 for weights the step reads after it,
        while HBM idles in its tail and in the short kernels after it: the layer's shared expert (`shared`) and
        the first `megabytes` of the next layer's input projection in its reading order (moe_decode.cu L2_NEXT),
        at `at` (DecodeKernelConfig.l2_next_at: 1 once its block's copies landed, 5 / 6 by its idle down warps
        while it routes / before; 0 never). A hint: every result stays the same. The product's on the cards of
        L2_NEXT_CARDS (set at construction); the reading order is the hand-off's where `handoff` is on now.
        Returns how many MoE layers ask for something."""
        count = 0
        for i, layer in enumerate(self.layers):
            moe = layer.mlp
            if not isinstance(moe, _MoE) or moe.routed_in_experts is None:
                continue
            regions: list[tuple[torch.Tensor, int, int]] = []
            if shared and moe.shared_gate_up is not None and moe.shared_in_experts is None:  # (inside: copied anyway)
                for weight in map(_weight, (moe.shared_gate_up, moe.shared_down)):
                    regions.append((weight, 0, weight.numel() * weight.element_size()))
            if megabytes > 0 and i + 1 < len(self.layers):
                attention = self.layers[i + 1].attention
                weight = _weight(attention.proj)
                row_bytes = weight.shape[1] * weight.element_size()
                start = task_order(weight.shape[0], *attention.handoff_rows)[0] * 8 if self.handoff else 0
                for first, nbytes in reading_order_bytes(weight.shape[0], row_bytes, start, int(megabytes * 2**20)):
                    regions.append((weight, first, nbytes))
            experts = moe.experts
            experts.prefetch_next(regions)
            when = at if regions else 0
            if experts.kernel_config.l2_next_at != when:
                experts.set_kernel_config(dataclasses.replace(experts.kernel_config, l2_next_at=when))
            count += bool(regions) and when > 0
        self.l2_next = {"megabytes": megabytes, "shared": shared, "at": at, "layers": count}
        return count

    def fuse_kda_front(
        self,
        on: bool = True,
        tasks_ahead: int = 2,
        min_blocks: int = 1,
        warps: int = 10,
        l2_ahead: int = 0,
        exchange: str = "global",
        ring: int = 0,
        o_proj: bool = False,
        g_last: bool = False,
        carveout: int = -1,
        l2_o_proj: int = 0,
    ) -> int:
        """One token's KDA layer front (norm, q|k|v|f|g|b, the short convolutions, the gates and the recurrence) as one
        launch of 4 blocks a head (solo.kernels.cuda_kda), instead of the CUDA GEMV and the Triton recurrence with a
        grid-wide boundary between them; verification keeps the two kernels. The product's on the cards of
        KDA_FRONT_CARDS with KDA_FRONT_BUILD (set at construction; bench modifiers kdafront / nokdafront). The build's
        fields are CudaKdaFront's; the defaults are the thirty-second session's best register build (+24 us a step
        at 32K on the H100, docs/performance.md section 0). `o_proj`: the layer's output projection inside the same
        launch too (with a ring and the global exchange); `g_last`: the g rows streamed after the recurrence (with a
        ring); `carveout`: the shared-memory share the kernel prefers; `l2_o_proj` 1 / 2: the blocks ask the L2 for
        the output projection's weight after the b task / before the wait (a hint). All KDA layers or an error naming
        why not; returns how many run it (0 with `on` False)."""
        from solo.kernels.cuda_kda import CudaKdaFront, fp32_gate_params

        kdas = [layer.attention for layer in self.layers if isinstance(layer.attention, _KDAAttention)]
        if not on:
            for attention in kdas:
                attention.front = None
            self.kda_front_build = None
            return 0
        fronts = []
        for attention in kdas:
            if not isinstance(attention.proj, CudaGemv) or (o_proj and not isinstance(attention.dense, CudaGemv)):
                raise StepKernelsUnavailable(
                    f"the fused KDA front runs with the CUDA step kernels; layer {attention.index}'s projection is "
                    f"on Triton ({self.kernels_note or 'step kernels triton'})"
                )
            fused = attention.proj.fused
            if attention.gate_params is None:
                attention.gate_params = fp32_gate_params(attention.attn)
            try:
                front = CudaKdaFront(
                    fused.weight,
                    fused.scale,
                    attention.attn,
                    self.counter("cuda_kda_front"),
                    tasks_ahead=tasks_ahead,
                    min_blocks=min_blocks,
                    warps=warps,
                    l2_ahead=l2_ahead,
                    exchange=exchange,
                    exchange_buffers=self.kda_exchange,
                    gate_params=attention.gate_params,
                    ring=ring,
                    scale_mode=fused.scale_mode,
                    o_proj=attention.dense if o_proj else None,
                    g_last=g_last,
                    carveout=carveout,
                    l2_next=(_weight(attention.dense), l2_o_proj) if l2_o_proj else None,
                )
                for lazy in (False, True):  # (built now: a GPU the build cannot run is refused here, not mid-step)
                    front.kernel(lazy)
            except ValueError as exc:
                raise StepKernelsUnavailable(f"layer {attention.index}: {exc}") from None
            fronts.append((attention, front))
        for attention, front in fronts:
            attention.front = front
        build = {"tasks_ahead": tasks_ahead, "min_blocks": min_blocks, "warps": warps, "l2_ahead": l2_ahead}
        build |= {"exchange": exchange, "ring": ring, "o_proj": o_proj, "g_last": g_last, "carveout": carveout}
        self.kda_front_build = {**build, "l2_o_proj": l2_o_proj} if fronts else None
        return len(fronts)

    def restore_kda_front(self) -> int:
        """This card's KDA front again (kda_front_product, or the two kernels where it has none), after a lab build."""
        return self.fuse_kda_front(self.kda_front_product is not None, **(self.kda_front_product or {}))

    def kda_fronts(self) -> int:
        """How many KDA layers run one token's front as one launch (fuse_kda_front)."""
        return sum(
            isinstance(layer.attention, _KDAAttention) and layer.attention.front is not None for layer in self.layers
        )

    def set_gate_up_window(self, tiles: int) -> int:
        """Each MoE layer's one-token kernel (router inside) keeps at most `tiles` of its gate_up tiles in flight
        (DecodeKernelConfig.gate_up_window; 0: all at once). Only when the copies are issued changes: every result
        stays the same. The product's on the cards of GATE_UP_WINDOW_CARDS (set at construction). Returns how many
        MoE layers run a window."""
        experts = [moe.experts for moe in self.routers_in_experts()]
        for e in experts:
            if e.kernel_config.gate_up_window != tiles:
                e.set_kernel_config(dataclasses.replace(e.kernel_config, gate_up_window=tiles))
        return len(experts) if tiles else 0

    def gate_up_window(self) -> int:
        """The gate_up tiles the MoE kernels keep in flight (0: all at once, or no MoE kernel routes inside)."""
        return max((moe.experts.kernel_config.gate_up_window for moe in self.routers_in_experts()), default=0)

    def mla_early_chunks(self) -> int:
        """The steps of old cache rows one token's MLA attention asks the L2 for before it waits for the prep
        (AttendLaunch.early_chunks, under PDL only; the product's on the cards of
        solo.kernels.fused_mla.EARLY_CHUNK_CARDS); 0 where none does."""
        if not self.launch.pdl:
            return 0
        return max((mla.ONE_TOKEN.early_chunks for mla in self._mlas()), default=0)

    def mla_gluon(self) -> bool:
        """Whether one token's MLA attention is the Gluon ring (AttendLaunch.gluon: the product's on the cards of
        solo.kernels.fused_mla.GLUON_RING_CARDS where Gluon can run), not the Triton kernel."""
        return any(mla.ONE_TOKEN.gluon for mla in self._mlas())

    def shared_expert_beside_router(self) -> bool:
        """Whether verification's whole shared expert runs beside its router: shared_down_beside needs the shared
        gate_up there too (shared_beside_router)."""
        return self.shared_beside_router and self.shared_down_beside

    def mla_gluon_window(self) -> bool:
        """Whether verification's MLA attention is the Gluon ring (the product's on the cards of
        solo.kernels.fused_mla.GLUON_WINDOW_CARDS where Gluon can run), not the Triton kernel."""
        return any(mla.WINDOW.gluon for mla in self._mlas())

    def _mlas(self) -> list[FusedMLA]:
        """The MLA layers' kernels (solo.kernels.fused_mla.FusedMLA)."""
        return [layer.attention.mla for layer in self.layers if isinstance(layer.attention, _MLAAttention)]

    def window_rings(self) -> int:
        """How many CUDA projections run verification's calls through a bulk ring (GemvLaunch.window: the
        product's on the cards of solo.kernels.cuda_step.WINDOW_RING_CARDS)."""
        windows = [kernel.launch_config.window for kernel in self.cuda_projections()]
        return sum(window is not None and window.bulk > 0 for window in windows)

    def cuda_projections(self) -> list[CudaGemv]:
        """The step's projections that run on the CUDA GEMV (the others stay on Triton's)."""
        return [kernel for kernel in (getattr(o, a) for o, a in self._slots()) if isinstance(kernel, CudaGemv)]

    def shared_in_experts(self) -> list[_MoE]:
        """The MoE layers whose shared expert runs inside the persistent MoE kernel (one token)."""
        return [owner for owner in self.routers_in_experts() if owner.shared_in_experts is not None]

    def routers_in_experts(self) -> list[_MoE]:
        """The MoE layers whose one-token router runs inside the persistent MoE kernel."""
        return [owner for owner, attr in self._slots() if attr == "router" and owner.routed_in_experts is not None]

    def _moes_that_route_inside(self) -> list[_MoE]:
        """The MoE layers whose one-token router will run inside the persistent MoE kernel
        (--moe-backend cuda): all that can unless `moe_router` is False; with True, all or an error."""
        if self.moe_router is False:
            return []
        from solo.kernels.cuda_moe import PersistentDecodeMoE

        layers = self.layers + ([self.nextn] if self.nextn is not None else [])
        moes = [layer.mlp for layer in layers if isinstance(layer.mlp, _MoE)]
        fused, refused = [], []
        for moe in moes:
            experts = moe.experts
            if not isinstance(experts, PersistentDecodeMoE):
                refused.append(f"the MoE backend is {getattr(experts, 'name', type(experts).__name__)}, not cuda")
            elif (reason := experts.routed_unsupported(moe.router)) is not None:
                refused.append(reason)
            else:
                fused.append(moe)
        if refused and self.moe_router:
            raise StepKernelsUnavailable(
                f"--moe-router fused: {refused[0]}. Use --moe-backend cuda, or --moe-router separate."
            )
        return fused

    def counter(self, family: str, n: int = 1) -> torch.Tensor:
        """The device counter of a kernel family (a view into `launch_counts`; n consecutive ones)."""
        i = FAMILIES.index(family)
        return self.launch_counts[i : i + n]

    def launches(self) -> dict[str, int]:
        """Launches of each kernel family so far (read from the device; graph replays included)."""
        return dict(zip(FAMILIES, self.launch_counts.tolist(), strict=True))

    def families_per_step(self) -> set[str]:
        """The kernel families one decode step launches (the start-up check expects each to run)."""
        families = {"rmsnorm"}
        for owner, attr in self._slots():
            inside = attr == "router" and owner.routed_in_experts is not None
            if attr.startswith("shared_") and owner.shared_in_experts is not None:
                continue  # (inside the MoE kernel: counted as moe_shared)
            families.add("moe_router" if inside else getattr(owner, attr).family)
        if self.shared_in_experts():
            families.add("moe_shared")
        for layer in self.layers:
            if isinstance(layer.attention, _KDAAttention):
                families.add("kda" if layer.attention.front is None else "cuda_kda_front")
            else:
                families |= {"mla_prep", "mla_attend", "mla_combine"}
        return families

    @contextlib.contextmanager
    def on_side_stream(self) -> Iterator[None]:
        """Launches inside go to the side stream, after everything launched so far on the current stream (inside a
        graph's capture too: the side stream joins it); until `join_side_stream`, they may run beside what the
        current stream launches next. On a CPU they simply run in order."""
        if self.side_stream is None:
            yield
            return
        self.side_stream.wait_stream(torch.cuda.current_stream(self.side_stream.device))
        with torch.cuda.stream(self.side_stream):
            yield

    def join_side_stream(self) -> None:
        """What the current stream launches from now on waits for what the side stream has launched."""
        if self.side_stream is not None:
            torch.cuda.current_stream(self.side_stream.device).wait_stream(self.side_stream)

    def serves(self, tokens: int) -> bool:
        return tokens in self.token_counts

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        cache: HybridCache,
        kda_history: dict[int, KDAHistory] | None = None,
    ) -> torch.Tensor:
        """The reference model's forward (final-norm hidden states [T, hidden]) for T served tokens."""
        if kda_history is not None and kda_history is not cache.verification:
            cache.settle_kda()  # (the KDA kernels read kda_recurrent for a pass into another history)
        x = F.embedding(input_ids, self.embedding)
        for layer in self.layers:
            layer(x, positions, cache, kda_history)
        return rmsnorm(x, self.final_norm.weight, self.final_norm.eps, self.counter("rmsnorm"), self.launch)

    def draft_forward(
        self, input_ids: torch.Tensor, previous_hidden: torch.Tensor, positions: torch.Tensor, cache: HybridCache
    ) -> torch.Tensor:
        """The NEXTN layer's hidden states (see LingForCausalLM.draft_forward)."""
        assert self.nextn is not None
        n = self.nextn_module
        e = F.embedding(input_ids, self.embedding)
        h = e.shape[1]
        both = torch.empty((e.shape[0], 2 * h), dtype=e.dtype, device=e.device)  # [enorm(e) | hnorm(hidden)]
        rmsnorm(e, n.enorm.weight, n.enorm.eps, self.counter("rmsnorm"), self.launch, out=both[:, :h])
        hidden = previous_hidden.to(e.dtype).contiguous()
        rmsnorm(hidden, n.hnorm.weight, n.hnorm.eps, self.counter("rmsnorm"), self.launch, out=both[:, h:])
        x = self.eh_proj(both)
        self.nextn(x, positions, cache, None)
        return rmsnorm(x, n.final_layernorm.weight, n.final_layernorm.eps, self.counter("rmsnorm"), self.launch)

    @torch.inference_mode()
    def warmup(self) -> None:
        """Compile (or load from Triton's disk cache) every kernel for every served token count, on a
        scratch cache, so nothing compiles during a request."""
        config, device = self.config, self.model.device
        cache = HybridCache(config, 64, device, torch.bfloat16, with_nextn=True)
        for t in sorted(self.token_counts):
            ids = torch.zeros(t, dtype=torch.long, device=device)
            positions = torch.arange(t, device=device)
            history = cache.new_history(t) if t > 1 else None
            hidden = self.forward(ids, positions, cache, history)
            if self.nextn is not None:
                self.draft_forward(ids, hidden, positions + 1, cache)
        self.launch_counts.zero_()

    def describe(self) -> dict[str, Any]:
        return {
            "kernels": list(FAMILIES),
            "token_counts": sorted(self.token_counts),
            "layers": len(self.layers),
            "pdl": self.launch.pdl,
            "pdl_verify": self.launch.pdl and not self.launch.one_token_only,
            "step_kernels": self.kernels,
            "cuda_tokens": self.cuda_tokens if self.kernels == "cuda" else 0,
            "routers_in_experts": len(self.routers_in_experts()),
            "shared_in_experts": len(self.shared_in_experts()),
            "handoff": self.handoff,
            "shared_late_wait": self.shared_late_wait,
            "shared_beside_router": self.shared_beside_router,
            "shared_down_beside": self.shared_expert_beside_router(),
            "kda_l2_ahead": self.kda_l2_ahead,
            "kda_fronts": self.kda_fronts(),
            "kda_front_build": self.kda_front_build,
            **({"kda_front_note": self.kda_front_note} if self.kda_front_note else {}),
            "l2_next": dict(self.l2_next),
            "mla_early_chunks": self.mla_early_chunks(),
            "mla_gluon": self.mla_gluon(),
            "mla_gluon_window": self.mla_gluon_window(),
            "gate_up_window": self.gate_up_window(),
            **({"step_kernels_note": self.kernels_note} if self.kernels_note else {}),
        }


def _check_model(model: LingForCausalLM) -> None:
    reason = fused_step_unavailable(model)
    if reason is not None:
        raise DecodeStepUnavailable(reason)

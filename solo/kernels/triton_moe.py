"""Routed MoE in MXFP4 with Triton: ``TritonMoE`` (``--moe-backend triton``).

Two kernel families, chosen by the token count T only (static per captured CUDA graph):

- T <= ``MoEConfig.gemv_max_tokens`` (decode, verification, prompts up to 96 tokens): the CUDA-core GEMV kernels of
  solo.kernels.triton_mxfp4_gemv, one GEMV per (token, expert) assignment, no host synchronisation,
  no data-dependent Python control flow, capturable in a CUDA graph.
- Larger T (longer prompts): the grouped tensor-core kernels of solo.kernels.triton_moe_grouped.
  Assignments are sorted by expert on the device (solo.kernels.routing.align_routing), so every
  weight tile is read once for up to ``pf_block_t`` tokens of its expert.

Layouts: gate rows [0, I), up rows [I, 2I) of ``gate_up``; scales [E, 2I, H/32] and [E, H, I/32] as
in the checkpoint (see solo.kernels.moe); the E2M1 codes repacked at construction into 32-bit words
(solo.kernels.triton_mxfp4_gemv.pack_e2m1_words; same size, the checkpoint's code tensors are not
kept). Timings: docs/kernels.md.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import triton  # noqa: E402,I001  (triton_fp8 configured the cache directory first)

from solo.kernels.moe import CompileEvidence, MoEBackend, MXFP4Experts
from solo.kernels.routing import align_routing
from solo.kernels.triton_epilogues import split_scratch
from solo.kernels.triton_fp8 import (
    interpreter_mode,
    kernel_cache_report,
    measure_compile,
    require_triton_device,
    triton_artifacts,
    triton_cache_dir,
)
from solo.kernels.triton_moe_grouped import F16_MAX_SCALE, _grouped_down, _grouped_gate_up_act, max_blocks
from solo.kernels.triton_mxfp4_gemv import _gemv_down_combine, _gemv_gate_up_act, gdc_wait, pack_e2m1_words

__all__ = ["MoEConfig", "TritonMoE", "kernel_cache_report"]


@dataclass(frozen=True)
class MoEConfig:
    """Launch parameters of the Triton MoE kernels (see docs/kernels.md for how they were chosen)."""

    # Grouped tensor-core path (solo.kernels.triton_moe_grouped), used for T > gemv_max_tokens.
    # Tuned on the H200 (python -m solo.bench.kernels --tune --quick --cases moe, T = 64 and 512).
    pf_block_t: int = 16  # assignment rows per block (the MMA's N side)
    pf_block_i: int = 64
    pf_block_h: int = 64
    pf_block_k: int = 256
    pf_warps: int = 4
    pf_stages: int = 3
    # fp16 tensor-core products from the GEMV unpacking (exact for the checkpoint's scale range, checked
    # at load) instead of tl.dot_scaled on checkpoint bytes
    pf_f16: bool = True
    # CUDA-core GEMV path (solo.kernels.triton_mxfp4_gemv), used for T <= gemv_max_tokens.
    # Tuned on the H200 at Ling-3.0-flash shapes (python -m solo.bench.kernels --tune --cases gemv).
    # Above this the grouped path: on the H200 the GEMV path is faster up to about 100 tokens
    # (0.56 ms vs 0.86 ms per layer at 64, 1.08 vs 0.88 at 128; docs/kernels.md).
    gemv_max_tokens: int = 96
    gv_gu_block_n: int = 8
    gv_gu_block_w: int = 64  # 32-bit words (8 codes each) per row per K tile
    gv_gu_warps: int = 2  # (no num_stages: the GEMV K loops are unrolled, nothing to pipeline)
    gv_dn_block_n: int = 32
    gv_dn_block_w: int = 32
    gv_dn_warps: int = 4
    gv_dn_split_e: int = 8
    gv_pdl: bool = True  # down kernel launched early (programmatic dependent launch), waits for act
    gv_early_weights: bool = True  # down loads its weights before that wait (used for T > 1 only)


def _fit_block(block: int, extent: int, floor: int) -> int:
    """Largest power of two <= block that is still useful for a dimension of size extent."""
    while block > floor and block // 2 >= extent:
        block //= 2
    return block


class TritonMoE(MoEBackend):
    """MXFP4 routed experts with two fused Triton kernels (see module docstring)."""

    name = "triton"

    def __init__(
        self,
        experts: MXFP4Experts,
        dtype: torch.dtype = torch.bfloat16,
        swiglu_limit: float | None = None,
        config: MoEConfig | None = None,
    ) -> None:
        super().__init__(swiglu_limit)
        if not isinstance(experts, MXFP4Experts):
            raise TypeError("TritonMoE runs MXFP4 experts (MXFP4Experts)")
        require_triton_device("--moe-backend triton", experts.gate_up.device)
        if dtype != torch.bfloat16:
            raise ValueError(f"TritonMoE computes in bf16; got dtype {dtype}")
        self.dtype = dtype
        e, two_i, h_half = experts.gate_up.shape
        self.num_experts = e
        self.inter = two_i // 2
        self.hidden = h_half * 2
        if self.hidden % 32 or self.inter % 32:
            raise ValueError(f"MXFP4 needs H and I multiples of 32, got H={self.hidden} I={self.inter}")
        shapes = {
            "gate_up": (experts.gate_up, (e, 2 * self.inter, self.hidden // 2)),
            "gate_up_scale": (experts.gate_up_scale, (e, 2 * self.inter, self.hidden // 32)),
            "down": (experts.down, (e, self.hidden, self.inter // 2)),
            "down_scale": (experts.down_scale, (e, self.hidden, self.inter // 32)),
        }
        tensors = {}
        for key, (tensor, shape) in shapes.items():
            if tuple(tensor.shape) != shape:
                raise ValueError(f"{key} must be {shape}, got {tuple(tensor.shape)}")
            tensors[key] = tensor.view(torch.uint8).contiguous()  # uint8 view; no copy if contiguous
        self.device = experts.gate_up.device
        # Codes repacked into the GEMV kernels' word layout (same size; the checkpoint's tensors are
        # not kept, so the caller can free them). Both kernel families read these words.
        self.gate_up_words = pack_e2m1_words(tensors["gate_up"])
        self.down_words = pack_e2m1_words(tensors["down"])
        self.gate_up_scale = tensors["gate_up_scale"]
        self.down_scale = tensors["down_scale"]
        top_scale = max(int(self.gate_up_scale.max()), int(self.down_scale.max()))
        # whether the prefill's fp16 products are exact for these scales (else tl.dot_scaled is used)
        self.f16_products_exact = top_scale <= F16_MAX_SCALE
        self.config = config or MoEConfig()
        self._scratch: dict[str, torch.Tensor] = {}
        self.path_calls = {"gemv": 0, "tensor_core": 0}  # eager forwards per kernel family
        self._warmup: dict[str, Any] | None = None

    @property
    def config(self) -> MoEConfig:
        return self._config

    @config.setter
    def config(self, base: MoEConfig) -> None:
        """Launch parameters, with block sizes shrunk to fit small (test) shapes."""
        words_h, words_i = self.hidden // 8, self.inter // 8
        self._config = dataclasses.replace(
            base,
            pf_block_i=_fit_block(base.pf_block_i, self.inter, 16),
            pf_block_h=_fit_block(base.pf_block_h, self.hidden, 16),
            pf_block_k=max(_fit_block(base.pf_block_k, min(self.hidden, self.inter), 64), 128 if base.pf_f16 else 64),
            gv_gu_block_n=_fit_block(base.gv_gu_block_n, self.inter, 1),
            gv_gu_block_w=_fit_block(base.gv_gu_block_w, words_h, 4),
            gv_dn_block_n=_fit_block(base.gv_dn_block_n, self.hidden, 1),
            gv_dn_block_w=_fit_block(base.gv_dn_block_w, words_i, 4),
        )
        self._pdl = (
            base.gv_pdl
            and not interpreter_mode()
            and gdc_wait is not None
            and torch.cuda.get_device_capability(self.device)[0] >= 9
        )

    def uses_pdl(self) -> bool:
        """Programmatic dependent launch: Hopper or newer, a Triton that has it, and asked for
        (decided when the config is set, not on every launch)."""
        return self._pdl

    def uses_f16_prefill(self) -> bool:
        """Grouped kernels on fp16 products (asked for, and exact for this checkpoint's scales)."""
        return self.config.pf_f16 and self.f16_products_exact

    def probe_prompt_tokens(self) -> int:
        """One token more than the GEMV path takes: the prefill then runs the grouped kernels."""
        return self.config.gemv_max_tokens + 1

    def family_for(self, tokens: int) -> str:
        return "gemv" if self.uses_gemv(tokens) else "tensor_core"

    def kernel_evidence(self) -> dict[str, Any]:
        return {
            "dependent_launch": self.uses_pdl(),
            "prefill_products": "fp16" if self.uses_f16_prefill() else "dot_scaled",
        }

    KERNELS = ("_gemv_gate_up_act", "_gemv_down_combine", "_grouped_gate_up_act", "_grouped_down")

    def compile_evidence(self) -> CompileEvidence:
        record = self._warmup or {}
        if interpreter_mode():
            return CompileEvidence("triton-interpreter", "", seconds=record.get("seconds", 0.0))
        cache_dir = triton_cache_dir()
        return CompileEvidence(
            "triton",
            cache_dir,
            triton_artifacts(self.KERNELS),
            record.get("new_cache_entries", 0),
            record.get("seconds", 0.0),
        )

    def uses_gemv(self, tokens: int) -> bool:
        """Whether T tokens run on the CUDA-core GEMV kernels (else the tensor-core kernels)."""
        return tokens <= self.config.gemv_max_tokens

    def forward(
        self,
        x: torch.Tensor,
        topk_ids: torch.Tensor,
        topk_weights: torch.Tensor,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """See MoEBackend.forward; ``out`` ([T, H], x.dtype) may be given to reuse a buffer."""
        t, top_k = topk_ids.shape
        out = self._output(x, t, out)
        if t == 0:
            return out
        xb, ids, wts = self._operands(x, topk_ids, topk_weights)
        act = torch.empty((t * top_k, self.inter), dtype=torch.bfloat16, device=x.device)
        if self.uses_gemv(t):
            self.path_calls["gemv"] += 1
            self.launch_gemv_gate_up(xb, ids, act, top_k)
            self.launch_gemv_down(act, ids, wts, out, top_k)
        else:
            self.path_calls["tensor_core"] += 1
            self.launch_grouped(xb, ids, wts, act, out, top_k)
        return out

    def adds_onto_residual_in_kernel(self, tokens: int) -> bool:
        """The GEMV path's down kernel adds the routed sum onto the residual stream itself (add_onto_residual)."""
        return self.uses_gemv(tokens)

    def add_onto_residual(
        self,
        x: torch.Tensor,
        topk_ids: torch.Tensor,
        topk_weights: torch.Tensor,
        residual: torch.Tensor,
        shared: torch.Tensor,
        before_down: Callable[[], None] | None = None,
    ) -> None:
        """See MoEBackend.add_onto_residual; where adds_onto_residual_in_kernel (the GEMV path) the down kernel's last
        program of each slot adds its rows (triton_epilogues.store_rows_onto), and `before_down` runs between the
        gate_up and the down kernels."""
        t, top_k = topk_ids.shape
        if not self.adds_onto_residual_in_kernel(t):
            super().add_onto_residual(x, topk_ids, topk_weights, residual, shared, before_down)
            return
        self._check_onto(residual, shared, t)
        self.calls += 1
        self.path_calls["gemv"] += 1
        xb, ids, wts = self._operands(x, topk_ids, topk_weights)
        act = torch.empty((t * top_k, self.inter), dtype=torch.bfloat16, device=x.device)
        self.launch_gemv_gate_up(xb, ids, act, top_k)
        if before_down is not None:
            before_down()
        self.launch_gemv_down(act, ids, wts, residual, top_k, shared=shared)

    def _output(self, x: torch.Tensor, tokens: int, out: torch.Tensor | None) -> torch.Tensor:
        """Check x against T tokens; the given ``out`` checked, or a new one in x.dtype."""
        if x.shape != (tokens, self.hidden):
            raise ValueError(f"x must be [{tokens}, {self.hidden}], got {tuple(x.shape)}")
        if out is None:
            return torch.empty((tokens, self.hidden), dtype=x.dtype, device=x.device)
        if out.shape != (tokens, self.hidden) or out.stride(-1) != 1:
            raise ValueError(f"out must be a row-major [{tokens}, {self.hidden}] tensor")
        return out

    @staticmethod
    def _operands(
        x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x as bf16 rows, the ids flat (int32 or int64) and the weights flat fp32, copied only if needed."""
        xb = x if x.dtype == torch.bfloat16 else x.to(torch.bfloat16)
        if xb.stride(-1) != 1:
            xb = xb.contiguous()
        ids = topk_ids.reshape(-1)
        if ids.dtype not in (torch.int32, torch.int64) or not ids.is_contiguous():
            ids = ids.to(torch.int32).contiguous()
        wts = topk_weights.reshape(-1)
        if wts.dtype != torch.float32 or not wts.is_contiguous():
            wts = wts.float().contiguous()
        return xb, ids, wts

    def down_split(self, tokens: int, top_k: int) -> int:
        """Programs sharing one token's experts in the GEMV down kernel (static per T; 1 off that path)."""
        if self.uses_gemv(tokens):
            most = max(1, self.config.gv_dn_split_e)
            return max(d for d in range(1, top_k + 1) if top_k % d == 0 and d <= most)
        return 1

    def reserve(self, max_tokens: int, top_k: int) -> None:
        """Allocate the split-reduction scratch for up to max_tokens (do it before graph capture)."""
        for t in range(max_tokens, 0, -1):  # largest first: a stored buffer is never grown
            self._scratch_for(t, top_k)

    def _scratch_for(self, tokens: int, top_k: int) -> tuple[torch.Tensor, ...]:
        cfg = self.config
        dn = self.down_split(tokens, top_k)
        if self.uses_gemv(tokens):
            slots = tokens * triton.cdiv(self.hidden, cfg.gv_dn_block_n)
            dev = self.device
            return (
                split_scratch(self._scratch, "gv_dn_part", slots * dn * cfg.gv_dn_block_n, torch.float32, False, dev),
                split_scratch(self._scratch, "gv_dn_cnt", slots, torch.int32, True, dev),
            )
        return ()

    def launch_grouped(
        self,
        xb: torch.Tensor,
        ids: torch.Tensor,
        wts: torch.Tensor,
        act: torch.Tensor,
        out: torch.Tensor,
        top_k: int,
    ) -> None:
        """Grouped path (large T): sort assignments by expert, two tensor-core kernels, sum over k."""
        cfg = self.config
        n = ids.numel()
        tokens = n // top_k
        sorted_ids, expert_ids, npad = align_routing(ids, cfg.pf_block_t)
        blocks = min(n, max_blocks(n, self.num_experts, cfg.pf_block_t))  # a block holds >= 1 row
        limit = float(self.swiglu_limit) if self.swiglu_limit is not None else 0.0
        common = dict(
            BLOCK_T=cfg.pf_block_t,
            BLOCK_K=cfg.pf_block_k,
            F16=self.uses_f16_prefill(),
            num_warps=cfg.pf_warps,
            num_stages=cfg.pf_stages,
        )
        _grouped_gate_up_act[(blocks, triton.cdiv(self.inter, cfg.pf_block_i))](
            xb,
            sorted_ids,
            expert_ids,
            npad,
            self.gate_up_words,
            self.gate_up_scale,
            act,
            n,
            xb.stride(0),
            limit,
            H=self.hidden,
            I=self.inter,
            TOPK=top_k,
            HAS_LIMIT=self.swiglu_limit is not None,
            BLOCK_I=cfg.pf_block_i,
            **common,
        )
        y = torch.empty((n, self.hidden), dtype=torch.float32, device=xb.device)
        _grouped_down[(blocks, triton.cdiv(self.hidden, cfg.pf_block_h))](
            act,
            sorted_ids,
            expert_ids,
            npad,
            wts,
            self.down_words,
            self.down_scale,
            y,
            n,
            H=self.hidden,
            I=self.inter,
            BLOCK_H=cfg.pf_block_h,
            **common,
        )
        out.copy_(y.view(tokens, top_k, self.hidden).sum(dim=1))  # fixed order over the k experts

    def launch_gemv_gate_up(self, xb: torch.Tensor, ids: torch.Tensor, act: torch.Tensor, top_k: int) -> None:
        """GEMV kernel 1 (small T): act[a] = swiglu(W_gate[e_a] x_t, W_up[e_a] x_t)."""
        cfg = self.config
        limit = float(self.swiglu_limit) if self.swiglu_limit is not None else 0.0
        if xb.stride(0) % 2:
            xb = xb.contiguous()
        xq = xb.view(torch.int32)  # bf16 pairs
        _gemv_gate_up_act[(ids.numel(), triton.cdiv(self.inter, cfg.gv_gu_block_n))](
            xq,
            ids,
            self.gate_up_words,
            self.gate_up_scale,
            act,
            xq.stride(0),
            limit,
            H=self.hidden,
            I=self.inter,
            TOPK=top_k,
            HAS_LIMIT=self.swiglu_limit is not None,
            BLOCK_N=cfg.gv_gu_block_n,
            BLOCK_W=cfg.gv_gu_block_w,
            PDL=self.uses_pdl(),
            num_warps=cfg.gv_gu_warps,
        )

    def launch_gemv_down(
        self,
        act: torch.Tensor,
        ids: torch.Tensor,
        wts: torch.Tensor,
        out: torch.Tensor,
        top_k: int,
        shared: torch.Tensor | None = None,
    ) -> None:
        """GEMV kernel 2 (small T): out[t] = sum_j w[t, j] * W_down[e_tj] act[t*k + j]; with `shared` (same shape and
        strides as out) out[t] = (out[t] + shared[t]) + that sum rounded (add_onto_residual)."""
        cfg = self.config
        tokens = out.shape[0]
        split = self.down_split(tokens, top_k)
        part, cnt = self._scratch_for(tokens, top_k)
        pdl = self.uses_pdl()
        _gemv_down_combine[(tokens, triton.cdiv(self.hidden, cfg.gv_dn_block_n), split)](
            act.view(torch.int32),  # bf16 pairs; act is a contiguous [T*k, I] buffer
            ids,
            wts,
            self.down_words,
            self.down_scale,
            out,
            part,
            cnt,
            out.stride(0),
            shared if shared is not None else out,  # (not read without ONTO)
            H=self.hidden,
            I=self.inter,
            TOPK=top_k,
            BLOCK_N=cfg.gv_dn_block_n,
            BLOCK_W=cfg.gv_dn_block_w,
            SPLIT_E=split,
            PDL=pdl,
            EARLY_WEIGHTS=cfg.gv_early_weights and tokens > 1,
            ONTO=shared is not None,
            num_warps=cfg.gv_dn_warps,
            **({"launch_pdl": True} if pdl else {}),
        )

    def warmup(self, top_k: int = 8, max_tokens: int = 4) -> dict[str, Any]:
        """Compile (or load from Triton's disk cache) the kernels for this layer's shapes.

        The token count is a runtime argument, so one compile serves every T of a path; the call
        runs the op on dummy routing for T = 1, T = max_tokens and the first T of the tensor-core
        path (prefill), so no kernel is compiled mid-generation. Returns the timing record.
        """
        dev = self.device
        self.reserve(max(1, max_tokens), top_k)
        first_mma = self.config.gemv_max_tokens + 1
        with measure_compile("moe", hidden=self.hidden, inter=self.inter, top_k=top_k) as m:
            for t in sorted({1, max(1, max_tokens), first_mma}):
                x = torch.zeros((t, self.hidden), dtype=torch.bfloat16, device=dev)
                ids = (torch.arange(t * top_k, device=dev) % self.num_experts).view(t, top_k)
                w = torch.full((t, top_k), 1.0 / top_k, dtype=torch.float32, device=dev)
                self.forward(x, ids, w)
        assert m.record is not None
        self._warmup = {
            "what": m.record.what,
            "seconds": m.record.seconds,
            "new_cache_entries": m.record.new_cache_entries,
            "interpreter": interpreter_mode(),
        }
        return dict(self._warmup)

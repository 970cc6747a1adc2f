"""Routed MoE in MXFP4 with Triton: ``TritonMoE`` (``--moe-backend triton``).

For T <= ``MoEConfig.gemv_max_tokens`` tokens (decode, verification) it runs the CUDA-core GEMV
kernels of solo.kernels.triton_mxfp4_gemv; above that (prefill) the tensor-core kernels below. The
choice depends on T only, which is static per captured CUDA graph.

Tensor-core path: two launches, no host synchronisation, no data-dependent Python control flow:

1. ``_moe_gate_up_act``: grid (T*k assignments, I/BLOCK_I, K splits). Each program reads its expert
   id, streams BLOCK_I gate rows and the matching BLOCK_I up rows of that expert over its share of H,
   dequantizing MXFP4 in registers (``tl.dot_scaled``: E2M1 codes and E8M0 scales are widened to
   bf16 and multiplied on the tensor cores against the token's activation, fp32 accumulation),
   applies SwiGLU (optional Ling clamp) in fp32 and writes act[a, i] in bf16 ([T*k, I], tiny).
2. ``_moe_down_combine``: grid (T, H/BLOCK_H, expert splits). Each program owns BLOCK_H output
   features of one token and walks its share of that token's k experts (one flat loop over experts
   x K-slices, so the loads pipeline across experts), accumulating routing_weight * (W_down[e] @ act)
   in fp32 registers.

Splits are used only while the grid is small (one token: 96 gate_up programs on 132 SMs): each split
parks its fp32 partial in a scratch buffer, and the last program to arrive (an acq_rel atomic counter)
adds the partials in a fixed order, finishes (SwiGLU / output store) and resets its counter to zero.
Results are deterministic, every output element is written exactly once, and graph replays need no
memset. The scratch is allocated by ``reserve``/``warmup`` (call before capturing a graph) or on first
use for a new token count. The split factors depend only on T (static per captured shape).

The checkpoint layout (see solo.kernels.moe) is used as is: gate rows [0, I), up rows [I, 2I) of
``gate_up`` [E, 2I, H/2]; scales [E, 2I, H/32]; down [E, H, I/2] / [E, H, I/32]. Nothing is
repacked, so construction costs no extra memory. Timings: docs/kernels.md.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch
import triton  # noqa: E402,I001  (triton_fp8 configured the cache directory first)
import triton.language as tl  # noqa: E402

from solo.kernels.moe import MoEBackend, MXFP4Experts
from solo.kernels.triton_epilogues import store_split_sum, swiglu_store
from solo.kernels.triton_fp8 import (
    interpreter_mode,
    kernel_cache_report,
    measure_compile,
    require_triton_device,
)
from solo.kernels.triton_mxfp4_gemv import _gemv_down_combine, _gemv_gate_up_act, gdc_wait

__all__ = ["MoEConfig", "TritonMoE", "kernel_cache_report"]


@triton.jit
def _moe_gate_up_act(
    x_ptr,
    ids_ptr,
    w_ptr,
    s_ptr,
    act_ptr,
    part_ptr,
    cnt_ptr,
    stride_xt,
    limit,
    H: tl.constexpr,
    I: tl.constexpr,
    TOPK: tl.constexpr,
    HAS_LIMIT: tl.constexpr,
    BLOCK_I: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_T: tl.constexpr,
    W_LHS: tl.constexpr,
    SPLIT_K: tl.constexpr,
):
    a = tl.program_id(0)
    pid_i = tl.program_id(1)
    pid_k = tl.program_id(2)
    t = a // TOPK
    e = tl.load(ids_ptr + a).to(tl.int64)
    ri = pid_i * BLOCK_I + tl.arange(0, BLOCK_I)
    rkb = tl.arange(0, BLOCK_K // 2)
    rks = tl.arange(0, BLOCK_K // 32)
    rk = tl.arange(0, BLOCK_K)
    rc = tl.arange(0, BLOCK_T)
    # K range of this split: KCH columns starting at k_lo (a whole number of BLOCK_K tiles).
    KCH: tl.constexpr = ((H + SPLIT_K - 1) // SPLIT_K + BLOCK_K - 1) // BLOCK_K * BLOCK_K
    EVEN_I: tl.constexpr = I % BLOCK_I == 0
    EVEN_K: tl.constexpr = H % (KCH * SPLIT_K) == 0 and KCH * SPLIT_K == H
    i_ok = ri < I
    k_lo = pid_k * KCH
    w_base = w_ptr + e * (2 * I * (H // 2)) + k_lo // 2
    s_base = s_ptr + e * (2 * I * (H // 32)) + k_lo // 32
    x_base = x_ptr + t * stride_xt + k_lo
    if W_LHS:
        acc_g = tl.zeros((BLOCK_I, BLOCK_T), dtype=tl.float32)
        acc_u = tl.zeros((BLOCK_I, BLOCK_T), dtype=tl.float32)
        wg_ptrs = w_base + ri[:, None] * (H // 2) + rkb[None, :]
    else:
        acc_g = tl.zeros((BLOCK_T, BLOCK_I), dtype=tl.float32)
        acc_u = tl.zeros((BLOCK_T, BLOCK_I), dtype=tl.float32)
        wg_ptrs = w_base + ri[None, :] * (H // 2) + rkb[:, None]
    sg_ptrs = s_base + ri[:, None] * (H // 32) + rks[None, :]
    UP_W: tl.constexpr = I * (H // 2)
    UP_S: tl.constexpr = I * (H // 32)
    for kk in range(0, KCH, BLOCK_K):
        if EVEN_K:  # noqa: SIM108 (constexpr branch)
            xk = tl.load(x_base + kk + rk)
        else:
            xk = tl.load(x_base + kk + rk, mask=(k_lo + kk + rk) < H, other=0.0)
        if EVEN_I and EVEN_K:
            wg = tl.load(wg_ptrs)
            wu = tl.load(wg_ptrs + UP_W)
            sg = tl.load(sg_ptrs)
            su = tl.load(sg_ptrs + UP_S)
        else:
            kb_ok = ((k_lo + kk) // 2 + rkb) < H // 2
            ks_ok = ((k_lo + kk) // 32 + rks) < H // 32
            if W_LHS:  # noqa: SIM108 (constexpr branch)
                wmask = i_ok[:, None] & kb_ok[None, :]
            else:
                wmask = i_ok[None, :] & kb_ok[:, None]
            smask = i_ok[:, None] & ks_ok[None, :]
            wg = tl.load(wg_ptrs, mask=wmask, other=0)
            wu = tl.load(wg_ptrs + UP_W, mask=wmask, other=0)
            sg = tl.load(sg_ptrs, mask=smask, other=0)
            su = tl.load(sg_ptrs + UP_S, mask=smask, other=0)
        if W_LHS:
            xt = tl.where(rc[None, :] == 0, xk[:, None], 0.0).to(tl.bfloat16)
            acc_g = tl.dot_scaled(wg, sg, "e2m1", xt, None, "bf16", acc_g, fast_math=True)
            acc_u = tl.dot_scaled(wu, su, "e2m1", xt, None, "bf16", acc_u, fast_math=True)
        else:
            xt = tl.where(rc[:, None] == 0, xk[None, :], 0.0).to(tl.bfloat16)
            acc_g = tl.dot_scaled(xt, None, "bf16", wg, sg, "e2m1", acc_g, fast_math=True)
            acc_u = tl.dot_scaled(xt, None, "bf16", wu, su, "e2m1", acc_u, fast_math=True)
        wg_ptrs += BLOCK_K // 2
        sg_ptrs += BLOCK_K // 32
    if W_LHS:
        g = tl.sum(tl.where(rc[None, :] == 0, acc_g, 0.0), axis=1)
        u = tl.sum(tl.where(rc[None, :] == 0, acc_u, 0.0), axis=1)
    else:
        g = tl.sum(tl.where(rc[:, None] == 0, acc_g, 0.0), axis=0)
        u = tl.sum(tl.where(rc[:, None] == 0, acc_u, 0.0), axis=0)
    a_offs = a * I + ri
    if SPLIT_K == 1:
        swiglu_store(g, u, act_ptr, a_offs, i_ok, limit, HAS_LIMIT, EVEN_I)
    else:
        # Split-K: every split parks its partial sums; the last one to arrive (counted with an
        # acq_rel atomic) adds them in a fixed order, applies SwiGLU, stores and resets the count.
        n_iblk = tl.num_programs(1)
        slot = a * n_iblk + pid_i
        rl = tl.arange(0, BLOCK_I)
        p_base = part_ptr + slot * (SPLIT_K * 2 * BLOCK_I)
        tl.store(p_base + pid_k * (2 * BLOCK_I) + rl, g)
        tl.store(p_base + pid_k * (2 * BLOCK_I) + BLOCK_I + rl, u)
        tl.debug_barrier()
        arrived = tl.atomic_add(cnt_ptr + slot, 1, sem="acq_rel", scope="gpu")
        if arrived == SPLIT_K - 1:
            g = tl.zeros((BLOCK_I,), dtype=tl.float32)
            u = tl.zeros((BLOCK_I,), dtype=tl.float32)
            for j in tl.static_range(SPLIT_K):
                g += tl.load(p_base + j * (2 * BLOCK_I) + rl, cache_modifier=".cg")
                u += tl.load(p_base + j * (2 * BLOCK_I) + BLOCK_I + rl, cache_modifier=".cg")
            swiglu_store(g, u, act_ptr, a_offs, i_ok, limit, HAS_LIMIT, EVEN_I)
            tl.atomic_xchg(cnt_ptr + slot, 0, sem="relaxed", scope="gpu")


@triton.jit
def _moe_down_combine(
    act_ptr,
    ids_ptr,
    wt_ptr,
    w_ptr,
    s_ptr,
    o_ptr,
    part_ptr,
    cnt_ptr,
    stride_ot,
    H: tl.constexpr,
    I: tl.constexpr,
    TOPK: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_T: tl.constexpr,
    W_LHS: tl.constexpr,
    SPLIT_E: tl.constexpr,
):
    t = tl.program_id(0)
    pid_h = tl.program_id(1)
    pid_e = tl.program_id(2)
    rh = pid_h * BLOCK_H + tl.arange(0, BLOCK_H)
    rkb = tl.arange(0, BLOCK_K // 2)
    rks = tl.arange(0, BLOCK_K // 32)
    rk = tl.arange(0, BLOCK_K)
    rc = tl.arange(0, BLOCK_T)
    EVEN_H: tl.constexpr = H % BLOCK_H == 0
    EVEN_K: tl.constexpr = I % BLOCK_K == 0
    NK: tl.constexpr = (I + BLOCK_K - 1) // BLOCK_K
    EPS: tl.constexpr = TOPK // SPLIT_E  # experts handled by this program
    h_ok = rh < H
    if W_LHS:
        acc = tl.zeros((BLOCK_H, BLOCK_T), dtype=tl.float32)
        w_off = rh[:, None] * (I // 2) + rkb[None, :]
    else:
        acc = tl.zeros((BLOCK_T, BLOCK_H), dtype=tl.float32)
        w_off = rh[None, :] * (I // 2) + rkb[:, None]
    s_off = rh[:, None] * (I // 32) + rks[None, :]
    for it in range(0, EPS * NK):
        j = pid_e * EPS + it // NK
        k0 = (it % NK) * BLOCK_K
        a = t * TOPK + j
        e = tl.load(ids_ptr + a).to(tl.int64)
        wt = tl.load(wt_ptr + a)
        w_ptrs = w_ptr + e * (H * (I // 2)) + k0 // 2 + w_off
        s_ptrs = s_ptr + e * (H * (I // 32)) + k0 // 32 + s_off
        if EVEN_K:  # noqa: SIM108 (constexpr branch)
            xk = tl.load(act_ptr + a * I + k0 + rk)
        else:
            xk = tl.load(act_ptr + a * I + k0 + rk, mask=(k0 + rk) < I, other=0.0)
        if EVEN_H and EVEN_K:
            w = tl.load(w_ptrs)
            s = tl.load(s_ptrs)
        else:
            kb_ok = (k0 // 2 + rkb) < I // 2
            ks_ok = (k0 // 32 + rks) < I // 32
            if W_LHS:  # noqa: SIM108 (constexpr branch)
                wmask = h_ok[:, None] & kb_ok[None, :]
            else:
                wmask = h_ok[None, :] & kb_ok[:, None]
            w = tl.load(w_ptrs, mask=wmask, other=0)
            s = tl.load(s_ptrs, mask=h_ok[:, None] & ks_ok[None, :], other=0)
        if W_LHS:
            xt = tl.where(rc[None, :] == 0, xk[:, None], 0.0).to(tl.bfloat16)
            part = tl.dot_scaled(w, s, "e2m1", xt, None, "bf16", fast_math=True)
        else:
            xt = tl.where(rc[:, None] == 0, xk[None, :], 0.0).to(tl.bfloat16)
            part = tl.dot_scaled(xt, None, "bf16", w, s, "e2m1", fast_math=True)
        acc += part * wt
    if W_LHS:
        y = tl.sum(tl.where(rc[None, :] == 0, acc, 0.0), axis=1)
    else:
        y = tl.sum(tl.where(rc[:, None] == 0, acc, 0.0), axis=0)
    slot = t * tl.num_programs(1) + pid_h
    store_split_sum(y, o_ptr, t * stride_ot + rh, h_ok, part_ptr, cnt_ptr, slot, pid_e, SPLIT_E, BLOCK_H, EVEN_H)


@dataclass(frozen=True)
class MoEConfig:
    """Launch parameters of the two kernels (tuned on the H200, see docs/kernels.md)."""

    gu_block_i: int = 64
    gu_block_k: int = 256
    gu_w_lhs: bool = False
    gu_warps: int = 4
    gu_stages: int = 3
    gu_split_k: int = 5  # most K splits (used only while the grid is smaller than gu_target_ctas)
    dn_block_h: int = 32
    dn_block_k: int = 256
    dn_w_lhs: bool = False
    dn_warps: int = 4
    dn_stages: int = 8
    dn_split_e: int = 4  # most expert splits (likewise, with dn_target_ctas)
    block_t: int = 16
    gu_target_ctas: int = 264  # 2 programs per SM on the H200's 132 SMs
    dn_target_ctas: int = 10**9  # the down kernel gained from splitting at every T measured (1, 4)
    # CUDA-core GEMV path (solo.kernels.triton_mxfp4_gemv), used for T <= gemv_max_tokens.
    # Tuned on the H200 at Ling-3.0-flash shapes (python -m solo.bench.kernels --tune --cases gemv).
    gemv_max_tokens: int = 4
    gv_gu_block_n: int = 8
    gv_gu_block_w: int = 64  # 32-bit words (8 codes each) per row per K tile
    gv_gu_warps: int = 2  # (no num_stages: the GEMV K loops are unrolled, nothing to pipeline)
    gv_dn_block_n: int = 32
    gv_dn_block_w: int = 32
    gv_dn_warps: int = 4
    gv_dn_split_e: int = 8
    gv_pdl: bool = True  # down kernel launched early (programmatic dependent launch), waits for act
    gv_early_weights: bool = True  # down loads its weights before that wait (used for T > 1 only)


def _choose_split(ctas: int, options: list[int], most: int, target: int) -> int:
    """Smallest split (from options, <= most) that brings the grid to target programs."""
    usable = [s for s in sorted(options) if s <= max(1, most)] or [1]
    for s in usable:
        if ctas * s >= target:
            return s
    return usable[-1]


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
        self.gate_up = tensors["gate_up"]
        self.gate_up_scale = tensors["gate_up_scale"]
        self.down = tensors["down"]
        self.down_scale = tensors["down_scale"]
        self.config = config or MoEConfig()
        # 32-bit word views of the codes for the GEMV path (same storage, no copy).
        self.gate_up_words = self.gate_up.view(torch.int32)
        self.down_words = self.down.view(torch.int32)
        self._scratch: dict[str, torch.Tensor] = {}
        self.path_calls = {"gemv": 0, "tensor_core": 0}  # eager forwards per kernel family

    @property
    def config(self) -> MoEConfig:
        return self._config

    @config.setter
    def config(self, base: MoEConfig) -> None:
        """Launch parameters, with block sizes shrunk to fit small (test) shapes."""
        words_h, words_i = self.hidden // 8, self.inter // 8
        self._config = dataclasses.replace(
            base,
            gu_block_i=_fit_block(base.gu_block_i, self.inter, 16),
            gu_block_k=_fit_block(base.gu_block_k, self.hidden, 64),
            dn_block_h=_fit_block(base.dn_block_h, self.hidden, 16),
            dn_block_k=_fit_block(base.dn_block_k, self.inter, 64),
            gv_gu_block_n=_fit_block(base.gv_gu_block_n, self.inter, 1),
            gv_gu_block_w=_fit_block(base.gv_gu_block_w, words_h, 4),
            gv_dn_block_n=_fit_block(base.gv_dn_block_n, self.hidden, 1),
            gv_dn_block_w=_fit_block(base.gv_dn_block_w, words_i, 4),
        )
        self._pdl = (
            base.gv_pdl
            and not interpreter_mode()
            and gdc_wait is not None
            and torch.cuda.get_device_capability(self.gate_up.device)[0] >= 9
        )

    def uses_pdl(self) -> bool:
        """Programmatic dependent launch: Hopper or newer, a Triton that has it, and asked for
        (decided when the config is set, not on every launch)."""
        return self._pdl

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
        if x.shape != (t, self.hidden):
            raise ValueError(f"x must be [{t}, {self.hidden}], got {tuple(x.shape)}")
        if out is None:
            out = torch.empty((t, self.hidden), dtype=x.dtype, device=x.device)
        elif out.shape != (t, self.hidden) or out.stride(-1) != 1:
            raise ValueError(f"out must be a row-major [{t}, {self.hidden}] tensor")
        if t == 0:
            return out
        xb = x if x.dtype == torch.bfloat16 else x.to(torch.bfloat16)
        if xb.stride(-1) != 1:
            xb = xb.contiguous()
        ids = topk_ids.reshape(-1)
        if ids.dtype not in (torch.int32, torch.int64) or not ids.is_contiguous():
            ids = ids.to(torch.int32).contiguous()
        wts = topk_weights.reshape(-1)
        if wts.dtype != torch.float32 or not wts.is_contiguous():
            wts = wts.float().contiguous()
        act = torch.empty((t * top_k, self.inter), dtype=torch.bfloat16, device=x.device)
        if self.uses_gemv(t):
            self.path_calls["gemv"] += 1
            self.launch_gemv_gate_up(xb, ids, act, top_k)
            self.launch_gemv_down(act, ids, wts, out, top_k)
        else:
            self.path_calls["tensor_core"] += 1
            self.launch_gate_up(xb, ids, act, top_k)
            self.launch_down(act, ids, wts, out, top_k)
        return out

    def splits(self, tokens: int, top_k: int) -> tuple[int, int]:
        """(gate_up K splits, down expert splits) used for this token count (static per T)."""
        cfg = self.config
        if self.uses_gemv(tokens):
            return 1, max(d for d in range(1, top_k + 1) if top_k % d == 0 and d <= max(1, cfg.gv_dn_split_e))
        n_iblk = triton.cdiv(self.inter, cfg.gu_block_i)
        k_tiles = triton.cdiv(self.hidden, cfg.gu_block_k)
        gu = _choose_split(
            tokens * top_k * n_iblk,
            [d for d in range(1, k_tiles + 1) if k_tiles % d == 0],
            cfg.gu_split_k,
            cfg.gu_target_ctas,
        )
        n_hblk = triton.cdiv(self.hidden, cfg.dn_block_h)
        dn = _choose_split(
            tokens * n_hblk, [d for d in range(1, top_k + 1) if top_k % d == 0], cfg.dn_split_e, cfg.dn_target_ctas
        )
        return gu, dn

    def _buffer(self, name: str, numel: int, dtype: torch.dtype, zero: bool) -> torch.Tensor:
        # A stored buffer is never replaced: a captured CUDA graph may point at it, and freeing it
        # would leave the graph writing into memory that other tensors reuse. A call needing more
        # (a long prefill) gets a buffer of its own.
        buf = self._scratch.get(name)
        if buf is not None and buf.numel() >= numel:
            return buf
        alloc = torch.zeros if zero else torch.empty
        fresh = alloc(max(numel, 1), dtype=dtype, device=self.gate_up.device)
        if buf is None:
            self._scratch[name] = fresh
        return fresh

    def reserve(self, max_tokens: int, top_k: int) -> None:
        """Allocate the split-reduction scratch for up to max_tokens (do it before graph capture)."""
        for t in range(max_tokens, 0, -1):  # largest first: a stored buffer is never grown
            self._scratch_for(t, top_k)

    def _scratch_for(self, tokens: int, top_k: int) -> tuple[torch.Tensor, ...]:
        cfg = self.config
        gu, dn = self.splits(tokens, top_k)
        if self.uses_gemv(tokens):
            slots = tokens * triton.cdiv(self.hidden, cfg.gv_dn_block_n)
            return (
                self._buffer("gv_dn_part", slots * dn * cfg.gv_dn_block_n, torch.float32, zero=False),
                self._buffer("gv_dn_cnt", slots, torch.int32, zero=True),
            )
        gu_slots = tokens * top_k * triton.cdiv(self.inter, cfg.gu_block_i)
        dn_slots = tokens * triton.cdiv(self.hidden, cfg.dn_block_h)
        return (
            self._buffer("gu_part", gu_slots * gu * 2 * cfg.gu_block_i, torch.float32, zero=False),
            self._buffer("gu_cnt", gu_slots, torch.int32, zero=True),
            self._buffer("dn_part", dn_slots * dn * cfg.dn_block_h, torch.float32, zero=False),
            self._buffer("dn_cnt", dn_slots, torch.int32, zero=True),
        )

    def launch_gate_up(self, xb: torch.Tensor, ids: torch.Tensor, act: torch.Tensor, top_k: int) -> None:
        """Kernel 1: act[a] = swiglu(W_gate[e_a] x_t, W_up[e_a] x_t) for every assignment a."""
        cfg = self.config
        tokens = ids.numel() // top_k
        split, _ = self.splits(tokens, top_k)
        part, cnt, _, _ = self._scratch_for(tokens, top_k)
        limit = float(self.swiglu_limit) if self.swiglu_limit is not None else 0.0
        _moe_gate_up_act[(ids.numel(), triton.cdiv(self.inter, cfg.gu_block_i), split)](
            xb,
            ids,
            self.gate_up,
            self.gate_up_scale,
            act,
            part,
            cnt,
            xb.stride(0),
            limit,
            H=self.hidden,
            I=self.inter,
            TOPK=top_k,
            HAS_LIMIT=self.swiglu_limit is not None,
            BLOCK_I=cfg.gu_block_i,
            BLOCK_K=cfg.gu_block_k,
            BLOCK_T=cfg.block_t,
            W_LHS=cfg.gu_w_lhs,
            SPLIT_K=split,
            num_warps=cfg.gu_warps,
            num_stages=cfg.gu_stages,
        )

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
        self, act: torch.Tensor, ids: torch.Tensor, wts: torch.Tensor, out: torch.Tensor, top_k: int
    ) -> None:
        """GEMV kernel 2 (small T): out[t] = sum_j w[t, j] * W_down[e_tj] act[t*k + j]."""
        cfg = self.config
        tokens = out.shape[0]
        _, split = self.splits(tokens, top_k)
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
            H=self.hidden,
            I=self.inter,
            TOPK=top_k,
            BLOCK_N=cfg.gv_dn_block_n,
            BLOCK_W=cfg.gv_dn_block_w,
            SPLIT_E=split,
            PDL=pdl,
            EARLY_WEIGHTS=cfg.gv_early_weights and tokens > 1,
            num_warps=cfg.gv_dn_warps,
            **({"launch_pdl": True} if pdl else {}),
        )

    def launch_down(
        self, act: torch.Tensor, ids: torch.Tensor, wts: torch.Tensor, out: torch.Tensor, top_k: int
    ) -> None:
        """Kernel 2: out[t] = sum_j w[t, j] * W_down[e_tj] act[t*k + j]."""
        cfg = self.config
        tokens = out.shape[0]
        _, split = self.splits(tokens, top_k)
        _, _, part, cnt = self._scratch_for(tokens, top_k)
        _moe_down_combine[(tokens, triton.cdiv(self.hidden, cfg.dn_block_h), split)](
            act,
            ids,
            wts,
            self.down,
            self.down_scale,
            out,
            part,
            cnt,
            out.stride(0),
            H=self.hidden,
            I=self.inter,
            TOPK=top_k,
            BLOCK_H=cfg.dn_block_h,
            BLOCK_K=cfg.dn_block_k,
            BLOCK_T=cfg.block_t,
            W_LHS=cfg.dn_w_lhs,
            SPLIT_E=split,
            num_warps=cfg.dn_warps,
            num_stages=cfg.dn_stages,
        )

    def warmup(self, top_k: int = 8, max_tokens: int = 4) -> dict[str, Any]:
        """Compile (or load from Triton's disk cache) the kernels for this layer's shapes.

        The token count is a runtime argument, so one compile serves every T of a path; the call
        runs the op on dummy routing for T = 1, T = max_tokens and the first T of the tensor-core
        path (prefill), so no kernel is compiled mid-generation. Returns the timing record.
        """
        dev = self.gate_up.device
        self.reserve(max(1, max_tokens), top_k)
        first_mma = self.config.gemv_max_tokens + 1
        with measure_compile("moe", hidden=self.hidden, inter=self.inter, top_k=top_k) as m:
            for t in sorted({1, max(1, max_tokens), first_mma}):
                x = torch.zeros((t, self.hidden), dtype=torch.bfloat16, device=dev)
                ids = (torch.arange(t * top_k, device=dev) % self.num_experts).view(t, top_k)
                w = torch.full((t, top_k), 1.0 / top_k, dtype=torch.float32, device=dev)
                self.forward(x, ids, w)
        assert m.record is not None
        return {
            "what": m.record.what,
            "seconds": m.record.seconds,
            "new_cache_entries": m.record.new_cache_entries,
            "interpreter": interpreter_mode(),
        }

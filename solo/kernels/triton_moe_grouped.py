"""Routed MoE in MXFP4 for prefill (more tokens than the GEMV path takes): grouped tensor-core GEMMs.

Assignments (token, expert) are sorted by expert and padded per expert to BLOCK_T rows
(solo.kernels.routing.align_routing), so one program multiplies a tile of one expert's weights with
up to BLOCK_T of that expert's tokens: an expert's weights are read once per BLOCK_T of its tokens
instead of once per token. The codes arrive as the packed words of solo.kernels.triton_mxfp4_gemv.

Products (``F16``, the default): the GEMV path's unpacking gives, for code position n of every word,
an fp16 tile of value * 2^-14 (exact); multiplied by the group's fp16 factor 2^(s-113) it is the
weight itself, value * 2^(s-127), still exact for E8M0 scales s in [104, 128]. One fp16 MMA per code
position (elements 8c + n of the K tile, activations gathered in the same order and rounded to fp16)
accumulates in fp32, weights on the MMA's M side. On the H200 this is 2.0x faster than the
alternative (``F16`` off, used when a checkpoint has a larger scale): ``e2m1_standard_bytes`` turns
the words back into checkpoint bytes and ``tl.dot_scaled`` widens them (docs/kernels.md).

1. ``_grouped_gate_up_act``: grid (blocks, I/BLOCK_I). act[a] = swiglu(W_gate[e] x_t, W_up[e] x_t)
   (optional Ling clamp) for the block's rows, bf16.
2. ``_grouped_down``: grid (blocks, H/BLOCK_H). y[a] = w_a * (W_down[e] act[a]) for the block's
   rows, fp32.
3. out[t] = sum over j of y[t*k + j], in a fixed order (one torch reduction).

The grid covers the most blocks any routing of n assignments can need (n/BLOCK_T plus one partial
block per expert in use); programs past ``num_tokens_padded`` return at once. Layouts are the
checkpoint's (solo.kernels.moe) except for the packed words: gate rows [0, I) and up rows [I, 2I) of
gate_up [E, 2I, H/8] words; scales [E, 2I, H/32].
"""

from __future__ import annotations

import triton
import triton.language as tl

from solo.kernels.triton_epilogues import swiglu_store
from solo.kernels.triton_mxfp4_gemv import e2m1_pair_f16, e2m1_standard_bytes

# E8M0 scale bytes for which the fp16 path is exact: code * 2^-14 (fp16) times the fp16 factor 2^(s-113)
# is value * 2^(s-127); the factor must be an fp16 (s <= 128) and the smallest code, 0.5, must stay
# representable (s >= 104). Below 104 values flush toward zero (relative error at most 2^-24 of the
# group's scale); above 128 the path is refused (TritonMoE checks the checkpoint at load).
F16_MAX_SCALE = 128


@triton.jit
def _block_rows(sorted_ptr, expert_ptr, n_assign, BLOCK_T: tl.constexpr):
    """(expert, rows [BLOCK_T] with padding mapped to row 0, rows_ok) of this program's block."""
    b = tl.program_id(0)
    rows = tl.load(sorted_ptr + b * BLOCK_T + tl.arange(0, BLOCK_T))
    e = tl.load(expert_ptr + b).to(tl.int64)
    rows_ok = rows < n_assign
    return e, tl.where(rows_ok, rows, 0), rows_ok


@triton.jit
def _f16_group_scale(s, R: tl.constexpr, W: tl.constexpr):
    """E8M0 bytes [R, W/4] -> fp16 2^(s-113) per code word [R, W] (clamped to fp16's normal range)."""
    f = (tl.minimum(tl.maximum(s.to(tl.int32) - 98, 0), 30) << 10).to(tl.int16).to(tl.float16, bitcast=True)
    return tl.reshape(tl.broadcast_to(f[:, :, None], (R, W // 4, 4)), (R, W))


@triton.jit
def _f16_operand_pair(ptrs, J: tl.constexpr, mask):
    """The activations at elements 8c + J and 8c + J + 4 (``ptrs`` at element 8c), rounded to fp16."""
    lo = tl.load(ptrs + J, mask=mask, other=0.0).to(tl.float16)
    hi = tl.load(ptrs + (J + 4), mask=mask, other=0.0).to(tl.float16)
    return lo, hi


@triton.jit
def _f16_pair_dot(words, f, J: tl.constexpr, x_lo, x_hi, acc):
    """acc + the MMAs of code positions J and J+4: exact fp16 weights (codes times their group's
    factor ``f``) against the activations x_lo / x_hi gathered at elements 8c + J and 8c + J + 4."""
    lo, hi = e2m1_pair_f16(words, J)
    acc = tl.dot(lo * f, x_lo, acc)
    return tl.dot(hi * f, x_hi, acc)


@triton.jit
def _grouped_gate_up_act(
    x_ptr,
    sorted_ptr,
    expert_ptr,
    npad_ptr,
    w_ptr,
    s_ptr,
    act_ptr,
    n_assign,
    stride_xt,
    limit,
    H: tl.constexpr,
    I: tl.constexpr,
    TOPK: tl.constexpr,
    HAS_LIMIT: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_I: tl.constexpr,
    BLOCK_K: tl.constexpr,
    F16: tl.constexpr,
):
    if tl.program_id(0) * BLOCK_T < tl.load(npad_ptr):  # blocks past the routing's last return at once
        e, rows, rows_ok = _block_rows(sorted_ptr, expert_ptr, n_assign, BLOCK_T)
        ri = tl.program_id(1) * BLOCK_I + tl.arange(0, BLOCK_I)
        rkw = tl.arange(0, BLOCK_K // 8)
        rks = tl.arange(0, BLOCK_K // 32)
        rk = tl.arange(0, BLOCK_K)
        i_ok = ri < I
        tok = rows // TOPK
        x_ptrs = x_ptr + tok[None, :] * stride_xt + rk[:, None]  # x^T [BLOCK_K, BLOCK_T]
        w_ptrs = w_ptr + e * (2 * I * (H // 8)) + ri[:, None] * (H // 8) + rkw[None, :]  # [BLOCK_I, BLOCK_K/8]
        s_ptrs = s_ptr + e * (2 * I * (H // 32)) + ri[:, None] * (H // 32) + rks[None, :]  # [BLOCK_I, BLOCK_K/32]
        UP_W: tl.constexpr = I * (H // 8)
        UP_S: tl.constexpr = I * (H // 32)
        acc_g = tl.zeros((BLOCK_I, BLOCK_T), dtype=tl.float32)
        acc_u = tl.zeros((BLOCK_I, BLOCK_T), dtype=tl.float32)
        W: tl.constexpr = BLOCK_K // 8
        xw_ptrs = x_ptr + tok[None, :] * stride_xt + 8 * rkw[:, None]  # element 8c of word c, [W, BLOCK_T]
        for k0 in range(0, H, BLOCK_K):
            w_ok = (k0 // 8 + rkw) < H // 8
            wmask = i_ok[:, None] & w_ok[None, :]
            smask = i_ok[:, None] & ((k0 // 32 + rks) < H // 32)[None, :]
            wg = tl.load(w_ptrs + k0 // 8, mask=wmask, other=0).to(tl.uint32, bitcast=True)
            wu = tl.load(w_ptrs + (UP_W + k0 // 8), mask=wmask, other=0).to(tl.uint32, bitcast=True)
            sg = tl.load(s_ptrs + k0 // 32, mask=smask, other=0)
            su = tl.load(s_ptrs + (UP_S + k0 // 32), mask=smask, other=0)
            if F16:
                # One fp16 MMA per code position n of the words: elements 8c + n of the tile, exact
                # fp16 weights (code bits times the group's power of two), fp32 accumulation.
                fg = _f16_group_scale(sg, BLOCK_I, W)
                fu = _f16_group_scale(su, BLOCK_I, W)
                xmask = w_ok[:, None] & rows_ok[None, :]
                for j in tl.static_range(4):
                    x_lo, x_hi = _f16_operand_pair(xw_ptrs + k0, j, xmask)
                    acc_g = _f16_pair_dot(wg, fg, j, x_lo, x_hi, acc_g)
                    acc_u = _f16_pair_dot(wu, fu, j, x_lo, x_hi, acc_u)
            else:
                xk = tl.load(x_ptrs + k0, mask=((k0 + rk) < H)[:, None] & rows_ok[None, :], other=0.0)
                acc_g = tl.dot_scaled(e2m1_standard_bytes(wg), sg, "e2m1", xk, None, "bf16", acc_g, fast_math=True)
                acc_u = tl.dot_scaled(e2m1_standard_bytes(wu), su, "e2m1", xk, None, "bf16", acc_u, fast_math=True)
        offs = rows[None, :] * I + ri[:, None]
        swiglu_store(acc_g, acc_u, act_ptr, offs, i_ok[:, None] & rows_ok[None, :], limit, HAS_LIMIT, False)


@triton.jit
def _grouped_down(
    act_ptr,
    sorted_ptr,
    expert_ptr,
    npad_ptr,
    wt_ptr,
    w_ptr,
    s_ptr,
    y_ptr,
    n_assign,
    H: tl.constexpr,
    I: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_K: tl.constexpr,
    F16: tl.constexpr,
):
    if tl.program_id(0) * BLOCK_T < tl.load(npad_ptr):
        e, rows, rows_ok = _block_rows(sorted_ptr, expert_ptr, n_assign, BLOCK_T)
        rh = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
        rkw = tl.arange(0, BLOCK_K // 8)
        rks = tl.arange(0, BLOCK_K // 32)
        rk = tl.arange(0, BLOCK_K)
        h_ok = rh < H
        a_ptrs = act_ptr + rows[None, :] * I + rk[:, None]  # act^T [BLOCK_K, BLOCK_T]
        w_ptrs = w_ptr + e * (H * (I // 8)) + rh[:, None] * (I // 8) + rkw[None, :]  # [BLOCK_H, BLOCK_K/8]
        s_ptrs = s_ptr + e * (H * (I // 32)) + rh[:, None] * (I // 32) + rks[None, :]  # [BLOCK_H, BLOCK_K/32]
        acc = tl.zeros((BLOCK_H, BLOCK_T), dtype=tl.float32)
        W: tl.constexpr = BLOCK_K // 8
        aw_ptrs = act_ptr + rows[None, :] * I + 8 * rkw[:, None]  # element 8c of word c, [W, BLOCK_T]
        for k0 in range(0, I, BLOCK_K):
            w_ok = (k0 // 8 + rkw) < I // 8
            w = tl.load(w_ptrs + k0 // 8, mask=h_ok[:, None] & w_ok[None, :], other=0).to(tl.uint32, bitcast=True)
            s = tl.load(s_ptrs + k0 // 32, mask=h_ok[:, None] & ((k0 // 32 + rks) < I // 32)[None, :], other=0)
            if F16:  # see the gate_up kernel
                f = _f16_group_scale(s, BLOCK_H, W)
                amask = w_ok[:, None] & rows_ok[None, :]
                for j in tl.static_range(4):
                    a_lo, a_hi = _f16_operand_pair(aw_ptrs + k0, j, amask)
                    acc = _f16_pair_dot(w, f, j, a_lo, a_hi, acc)
            else:
                ak = tl.load(a_ptrs + k0, mask=((k0 + rk) < I)[:, None] & rows_ok[None, :], other=0.0)
                acc = tl.dot_scaled(e2m1_standard_bytes(w), s, "e2m1", ak, None, "bf16", acc, fast_math=True)
        wt = tl.load(wt_ptr + rows, mask=rows_ok, other=0.0)
        offs = rows[None, :] * H + rh[:, None]
        tl.store(y_ptr + offs, acc * wt[None, :], mask=h_ok[:, None] & rows_ok[None, :])


def max_blocks(n_assign: int, num_experts: int, block_t: int) -> int:
    """Most blocks a routing of n assignments can need: full blocks plus one partial per expert used."""
    return triton.cdiv(n_assign, block_t) + min(n_assign, num_experts)

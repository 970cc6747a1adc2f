"""Kimi Delta Attention for decode and verification (T <= 16 tokens) in one kernel per layer.

The layer's projections arrive as one row per token, [q | k | v | f | g | b] (one fused GEMV made
them). Per head and per slice of the value dimension, one program runs the whole recurrence:
depthwise causal conv (kernel 4) and SiLU on q, k and its slice of v, L2 norms of q and k, q scaled
by d^-1/2, the safe gate g = lower_bound * sigmoid(exp(A_log) (f + dt_bias)) (or the softplus form),
beta = sigmoid(b), then token by token
    S <- diag(exp(g)) S;  u = beta (v - S^T k);  S <- S + k u^T;  o = S^T q
on its [d_k, d_v / NV] slice of the head's fp32 state, which it reads once and writes once (the
columns of S are independent given q, k, g and beta, so 32 heads x 4 slices keep 128 SMs busy). o is
stored in bf16 (the reference rounds it before the gated output norm, which the following GEMV's
prologue applies). With a history (speculative verification) the state after each token and the
conv inputs are stored as well, for rolling back to any accepted prefix (solo.model.cache).

Lazy rollback (solo.model.cache.HybridCache.rollback_kda): with LAZY the state lives where the device
scalar `source` says, `state` when it is 0, else slot source - 1 of the cache's verification history
(`hist_state`). One token updates it there; a verification pass into that history stores each token's
state there and not the final one (the rollback that follows picks the accepted token's slot, so the
73 MB copy of a rollback at Ling-3.0-flash shape becomes a store of one scalar). Each program reads its
slice of the state before it stores any slice of the history, so reading a slot it overwrites is safe.

Hand-off (`handoff`, solo.kernels.handoff): the projection computes the output gate g, which only the
next GEMV reads, after q, k, v, f and b, so the recurrence starts once those are stored, while g streams.

Every program of a head reads the head's q and k conv windows; the last of them rewrites them in
place, after a per-head counter says the others have read them (they are launched before it, and
the grid is one wave, so the wait is a formality; without it the split raced on exactly that).
Triton's CPU interpreter runs programs one after another, so there the head is not split (NV = 1).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from solo.kernels.fused_gemv import MAX_TOKENS, store_rounded
from solo.kernels.handoff import check_handoff, end_after_previous, wait_for_rows
from solo.kernels.pdl import PLAIN, LaunchPolicy
from solo.kernels.prefetch import prefetch_part_to_l2, prefetch_unavailable
from solo.kernels.triton_fp8 import interpreter_mode

VALUE_SPLITS = 4  # programs per head on a GPU for one token (each a quarter of the value columns)
WINDOW_VALUE_SPLITS = 4  # ... for several tokens (verification), where each program also stores a state per token
# Warps a program. At 4 every sum over the key dimension crosses warps (shared memory and a barrier: 78 barriers in a
# 4-token pass, Triton 3.9, sm_90); on one warp the sums are shuffles, the state slice in its registers (lab knobs of
# dev/decode_launch_ab.py, with more value splits: 16 of one warp hold 215 registers, no spills)
VALUE_WARPS = 4
WINDOW_WARPS = 4


def value_splits(tokens: int) -> int:
    """Programs per head for a call of `tokens` tokens (1 under Triton's CPU interpreter, which runs
    programs one after another: the head's owner would wait for the others forever)."""
    if interpreter_mode():
        return 1
    return VALUE_SPLITS if tokens == 1 else WINDOW_VALUE_SPLITS


def value_warps(tokens: int) -> int:
    """Warps of each program for a call of `tokens` tokens."""
    return VALUE_WARPS if tokens == 1 else WINDOW_WARPS


@triton.jit
def _conv_step(w0, w1, w2, w3, c0, c1, c2, x):
    """One causal conv output: weights w0..w3 (w3 multiplies the newest input), window c0 (oldest)..c2."""
    y = w0 * c0 + w1 * c1 + w2 * c2 + w3 * x
    return y / (1.0 + tl.exp(-y))  # SiLU


@triton.jit
def _kda_decode(
    proj_ptr,
    stride_p,
    convw_ptr,
    conv_ptr,
    state_ptr,
    hist_state_ptr,
    hist_win_ptr,
    alog_ptr,
    dtb_ptr,
    o_ptr,
    stride_o,
    count_ptr,
    sync_ptr,
    source_ptr,
    handoff_ptr,
    handoff_target,
    lower_bound,
    l2_ptr,
    l2_total,
    T: tl.constexpr,
    H: tl.constexpr,
    DK: tl.constexpr,
    NV: tl.constexpr,
    SAFE_GATE: tl.constexpr,
    HISTORY: tl.constexpr,
    LAZY: tl.constexpr,
    PDL: tl.constexpr,
    HANDOFF: tl.constexpr,
    L2_SHARE: tl.constexpr,  # > 0: each program asks the L2 for this many bytes of l2_ptr's once its wait returns
):
    h = tl.program_id(0)
    j = tl.program_id(1)
    D: tl.constexpr = H * DK
    BV: tl.constexpr = DK // NV
    WIN: tl.constexpr = 3 + T  # history window columns: the 3 older inputs, then the T new ones
    c = tl.arange(0, DK)
    cv = j * BV + tl.arange(0, BV)
    qch = h * DK + c  # conv channels of q, k and this slice of v
    kch = D + h * DK + c
    vch = 2 * D + h * DK + cv

    wq0 = tl.load(convw_ptr + qch * 4 + 0)
    wq1 = tl.load(convw_ptr + qch * 4 + 1)
    wq2 = tl.load(convw_ptr + qch * 4 + 2)
    wq3 = tl.load(convw_ptr + qch * 4 + 3)
    wk0 = tl.load(convw_ptr + kch * 4 + 0)
    wk1 = tl.load(convw_ptr + kch * 4 + 1)
    wk2 = tl.load(convw_ptr + kch * 4 + 2)
    wk3 = tl.load(convw_ptr + kch * 4 + 3)
    wv0 = tl.load(convw_ptr + vch * 4 + 0)
    wv1 = tl.load(convw_ptr + vch * 4 + 1)
    wv2 = tl.load(convw_ptr + vch * 4 + 2)
    wv3 = tl.load(convw_ptr + vch * 4 + 3)
    q0 = tl.load(conv_ptr + qch * 3 + 0)
    q1 = tl.load(conv_ptr + qch * 3 + 1)
    q2 = tl.load(conv_ptr + qch * 3 + 2)
    k0 = tl.load(conv_ptr + kch * 3 + 0)
    k1 = tl.load(conv_ptr + kch * 3 + 1)
    k2 = tl.load(conv_ptr + kch * 3 + 2)
    v0 = tl.load(conv_ptr + vch * 3 + 0)
    v1 = tl.load(conv_ptr + vch * 3 + 1)
    v2 = tl.load(conv_ptr + vch * 3 + 2)
    rate = tl.exp(tl.load(alog_ptr + h))
    dtb = tl.load(dtb_ptr + h * DK + c)
    s_offs = (h * DK + c)[:, None] * DK + cv[None, :]  # state [H, DK, DV] with DV == DK
    if LAZY:  # the state is in `state` (source 0) or in slot source - 1 of the history
        source = tl.load(source_ptr) + tl.zeros_like(s_offs)
        in_slot = source > 0
        slot_offs = tl.maximum(source - 1, 0) * (H * DK * DK) + s_offs
        S = tl.load(state_ptr + s_offs, mask=source == 0, other=0.0) + tl.load(
            hist_state_ptr + slot_offs, mask=in_slot, other=0.0
        )
    else:
        S = tl.load(state_ptr + s_offs)
    # Everything above (weights, this layer's conv windows and state, which only this layer's KDA
    # writes, hundreds of kernels apart) is independent of the previous kernel: under PDL it is read
    # while the projections that feed this kernel still run. Everything below is not.
    # (with HANDOFF: the projection's q, k, v, f and b rows, stored once handoff_target blocks have said so)
    wait_for_rows(handoff_ptr, handoff_target, H * NV, HANDOFF, PDL)
    if L2_SHARE:  # (l2_ahead) HBM idles while the recurrence runs: the next GEMV's weights into the L2
        prefetch_part_to_l2(l2_ptr, l2_total, h * NV + j, L2_SHARE, 128)
    if h == 0 and j == 0:
        tl.atomic_add(count_ptr, 1)
    owner = j == NV - 1  # this program rewrites the head's q and k windows, once the others have read them
    if NV > 1:  # noqa: SIM102 (constexpr branch)
        if j < NV - 1:
            tl.atomic_add(sync_ptr + h, 1, sem="release", scope="gpu")
    if HISTORY:  # the window before the pass: columns 0..2
        if owner:
            tl.store(hist_win_ptr + qch * WIN + 0, q0)
            tl.store(hist_win_ptr + qch * WIN + 1, q1)
            tl.store(hist_win_ptr + qch * WIN + 2, q2)
            tl.store(hist_win_ptr + kch * WIN + 0, k0)
            tl.store(hist_win_ptr + kch * WIN + 1, k1)
            tl.store(hist_win_ptr + kch * WIN + 2, k2)
        tl.store(hist_win_ptr + vch * WIN + 0, v0)
        tl.store(hist_win_ptr + vch * WIN + 1, v1)
        tl.store(hist_win_ptr + vch * WIN + 2, v2)

    for t in tl.static_range(T):
        row = proj_ptr + t * stride_p
        xq = tl.load(row + qch).to(tl.float32)
        xk = tl.load(row + kch).to(tl.float32)
        xv = tl.load(row + vch).to(tl.float32)
        q = _conv_step(wq0, wq1, wq2, wq3, q0, q1, q2, xq)
        k = _conv_step(wk0, wk1, wk2, wk3, k0, k1, k2, xk)
        v = _conv_step(wv0, wv1, wv2, wv3, v0, v1, v2, xv)
        if HISTORY:
            if owner:
                tl.store(hist_win_ptr + qch * WIN + 3 + t, xq)
                tl.store(hist_win_ptr + kch * WIN + 3 + t, xk)
            tl.store(hist_win_ptr + vch * WIN + 3 + t, xv)
        q0, q1, q2 = q1, q2, xq
        k0, k1, k2 = k1, k2, xk
        v0, v1, v2 = v1, v2, xv
        q = q / tl.sqrt(tl.sum(q * q, axis=0) + 1e-6) * (1.0 / tl.sqrt(DK * 1.0))
        k = k / tl.sqrt(tl.sum(k * k, axis=0) + 1e-6)
        f = tl.load(row + 3 * D + h * DK + c).to(tl.float32) + dtb
        if SAFE_GATE:  # noqa: SIM108 (constexpr branch)
            g = lower_bound * tl.sigmoid(rate * f)
        else:
            g = -rate * tl.where(f > 20.0, f, tl.log(1.0 + tl.exp(f)))
        beta = tl.sigmoid(tl.load(row + 5 * D + h).to(tl.float32))
        S = S * tl.exp(g)[:, None]
        kv = tl.sum(S * k[:, None], axis=0)
        u = beta * (v - kv)
        S = S + k[:, None] * u[None, :]
        o = tl.sum(S * q[:, None], axis=0)
        store_rounded(o_ptr + t * stride_o + h * DK + cv, o, None)
        if HISTORY:
            tl.store(hist_state_ptr + t * (H * DK * DK) + s_offs, S)

    if not LAZY:
        tl.store(state_ptr + s_offs, S)
    elif not HISTORY:  # no rollback follows: the state stays where it lives
        tl.store(state_ptr + s_offs, S, mask=source == 0)
        tl.store(hist_state_ptr + slot_offs, S, mask=in_slot)
    if owner:
        if NV > 1:  # wait until the head's other programs have read the old windows (they all run by now)
            arrived = tl.atomic_add(sync_ptr + h, 0, sem="acquire", scope="gpu")
            while arrived < NV - 1:
                arrived = tl.atomic_add(sync_ptr + h, 0, sem="acquire", scope="gpu")
            tl.atomic_xchg(sync_ptr + h, 0, sem="relaxed", scope="gpu")
        tl.store(conv_ptr + qch * 3 + 0, q0)
        tl.store(conv_ptr + qch * 3 + 1, q1)
        tl.store(conv_ptr + qch * 3 + 2, q2)
        tl.store(conv_ptr + kch * 3 + 0, k0)
        tl.store(conv_ptr + kch * 3 + 1, k1)
        tl.store(conv_ptr + kch * 3 + 2, k2)
    tl.store(conv_ptr + vch * 3 + 0, v0)
    tl.store(conv_ptr + vch * 3 + 1, v1)
    tl.store(conv_ptr + vch * 3 + 2, v2)
    end_after_previous(HANDOFF, PDL)  # (the next kernel reads the projection's g rows)


def check_lazy(lazy: tuple[torch.Tensor, torch.Tensor], state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(source, slots) of a lazy state (kda_decode's `lazy`), checked against the layer's `state` [H, d, d]."""
    source, slots = lazy
    if source.dtype != torch.int32 or source.numel() != 1:
        raise ValueError("the lazy state's source must be one int32")
    if slots.shape[1:] != state.shape or not slots.is_contiguous():
        raise ValueError(f"the lazy state's slots must be contiguous [W, {', '.join(map(str, state.shape))}]")
    return source, slots


def kda_decode(
    proj: torch.Tensor,
    conv_weight: torch.Tensor,
    conv_state: torch.Tensor,
    state: torch.Tensor,
    a_log: torch.Tensor,
    dt_bias: torch.Tensor,
    out: torch.Tensor,
    counter: torch.Tensor,
    lower_bound: float,
    safe_gate: bool = True,
    history_states: torch.Tensor | None = None,
    history_window: torch.Tensor | None = None,
    sync: torch.Tensor | None = None,
    launch: LaunchPolicy = PLAIN,
    lazy: tuple[torch.Tensor, torch.Tensor] | None = None,
    handoff: tuple[torch.Tensor, int] | None = None,
    l2_ahead: torch.Tensor | None = None,
) -> torch.Tensor:
    """proj [T, 5D + H] bf16 ([q|k|v|f|g|b] rows); conv_weight [3D, 4] fp32; conv_state [3D, 3] fp32 and
    state [H, d, d] fp32 updated in place; out [T, D] (bf16) receives o. With history_states
    [T, H, d, d] and history_window [3D, 3 + T], what rollback needs is stored too. `sync`: an int32
    buffer of (at least) one counter per head, zero between calls (the kernel leaves it so).

    `lazy` = (source, slots): the state lives in `state` while the int32 source[0] is 0, else in
    slots[source[0] - 1] (slots [W, H, d, d]: this layer's view of the cache's verification history).
    A pass with a history must then store into `slots` itself, and a rollback must follow it.

    `handoff` = (counters, signals): proj comes from a GEMV that hands its rows over (cuda_step.Handoff
    with counters[0], g computed last); the programs read q, k, v, f and b once counters[0] reaches
    `signals` (> 0), and leave both int32 counters zero.

    `l2_ahead`: a tensor (the output projection's weight) the programs ask the L2 for, each its share, once
    their wait returns (bulk prefetches: a hint, no result changes; Hopper only, else a ValueError)."""
    t = proj.shape[0]
    launch = launch.at(t)
    heads, dk, dv = state.shape
    if not 1 <= t <= MAX_TOKENS:
        raise ValueError(f"the fused KDA kernel takes 1..{MAX_TOKENS} tokens, got {t}")
    if dk != dv or dk & (dk - 1) or conv_weight.shape[1] != 4 or conv_state.shape[1] != 3:
        raise ValueError("the fused KDA kernel needs d_k == d_v (a power of two) and a conv kernel of 4")
    if proj.stride(1) != 1 or proj.shape[1] < 5 * heads * dk + heads:
        raise ValueError(f"proj must be row-major [T, >= {5 * heads * dk + heads}]")
    history = history_states is not None
    dummy = state
    if lazy is not None:
        source, slots = check_lazy(lazy, state)
        if history and history_states.data_ptr() != slots.data_ptr():
            raise ValueError("with a lazy state, a verification pass stores its states into the state's slots")
        history_states = slots
    nv = value_splits(t)
    check_handoff(handoff)
    l2_total = l2_share = 0
    if l2_ahead is not None:
        l2_total = l2_ahead.numel() * l2_ahead.element_size() // 16 * 16
        l2_share = -(-l2_total // (heads * nv * 16)) * 16
        if (reason := prefetch_unavailable(l2_ahead, l2_share)) is not None:
            raise ValueError(f"the KDA kernel cannot ask the L2 for the next weights: {reason}")
    if sync is None or sync.numel() < heads:
        raise ValueError("kda_decode needs a zeroed int32 sync buffer of one counter per head")
    compiled = _kda_decode[(heads, nv)](
        proj,
        proj.stride(0),
        conv_weight,
        conv_state,
        state,
        history_states if history or lazy is not None else dummy,
        history_window if history else dummy,
        a_log,
        dt_bias,
        out,
        out.stride(0),
        counter,
        sync,
        lazy[0] if lazy is not None else sync,
        handoff[0] if handoff is not None else sync,
        handoff[1] if handoff is not None else 0,
        float(lower_bound),
        l2_ahead if l2_ahead is not None else sync,
        l2_total,
        T=t,
        H=heads,
        DK=dk,
        NV=nv,
        SAFE_GATE=safe_gate,
        HISTORY=history,
        LAZY=lazy is not None,
        PDL=launch.pdl,
        HANDOFF=handoff is not None,
        L2_SHARE=l2_share,
        num_warps=value_warps(t),
        **launch.options,
    )
    launch.record("kda", compiled)
    return out

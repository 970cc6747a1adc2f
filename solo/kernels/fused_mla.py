"""Multi-head latent attention for decode and verification (T <= 16 tokens) in three kernels.

The layer's projections arrive as one row per token, [q (heads x (nope + rope)) | kv_a (rank + rope) | g
(heads)], from one fused GEMV. Then:

1. `_mla_prep`: the latent key side (kv_a_layernorm, RoPE on the shared rope key, both written to the
   cache at the tokens' positions) and the query side in the latent space: q_nope absorbed through
   w_uk ([heads, nope, rank], the key up-projection) and q_rope rotated, as one [T, heads, rank + rope]
   query per token and head.
2. `_mla_attend` (flash decoding): the positions actually filled, 0..max(position), are cut into
   `splits` equal chunks, one program each (a few hundred positions at 32K, so every SM streams part
   of the cache; at least `min_chunk` each, so fewer at 4K); each computes scores for all heads and
   tokens against its chunk on the tensor cores (causal per token), an online softmax, and its
   partial output in the latent space, with the running max and sum. The query is loaded once, and
   each step of `block_l` positions loads the latent rows once: they are the keys and (absorbed) the
   values. Latency, not bytes, bounds this kernel at these sizes (on the H200, dev/mla_probe.py; its
   instructions, dev/mla_attend_cuda.py). `AttendLaunch` holds how a call is cut, one for a token and
   one for several.
3. `_mla_combine`: per head and slice of the value dimension, the partials are merged (rescaled by
   their maxima), the latent output is mapped through w_uv ([heads, v, rank], the value
   up-projection), multiplied by the head's sigmoid gate, and stored as the input of the output
   projection.
Positions are read on the device, so the kernels replay from a CUDA graph at any length. Rounding
follows the reference where it rounds (bf16 latent query, probabilities and latent output); the
tensor-core products take those bf16 values as they are (`AttendLaunch.bf16_dots`) or as fp16, which
holds every one of them exactly in the range they occupy here (|x| in [6e-5, 65504]; smaller
probabilities contribute nothing at bf16).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import triton
import triton.language as tl

from solo.kernels.fused_gemv import MAX_TOKENS, round_bf16, store_rounded
from solo.kernels.handoff import check_handoff, end_after_previous, wait_for_rows
from solo.kernels.pdl import PLAIN, LaunchPolicy, after_previous_kernel
from solo.kernels.prefetch import prefetch_bytes_to_l2
from solo.kernels.triton_fp8 import interpreter_mode


@triton.jit
def _rope(x_even, x_odd, pos, inv_freq, amplitude):
    """Interleaved RoPE of pairs (x_even[i], x_odd[i]) at angle pos * inv_freq[i], cos/sin rounded to
    bf16 like the reference's; returns the rotated evens and odds (stored de-interleaved)."""
    angle = pos.to(tl.float32) * inv_freq
    cos = round_bf16(tl.cos(angle) * amplitude)
    sin = round_bf16(tl.sin(angle) * amplitude)
    return x_even * cos - x_odd * sin, x_odd * cos + x_even * sin


@triton.jit
def _mla_prep(
    proj_ptr,
    stride_p,
    pos_ptr,
    wuk_ptr,
    kvnorm_ptr,
    invf_ptr,
    latent_ptr,
    rope_ptr,
    q_ptr,
    count_ptr,
    handoff_ptr,
    handoff_target,
    amplitude,
    eps,
    KV_OFF: tl.constexpr,
    T: tl.constexpr,
    BLOCK_T: tl.constexpr,
    HEADS: tl.constexpr,
    NOPE: tl.constexpr,
    ROPE: tl.constexpr,
    RANK: tl.constexpr,
    RANK_BLOCK: tl.constexpr,
    PDL: tl.constexpr,
    HANDOFF: tl.constexpr,
    WEIGHTS_EARLY: tl.constexpr = False,
):
    # (with HANDOFF: the projection's q and kv_a rows, stored once handoff_target blocks have said so, while
    # its gate rows still stream; solo.kernels.handoff)
    # WEIGHTS_EARLY (AttendLaunch.prep_weights_early): a query program's block of w_uk (32 KB), which does not
    # depend on the previous kernel, is loaded before the wait, so that it streams while the projection ends
    pid = tl.program_id(0)
    QK: tl.constexpr = NOPE + ROPE
    HALF: tl.constexpr = ROPE // 2
    SPLITS: tl.constexpr = RANK // RANK_BLOCK
    h = tl.minimum(pid // SPLITS, HEADS - 1)  # (the key side's program, pid HEADS * SPLITS, uses no w_uk)
    part = pid % SPLITS
    rn = tl.arange(0, NOPE)
    rc = part * RANK_BLOCK + tl.arange(0, RANK_BLOCK)
    if WEIGHTS_EARLY:
        wuk = tl.load(wuk_ptr + (h * NOPE + rn)[:, None] * RANK + rc[None, :])
    wait_for_rows(handoff_ptr, handoff_target, HEADS * (RANK // RANK_BLOCK) + 1, HANDOFF, PDL)
    if pid == 0:
        tl.atomic_add(count_ptr, 1)
    ri = tl.arange(0, HALF)
    inv_freq = tl.load(invf_ptr + ri)
    if pid == HEADS * SPLITS:  # the key side: normalised latent and rotated rope key into the cache
        rr = tl.arange(0, RANK)
        norm_w = tl.load(kvnorm_ptr + rr).to(tl.float32)
        for t in tl.static_range(T):
            kv_row = proj_ptr + t * stride_p + KV_OFF
            key_pos = tl.load(pos_ptr + t)
            lat = tl.load(kv_row + rr).to(tl.float32)
            r = 1.0 / tl.sqrt(tl.sum(lat * lat, axis=0) / RANK + eps)
            store_rounded(latent_ptr + key_pos * RANK + rr, norm_w * round_bf16(lat * r), None)
            k_even = tl.load(kv_row + RANK + 2 * ri).to(tl.float32)
            k_odd = tl.load(kv_row + RANK + 2 * ri + 1).to(tl.float32)
            k_re, k_ro = _rope(k_even, k_odd, key_pos, inv_freq, amplitude)
            store_rounded(rope_ptr + key_pos * ROPE + ri, k_re, None)
            store_rounded(rope_ptr + key_pos * ROPE + HALF + ri, k_ro, None)
    else:  # query head h, latent columns [part * RANK_BLOCK, ...): q_nope @ w_uk[h]
        rt = tl.arange(0, BLOCK_T)
        t_ok = rt < T
        qn = tl.load(proj_ptr + rt[:, None] * stride_p + h * QK + rn[None, :], mask=t_ok[:, None], other=0.0)
        if not WEIGHTS_EARLY:
            wuk = tl.load(wuk_ptr + (h * NOPE + rn)[:, None] * RANK + rc[None, :])
        q_lat = tl.dot(qn.to(tl.float16), wuk.to(tl.float16))  # [BLOCK_T, RANK_BLOCK] fp32 (fp16 holds bf16 values)
        q_row = q_ptr + (rt[:, None] * HEADS + h) * (RANK + ROPE)
        store_rounded(q_row + rc[None, :], q_lat, t_ok[:, None])
        if part == 0:
            for t in tl.static_range(T):
                q_pos = tl.load(pos_ptr + t)
                base = proj_ptr + t * stride_p + h * QK + NOPE
                q_even = tl.load(base + 2 * ri).to(tl.float32)
                q_odd = tl.load(base + 2 * ri + 1).to(tl.float32)
                q_re, q_ro = _rope(q_even, q_odd, q_pos, inv_freq, amplitude)
                out = q_ptr + (t * HEADS + h) * (RANK + ROPE) + RANK
                store_rounded(out + ri, q_re, None)
                store_rounded(out + HALF + ri, q_ro, None)
    end_after_previous(HANDOFF, PDL)  # (the combine reads the projection's gate rows)


@triton.jit
def _splits_in_use(length, MIN_CHUNK: tl.constexpr, SPLITS: tl.constexpr):
    """Splits the attention cuts `length` filled positions into: at least MIN_CHUNK positions each."""
    return tl.minimum((length + MIN_CHUNK - 1) // MIN_CHUNK, SPLITS)


@triton.jit
def _split_rows(
    pos_ptr,
    s,
    rp,
    T: tl.constexpr,
    HEADS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    ROW_BLOCK: tl.constexpr,
    MIN_CHUNK: tl.constexpr,
    SPLITS: tl.constexpr,
    BLOCK_L: tl.constexpr,
):
    """An attention program's rows (token x head) `rm`, their mask and token positions, the splits in use,
    and split s's positions [start, end) (whole steps of BLOCK_L but the last)."""
    ROWS: tl.constexpr = T * HEADS
    r_all = tl.arange(0, BLOCK_M)
    length = tl.max(tl.load(pos_ptr + r_all // HEADS, mask=r_all < ROWS, other=-1), axis=0) + 1
    rm = rp * ROW_BLOCK + tl.arange(0, ROW_BLOCK)
    m_ok = rm < ROWS
    row_pos = tl.load(pos_ptr + rm // HEADS, mask=m_ok, other=-1)  # each row's token position
    used = _splits_in_use(length, MIN_CHUNK, SPLITS)
    chunk = (length + used - 1) // used
    chunk = (chunk + BLOCK_L - 1) // BLOCK_L * BLOCK_L
    start = s * chunk
    end = tl.minimum(start + chunk, length)
    return rm, m_ok, row_pos, used, start, end


@triton.jit
def _mla_attend(
    q_ptr,
    pos_ptr,
    latent_ptr,
    rope_ptr,
    part_ptr,
    ml_ptr,
    count_ptr,
    scale,
    T: tl.constexpr,
    HEADS: tl.constexpr,
    RANK: tl.constexpr,
    ROPE: tl.constexpr,
    SPLITS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    ROW_BLOCK: tl.constexpr,
    BLOCK_L: tl.constexpr,
    D_PARTS: tl.constexpr,
    MIN_CHUNK: tl.constexpr,
    ROWS_ADJACENT: tl.constexpr,
    BF16_DOTS: tl.constexpr,
    PDL: tl.constexpr,
):
    after_previous_kernel(PDL)
    # the products' operand type: bf16 (the cache's own, so its loads feed the tensor cores as they
    # are, which lets Triton pipeline them) or fp16 (exact for these values, see above)
    DOT: tl.constexpr = tl.bfloat16 if BF16_DOTS else tl.float16
    if ROWS_ADJACENT:  # a split's row programs launch side by side: they read the same cache chunk
        rp = tl.program_id(0)
        s = tl.program_id(2)
    else:
        s = tl.program_id(0)
        rp = tl.program_id(2)  # which ROW_BLOCK rows (token x head) of the BLOCK_M this program computes
    dp = tl.program_id(1)
    if s == 0 and dp == 0 and rp == 0:
        tl.atomic_add(count_ptr, 1)
    DV: tl.constexpr = RANK // D_PARTS  # latent output columns of this program
    rm, m_ok, row_pos, used, start, end = _split_rows(
        pos_ptr, s, rp, T, HEADS, BLOCK_M, ROW_BLOCK, MIN_CHUNK, SPLITS, BLOCK_L
    )
    if s >= used:  # nothing to do: the combine reads only the splits in use
        return
    rv = dp * DV + tl.arange(0, DV)
    m_i = tl.full((ROW_BLOCK,), float("-inf"), dtype=tl.float32)
    l_i = tl.zeros((ROW_BLOCK,), dtype=tl.float32)
    acc = tl.zeros((ROW_BLOCK, DV), dtype=tl.float32)
    q_rows = q_ptr + rm[:, None] * (RANK + ROPE)
    rd = tl.arange(0, RANK)
    rr = tl.arange(0, ROPE)
    # the query once, whole: every chunk's scores are one product over the rank (and one over the rope)
    q_lat = tl.load(q_rows + rd[None, :], mask=m_ok[:, None], other=0.0).to(DOT)
    q_rope = tl.load(q_rows + RANK + rr[None, :], mask=m_ok[:, None], other=0.0).to(DOT)
    for l0 in range(start, end, BLOCK_L):
        rl = l0 + tl.arange(0, BLOCK_L)
        l_ok = rl < end
        # one load per chunk: the latent rows are the keys and (absorbed) the values
        kv = tl.load(latent_ptr + rl[:, None] * RANK + rd[None, :], mask=l_ok[:, None], other=0.0).to(DOT)
        kr = tl.load(rope_ptr + rl[:, None] * ROPE + rr[None, :], mask=l_ok[:, None], other=0.0).to(DOT)
        scores = tl.dot(q_lat, tl.trans(kv)) + tl.dot(q_rope, tl.trans(kr))
        visible = l_ok[None, :] & (rl[None, :] <= row_pos[:, None])
        scores = tl.where(visible, scores * scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp(scores - m_safe[:, None])
        alpha = tl.exp(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        if D_PARTS == 1:
            v = kv
        else:  # this program's value columns (just loaded: from the L1)
            v = tl.load(latent_ptr + rl[:, None] * RANK + rv[None, :], mask=l_ok[:, None], other=0.0).to(DOT)
        acc = acc * alpha[:, None] + tl.dot(round_bf16(p).to(DOT), v)
        m_i = m_new
    tl.store(part_ptr + (s * BLOCK_M + rm)[:, None] * RANK + rv[None, :], acc, mask=m_ok[:, None])
    if dp == 0:
        tl.store(ml_ptr + (s * BLOCK_M + rm) * 2, m_i, mask=m_ok)
        tl.store(ml_ptr + (s * BLOCK_M + rm) * 2 + 1, l_i, mask=m_ok)


@triton.jit
def _mla_attend_t(
    q_ptr,
    pos_ptr,
    latent_ptr,
    rope_ptr,
    part_ptr,
    ml_ptr,
    count_ptr,
    scale,
    T: tl.constexpr,
    HEADS: tl.constexpr,
    RANK: tl.constexpr,
    ROPE: tl.constexpr,
    SPLITS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    ROW_BLOCK: tl.constexpr,
    BLOCK_L: tl.constexpr,
    MIN_CHUNK: tl.constexpr,
    BF16_DOTS: tl.constexpr,
    PDL: tl.constexpr,
    EARLY: tl.constexpr = 0,
    THREADS: tl.constexpr = 128,
    AHEAD: tl.constexpr = 0,
):
    """_mla_attend with the products transposed (AttendLaunch.transposed; one token's in the product): the chunk's
    positions are the products' M side and the rows (token x head) their N side, scores^T = keys . q^T
    [BLOCK_L, ROW_BLOCK] and out^T += values^T . p^T [RANK, ROW_BLOCK]. One token's 32 heads then fill
    tiles of 64 or more rows without padding, the shape Hopper's warpgroup MMA takes. Same arithmetic,
    partials and layout as _mla_attend (the sums' order inside the products aside).

    EARLY > 0 (AttendLaunch.early_chunks, under PDL): before the wait for the previous kernel (the prep, which
    writes q and this call's own cache rows), each program asks the L2 for its split's first EARLY steps of the
    rows earlier steps wrote (bulk prefetches: no registers, a hint; the positions are final two kernels back),
    so that they stream while the prep runs. AHEAD > 0 (AttendLaunch.ahead_steps): each step of the loop also asks
    the L2 for the step AHEAD later (the software pipeline's loads cover only the next one)."""
    DOT: tl.constexpr = tl.bfloat16 if BF16_DOTS else tl.float16
    s = tl.program_id(0)
    rp = tl.program_id(1)
    if EARLY > 0 and PDL:
        # (only the split's span here: the rest of _split_rows after the wait, as without, keeps its registers)
        _, _, _, used0, start0, end0 = _split_rows(
            pos_ptr, s, rp, T, HEADS, BLOCK_M, ROW_BLOCK, MIN_CHUNK, SPLITS, BLOCK_L
        )
        old_end = tl.minimum(tl.minimum(end0, start0 + EARLY * BLOCK_L), tl.load(pos_ptr))  # (this call's rows: not)
        rows = tl.where(s < used0, tl.maximum(old_end - start0, 0), 0)
        prefetch_bytes_to_l2(latent_ptr + start0 * RANK, rows * (2 * RANK), EARLY * BLOCK_L * 2 * RANK, THREADS)
        prefetch_bytes_to_l2(rope_ptr + start0 * ROPE, rows * (2 * ROPE), EARLY * BLOCK_L * 2 * ROPE, THREADS)
    after_previous_kernel(PDL)
    if s == 0 and rp == 0:
        tl.atomic_add(count_ptr, 1)
    rm, m_ok, row_pos, used, start, end = _split_rows(
        pos_ptr, s, rp, T, HEADS, BLOCK_M, ROW_BLOCK, MIN_CHUNK, SPLITS, BLOCK_L
    )
    if s >= used:
        return
    m_i = tl.full((ROW_BLOCK,), float("-inf"), dtype=tl.float32)
    l_i = tl.zeros((ROW_BLOCK,), dtype=tl.float32)
    acc = tl.zeros((RANK, ROW_BLOCK), dtype=tl.float32)  # the partial output, transposed
    rd = tl.arange(0, RANK)
    rr = tl.arange(0, ROPE)
    q_rows = q_ptr + rm[None, :] * (RANK + ROPE)
    q_lat = tl.load(q_rows + rd[:, None], mask=m_ok[None, :], other=0.0).to(DOT)  # [RANK, ROW_BLOCK]
    q_rope = tl.load(q_rows + RANK + rr[:, None], mask=m_ok[None, :], other=0.0).to(DOT)
    for l0 in range(start, end, BLOCK_L):
        rl = l0 + tl.arange(0, BLOCK_L)
        l_ok = rl < end
        if AHEAD > 0 and PDL:  # (PDL: never under the interpreter, which runs no PTX)
            later = l0 + AHEAD * BLOCK_L
            rows = tl.minimum(tl.maximum(end - later, 0), BLOCK_L)
            prefetch_bytes_to_l2(latent_ptr + later * RANK, rows * (2 * RANK), BLOCK_L * 2 * RANK, THREADS)
            prefetch_bytes_to_l2(rope_ptr + later * ROPE, rows * (2 * ROPE), BLOCK_L * 2 * ROPE, THREADS)
        kv = tl.load(latent_ptr + rl[:, None] * RANK + rd[None, :], mask=l_ok[:, None], other=0.0).to(DOT)
        kr = tl.load(rope_ptr + rl[:, None] * ROPE + rr[None, :], mask=l_ok[:, None], other=0.0).to(DOT)
        scores = tl.dot(kv, q_lat) + tl.dot(kr, q_rope)  # [BLOCK_L, ROW_BLOCK]
        visible = l_ok[:, None] & (rl[:, None] <= row_pos[None, :])
        scores = tl.where(visible, scores * scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, axis=0))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp(scores - m_safe[None, :])
        alpha = tl.exp(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, axis=0)
        acc = acc * alpha[None, :] + tl.dot(tl.trans(kv), round_bf16(p).to(DOT))
        m_i = m_new
    tl.store(part_ptr + (s * BLOCK_M + rm)[None, :] * RANK + rd[:, None], acc, mask=m_ok[None, :])
    tl.store(ml_ptr + (s * BLOCK_M + rm) * 2, m_i, mask=m_ok)
    tl.store(ml_ptr + (s * BLOCK_M + rm) * 2 + 1, l_i, mask=m_ok)


@triton.jit
def _mla_combine(
    part_ptr,
    ml_ptr,
    pos_ptr,
    wuv_ptr,
    gate_ptr,
    stride_g,
    o_ptr,
    stride_o,
    count_ptr,
    T: tl.constexpr,
    HEADS: tl.constexpr,
    RANK: tl.constexpr,
    V: tl.constexpr,
    SPLITS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    V_PER: tl.constexpr,
    MIN_CHUNK: tl.constexpr,
    T_POW2: tl.constexpr,
    TOKEN_PROGRAMS: tl.constexpr,
    CH: tl.constexpr,
    PDL: tl.constexpr,
):
    """One program per head and V_PER value rows (and per token with TOKEN_PROGRAMS, else all tokens
    one after another): merge the head's partials of the splits in use, then w_uv for its rows, the
    gate. Every program of a head merges all its partials (from the L2): the merge is a few loads,
    while w_uv's rows are 4 MB a layer, worth spreading over the SMs.

    Latency, not bytes, sets this kernel's time: w_uv's rows are loaded first, and the partials are
    summed into a [CH, RANK] accumulator, reduced once at the end, so that no barrier sits between
    the loads of successive chunks and they are all in flight together."""
    after_previous_kernel(PDL)
    h = tl.program_id(0)
    vp = tl.program_id(1)
    if TOKEN_PROGRAMS:
        t_first = tl.program_id(2)
        t_end = t_first + 1
    else:
        t_first = 0
        t_end = T
    if h == 0 and vp == 0 and t_first == 0:
        tl.atomic_add(count_ptr, 1)
    rr = tl.arange(0, RANK)
    rv = vp * V_PER + tl.arange(0, V_PER)
    w = tl.load(wuv_ptr + (h * V + rv)[:, None] * RANK + rr[None, :])  # [V_PER, RANK]
    rs_all = tl.arange(0, SPLITS)
    length = tl.max(tl.load(pos_ptr + tl.arange(0, T_POW2), mask=tl.arange(0, T_POW2) < T, other=-1), axis=0) + 1
    used = _splits_in_use(length, MIN_CHUNK, SPLITS)  # as in _mla_attend
    for t in range(t_first, t_end):  # not unrolled: the registers hold one token's chunks in flight
        row = t * HEADS + h
        in_use = rs_all < used
        top = tl.max(tl.load(ml_ptr + (rs_all * BLOCK_M + row) * 2, mask=in_use, other=float("-inf")), axis=0)
        num = tl.zeros((CH, RANK), dtype=tl.float32)
        den = tl.zeros((CH,), dtype=tl.float32)
        for s0 in tl.static_range(0, SPLITS, CH):  # chunks past `used` load nothing (masked)
            rs = s0 + tl.arange(0, CH)
            ok = rs < used
            m = tl.load(ml_ptr + (rs * BLOCK_M + row) * 2, mask=ok, other=float("-inf"))
            lsum = tl.load(ml_ptr + (rs * BLOCK_M + row) * 2 + 1, mask=ok, other=0.0)
            weight = tl.where(m == float("-inf"), 0.0, tl.exp(m - top))
            acc = tl.load(part_ptr + (rs * BLOCK_M + row)[:, None] * RANK + rr[None, :], mask=ok[:, None], other=0.0)
            num += acc * weight[:, None]
            den += lsum * weight
        latent = round_bf16(tl.sum(num, axis=0) / tl.sum(den, axis=0))
        gate = round_bf16(tl.sigmoid(tl.load(gate_ptr + t * stride_g + h).to(tl.float32)))
        out = round_bf16(tl.sum(w.to(tl.float32) * latent[None, :], axis=1))
        store_rounded(o_ptr + t * stride_o + h * V + rv, out * gate, None)


@triton.jit
def _mla_combine_ranks(
    part_ptr,
    ml_ptr,
    pos_ptr,
    wuv_ptr,
    gate_ptr,
    stride_g,
    o_ptr,
    stride_o,
    opart_ptr,
    arrived_ptr,
    count_ptr,
    T: tl.constexpr,
    HEADS: tl.constexpr,
    RANK: tl.constexpr,
    V: tl.constexpr,
    V_BLOCK: tl.constexpr,
    SPLITS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    PARTS: tl.constexpr,
    MIN_CHUNK: tl.constexpr,
    T_POW2: tl.constexpr,
    PDL: tl.constexpr,
):
    """The combine cut by latent columns instead of value rows (AttendLaunch.combine_rank_parts, the
    product's since the twelfth session): program (head, part, token) merges the splits' partials of its RANK / PARTS
    latent columns, so every partial is read once (_mla_combine's programs of a head each read all of the
    head's partials: 4x the bytes at 128 value rows, 32 a program), and multiplies them by its columns of
    w_uv (loaded before the wait: weights) into a partial output of every value row. The head's last
    program to finish (a counter per row, acquire-release) sums the PARTS partial outputs in part order,
    then rounds and gates as _mla_combine does, and resets the counter for the next launch."""
    h = tl.program_id(0)
    part = tl.program_id(1)
    t = tl.program_id(2)
    R_PER: tl.constexpr = RANK // PARTS
    rr = part * R_PER + tl.arange(0, R_PER)
    rv = tl.arange(0, V_BLOCK)
    v_ok = rv < V
    w = tl.load(wuv_ptr + (h * V + rv)[:, None] * RANK + rr[None, :], mask=v_ok[:, None], other=0.0)
    after_previous_kernel(PDL)
    if h == 0 and part == 0 and t == 0:
        tl.atomic_add(count_ptr, 1)
    length = tl.max(tl.load(pos_ptr + tl.arange(0, T_POW2), mask=tl.arange(0, T_POW2) < T, other=-1), axis=0) + 1
    used = _splits_in_use(length, MIN_CHUNK, SPLITS)  # as in _mla_attend
    row = t * HEADS + h
    rs = tl.arange(0, SPLITS)
    ok = rs < used
    m = tl.load(ml_ptr + (rs * BLOCK_M + row) * 2, mask=ok, other=float("-inf"))
    lsum = tl.load(ml_ptr + (rs * BLOCK_M + row) * 2 + 1, mask=ok, other=0.0)
    acc = tl.load(part_ptr + (rs * BLOCK_M + row)[:, None] * RANK + rr[None, :], mask=ok[:, None], other=0.0)
    top = tl.max(m, axis=0)
    weight = tl.where(m == float("-inf"), 0.0, tl.exp(m - top))
    latent = round_bf16(tl.sum(acc * weight[:, None], axis=0) / tl.sum(lsum * weight, axis=0))
    partial = tl.sum(w.to(tl.float32) * latent[None, :], axis=1)  # [V_BLOCK]: this part's share of each row
    tl.store(opart_ptr + (row * PARTS + part) * V_BLOCK + rv, partial)
    tl.debug_barrier()  # every thread's share stored before the release below
    arrived = tl.atomic_add(arrived_ptr + row, 1, sem="acq_rel", scope="gpu")
    if arrived == PARTS - 1:  # the head's last program: the others' partial outputs are visible (L2 reads)
        total = tl.zeros((V_BLOCK,), dtype=tl.float32)
        for q in tl.static_range(PARTS):
            total += tl.load(opart_ptr + (row * PARTS + q) * V_BLOCK + rv, cache_modifier=".cg")
        gate = round_bf16(tl.sigmoid(tl.load(gate_ptr + t * stride_g + h).to(tl.float32)))
        store_rounded(o_ptr + t * stride_o + h * V + rv, round_bf16(total) * gate, v_ok)
        tl.atomic_xchg(arrived_ptr + row, 0, sem="relaxed", scope="gpu")


# The cards where one token's attention asks the L2 for each split's first step of old cache rows before it
# waits for the prep (AttendLaunch.early_chunks 1): measured in the whole decode step on the H100, -10.7 us at 32K
# and -8.8 at 4K (docs/results/h100_ab_lab32.log, h100_ab4k_lab32.log; 2 steps -6.6 / -9.2, 4 steps +6.3 / -7.7).
# Not on the H200 until measured there.
EARLY_CHUNK_CARDS = ("NVIDIA H100 80GB HBM3",)


def early_chunks_for(card: str) -> int:
    """The steps of old cache rows one token's attention asks the L2 for before its wait on this card (0: none)."""
    return 1 if card in EARLY_CHUNK_CARDS else 0


# The cards where one token's attention is the Gluon ring (solo.kernels.gluon_mla; with early_chunks its first two
# steps of old rows are copied before the wait for the prep): measured in the whole decode step on the H100 at 32K,
# -14.2 and -18.0 us against the Triton attention in one process, whose second capture gave +2.4
# (docs/results/h100_ab_lab66.log; alone 22.9 us a layer against 25.9, h100_mla_probe_lab66.log). On the H200
# (twenty-seventh session, two device calls): -23.2, then -21.5 and -26.5 us at 32K (h200_ab_lab70.log,
# h200_ab_lab71.log; alone 29.6 against 34.2 us a layer at 32K, 18.0 against 19.7 at 4K, h200_mla_probe_lab71.log).
GLUON_RING_CARDS = ("NVIDIA H100 80GB HBM3", "NVIDIA H200")


def gluon_ring_for(card: str) -> bool:
    """Whether one token's attention is the Gluon ring on this card (where Gluon can run)."""
    return card in GLUON_RING_CARDS


# The cards where verification's attention (several tokens) is the Gluon ring too: its tokens x heads rows in programs
# of AttendLaunch.rows_per_program (64 rows: two tokens). Measured in the whole verification step at full shape, 32K,
# on an H100 (thirty-seventh session, dev/decode_launch_ab.py): 4.902 / 4.912 -> 4.851 / 4.854 ms, outputs bit for
# bit (32 rows a program: 4.911); decode unchanged (docs/results/h100_ab_lab91.log). Not on the H200 until measured.
GLUON_WINDOW_CARDS: tuple[str, ...] = ("NVIDIA H100 80GB HBM3",)


def gluon_window_for(card: str) -> bool:
    """Whether verification's attention is the Gluon ring on this card (where Gluon can run)."""
    return card in GLUON_WINDOW_CARDS


@dataclass(frozen=True)
class AttendLaunch:
    """How one call's attention and combine are cut; `FusedMLA` keeps one for a token (decode, NEXTN
    drafts) and one for several (verification), each the best that dev/mla_probe.py measured on the
    H200 at full width (docs/results/h200_mla_probe.log)."""

    splits: int = 128  # at most about one per SM: a 32K context is 256 positions each
    min_chunk: int = 64  # positions per split at least (shorter contexts use fewer splits, fewer partials)
    block_l: int = 64  # positions per step of a split
    stages: int = 1  # software pipelining of the attention's chunk loop (shared memory per stage)
    warps: int = 8
    rows_per_program: int = 32  # rows (token x head) per attention program at rank 512 (scales with 512 / rank)
    # rows of the attention's tiles at least: fewer are padded (masked, never stored); Hopper's
    # warpgroup MMA takes tiles of 64 rows
    min_rows: int = 16
    bf16_dots: bool = False  # the products on bf16 operands, not fp16 (see _mla_attend)
    v_per_program: int = 32  # value rows per program of the combine (the heads' programs: v_dim / this)
    # several tokens: a split's row programs side by side in the launch order, so that they read each
    # cache chunk together (in the L2) instead of each pass over the rows reading the whole cache again
    # (verification 5.178 -> 5.139 ms at 32K, 4.513 -> 4.521 at 4K)
    rows_adjacent: bool = True
    # several tokens: one combine program per token, not one for all of them in turn (at 4 tokens the
    # loop made the combine a chain of four merges; measured by dev/verify_kernels_ab.py)
    combine_token_programs: bool = True
    combine_chunk: int = 16  # splits the combine merges per step (its loads in flight; registers)
    combine_warps: int = 8
    maxnreg: int | None = None  # the attention's registers per thread at most (two blocks an SM at 128)
    # > 0: the combine cut into this many slices of the latent columns (_mla_combine_ranks: every partial
    # read once, a last-arriving program per head); 0: programs of v_per_program value rows (_mla_combine)
    combine_rank_parts: int = 0
    # the attention's products transposed (_mla_attend_t: positions on the MMA's M side, rows on its N
    # side, so that one token's heads need no padding for the warpgroup MMA; FusedMLA.ONE_TOKEN's)
    transposed: bool = False
    # (transposed, under PDL) each split's first this many steps of the cache rows earlier steps wrote asked of
    # the L2 before the wait for the previous kernel (the prep), so that they stream while the prep runs
    early_chunks: int = 0
    # the prep's query programs load their block of w_uk (a weight) before the wait for the projection (lost on
    # the H100: +12 to +16 us at 32K, docs/results/h100_ab_lab33.log)
    prep_weights_early: bool = False
    # (transposed, under PDL) each step of a split's loop asks the L2 for the step this many later
    ahead_steps: int = 0
    # (one token, Hopper) the attention as solo.kernels.gluon_mla's ring: the cache's steps copied by TMA into
    # ring_buffers shared-memory buffers, each refilled as soon as its products are done (with early_chunks: the
    # ring's first steps of old rows copied before the wait for the prep)
    gluon: bool = False
    ring_buffers: int = 2


class FusedMLA:
    """The three MLA kernels of one layer, with their scratch (fixed buffers: graphs point at them)."""

    # bf16 operands let Triton pipeline the cache's loads into the products (2 stages): one token's MLA
    # 48.4 -> 44.4 us a layer at 32K, 24.5 -> 24.0 at 4K (docs/results/h200_mla_probe_bf16.log); the
    # combine merging 32 splits a step, not 16: 44.6 -> 43.1 at 32K, 23.6 -> 22.9 at 4K (h200_mla_probe_combine.log).
    # (twelfth session, the whole decode step at 32K in one process) the combine cut into 4 slices of the
    # latent columns (each split's partial read once): -23 us on the H200; the attention's products
    # transposed (positions on the MMA's M side, the 32 heads on N) on one warpgroup: -22 us on the H200
    # against the heads in two programs of 16 (docs/results/h200_ab_mla_lab15.log)
    ONE_TOKEN = AttendLaunch(bf16_dots=True, stages=2, combine_chunk=32, combine_rank_parts=4, transposed=True, warps=4)
    # several tokens: tiles of 64 rows on the warpgroup MMA, 64 splits at most (half the partials, which
    # every combine program of a head re-reads), 64 value rows a combine program: 4 tokens' MLA 144.0 ->
    # 73.9 us a layer at 32K, 51.5 -> 38.8 at 4K (the same log)
    WINDOW = AttendLaunch(
        bf16_dots=True,
        stages=2,
        min_rows=64,
        rows_per_program=64,
        splits=64,
        min_chunk=128,
        v_per_program=64,
        combine_chunk=32,
        combine_rank_parts=4,  # (twelfth session: verification 5.097 -> 5.075 ms at 32K on the H100)
    )
    RANK_BLOCK = 128

    def __init__(
        self,
        w_uk: torch.Tensor,
        w_uv: torch.Tensor,
        kv_norm_weight: torch.Tensor,
        inv_freq: torch.Tensor,
        amplitude: float,
        softmax_scale: float,
        eps: float,
        rope_dim: int,
        counter: torch.Tensor,
        kv_offset: int,
        gate_offset: int,
        launch: LaunchPolicy = PLAIN,
    ) -> None:
        self.heads, self.nope, self.rank = w_uk.shape
        self.v_dim = w_uv.shape[1]
        self.rope = rope_dim
        if interpreter_mode():  # Triton's CPU interpreter runs programs one after another, and its
            # tl.dot of bf16 operands returns garbage (Triton 3.9: values ~1e10): fp16 there, exact too
            self.ONE_TOKEN = replace(self.ONE_TOKEN, splits=16, min_chunk=16, bf16_dots=False)
            self.WINDOW = replace(self.WINDOW, splits=16, min_chunk=16, bf16_dots=False)
        elif w_uk.is_cuda and torch.cuda.get_device_capability(w_uk.device) < (8, 0):
            # tensor-core products of bf16 operands need Ampere or later; fp16 ones (exact here) do not
            self.ONE_TOKEN = replace(self.ONE_TOKEN, bf16_dots=False)
            self.WINDOW = replace(self.WINDOW, bf16_dots=False)
        elif w_uk.is_cuda:
            card = torch.cuda.get_device_name(w_uk.device)
            self.ONE_TOKEN = replace(self.ONE_TOKEN, early_chunks=early_chunks_for(card))
            ring = replace(self.ONE_TOKEN, gluon=True)
            if gluon_ring_for(card) and self._gluon_refusal(ring, 1, w_uk.device) is None:
                self.ONE_TOKEN = ring  # (where Gluon cannot run: the Triton attention, as describe() reports)
            ring = replace(self.WINDOW, gluon=True)
            if gluon_window_for(card) and self._gluon_refusal(ring, 2, w_uk.device) is None:
                self.WINDOW = ring
        if self.rank % self.RANK_BLOCK or self.v_dim % 16:
            raise ValueError("the fused MLA kernels need kv_lora_rank a multiple of 128 and v_head_dim of 16")
        for c in (self.ONE_TOKEN, self.WINDOW):
            if c.splits < 16 or c.splits & (c.splits - 1) or c.splits % min(c.combine_chunk, c.splits):
                raise ValueError(f"{c}: splits must be a power of two, at least 16, and a multiple of combine_chunk")
            self._check_rank_parts(c)
        if self.ONE_TOKEN.gluon:
            self._check_gluon(self.ONE_TOKEN, 1, w_uk.device)
        if self.WINDOW.gluon:
            self._check_gluon(self.WINDOW, 2, w_uk.device)
        self.w_uk = w_uk.contiguous()
        self.w_uv = w_uv.contiguous()
        self.kv_norm = kv_norm_weight
        self.inv_freq = inv_freq.float().contiguous()
        self.amplitude = float(amplitude)
        self.scale = float(softmax_scale)
        self.eps = float(eps)
        self.counter = counter  # [3]: prep, attend, combine launches
        self.kv_offset, self.gate_offset = kv_offset, gate_offset  # columns of kv_a and g in proj
        self.launch = launch
        self._scratch: dict[tuple[int, int, int], tuple[torch.Tensor, ...]] = {}
        self._combine_scratch: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}
        # the Gluon attention's TMA descriptors per cache, its length and the launch (checked once each)
        self._descriptors: dict[tuple[int, int, int, AttendLaunch, int], tuple] = {}

    def _check_rank_parts(self, c: AttendLaunch) -> None:
        parts = c.combine_rank_parts
        if parts and (parts & (parts - 1) or self.rank % parts or (self.rank // parts) & (self.rank // parts - 1)):
            raise ValueError(f"{c}: combine_rank_parts must be a power of two cutting the rank into powers of two")

    def _check_gluon(self, config: AttendLaunch, tokens: int, device: torch.device) -> None:
        """Refuse, naming why, a launch of the Gluon attention (AttendLaunch.gluon) that cannot run."""
        why = self._gluon_refusal(config, tokens, device)
        if why is not None:
            raise ValueError(f"{config}: the Gluon MLA attention cannot run: {why}; leave AttendLaunch.gluon off")

    def _gluon_refusal(self, config: AttendLaunch, tokens: int, device: torch.device) -> str | None:
        """Why the Gluon attention cannot run `config` for `tokens` tokens on `device`, or None when it can: the
        launch's shape first (anywhere), then the device."""
        from solo.kernels.gluon_mla import gluon_unavailable

        rows = self.heads if tokens == 1 else config.rows_per_program  # the products' N side
        why = None
        if tokens > 1 and rows not in (16, 32, 64):
            why = f"{tokens} tokens' rows (token x head) go 16, 32 or 64 to a program, not {rows}"
        elif config.block_l != 64 or self.heads % 8 or self.heads > 256 or self.rank % 64 or self.rope % 64:
            why = (
                f"it takes steps of 64 positions, 8 to 256 heads in eights and a rank and rope dimension in "
                f"sixty-fours, not {config.block_l}, {self.heads}, {self.rank} and {self.rope}"
            )
        elif config.warps not in (4, 8):
            why = f"it runs on one or two warpgroups (4 or 8 warps), not {config.warps} warps"
        elif self.rank * rows > 128 * 32 * config.warps:
            why = f"its {self.rank} x {rows} fp32 sums take more than 128 registers a thread of {config.warps} warps"
        elif not 1 <= config.ring_buffers <= 2:
            why = f"its ring holds 1 or 2 steps of 64 positions in shared memory, not {config.ring_buffers}"
        why = why or gluon_unavailable(device)
        if why is None:  # (the ring, the query and the probabilities in shared memory)
            width = self.rank + self.rope
            shared = (config.ring_buffers * config.block_l + rows) * width * 2 + config.block_l * rows * 2
            if shared > torch.cuda.get_device_properties(device).shared_memory_per_block_optin:
                why = f"its ring and query take {shared} bytes of shared memory, more than a block of this GPU has"
        return why

    def config(self, tokens: int) -> AttendLaunch:
        return self.ONE_TOKEN if tokens == 1 else self.WINDOW

    def _buffers(self, tokens: int, config: AttendLaunch, device: torch.device) -> tuple[torch.Tensor, ...]:
        block_m = triton.next_power_of_2(max(config.min_rows, tokens * self.heads))
        key = (tokens, config.splits, block_m)
        if key not in self._scratch:
            q = torch.empty((tokens, self.heads, self.rank + self.rope), dtype=torch.bfloat16, device=device)
            part = torch.empty((config.splits, block_m, self.rank), dtype=torch.float32, device=device)
            ml = torch.empty((config.splits, block_m, 2), dtype=torch.float32, device=device)
            self._scratch[key] = (q, part, ml)
        return self._scratch[key]

    def __call__(
        self,
        proj: torch.Tensor,
        positions: torch.Tensor,
        latent_cache: torch.Tensor,
        rope_cache: torch.Tensor,
        out: torch.Tensor,
        handoff: tuple[torch.Tensor, int] | None = None,
    ) -> torch.Tensor:
        """proj [T, ...] ([q | kv_a | g] at 0, kv_offset, gate_offset) -> out [T, heads*v] (gated head outputs).
        `handoff` = (counters, signals): proj comes from a GEMV that hands q and kv_a over before it ends
        (solo.kernels.handoff); the prep starts once counters[0] reaches `signals`."""
        t = proj.shape[0]
        if not 1 <= t <= MAX_TOKENS:
            raise ValueError(f"the fused MLA kernels take 1..{MAX_TOKENS} tokens, got {t}")
        check_handoff(handoff)
        config = self.config(t)
        q, part, ml = self._buffers(t, config, proj.device)
        self.prep(proj, positions, latent_cache, rope_cache, q, handoff)
        self.attend(config, q, positions, latent_cache, rope_cache, part, ml)
        return self.combine(config, proj, positions, part, ml, out)

    def prep(
        self,
        proj: torch.Tensor,
        positions: torch.Tensor,
        latent_cache: torch.Tensor,
        rope_cache: torch.Tensor,
        q: torch.Tensor,
        handoff: tuple[torch.Tensor, int] | None = None,
    ) -> None:
        """The key side into the caches, the latent query of every token and head into q."""
        t = proj.shape[0]
        splits = self.rank // self.RANK_BLOCK
        launch = self.launch.at(t)
        config = self.config(t)
        compiled = _mla_prep[(self.heads * splits + 1,)](
            proj,
            proj.stride(0),
            positions,
            self.w_uk,
            self.kv_norm,
            self.inv_freq,
            latent_cache,
            rope_cache,
            q,
            self.counter[0:1],
            handoff[0] if handoff is not None else q,
            handoff[1] if handoff is not None else 0,
            self.amplitude,
            self.eps,
            KV_OFF=self.kv_offset,
            T=t,
            BLOCK_T=16,
            HEADS=self.heads,
            NOPE=self.nope,
            ROPE=self.rope,
            RANK=self.rank,
            RANK_BLOCK=self.RANK_BLOCK,
            PDL=launch.pdl,
            HANDOFF=handoff is not None,
            **({"WEIGHTS_EARLY": True} if config.prep_weights_early else {}),
            num_warps=4,
            **launch.options,
        )
        launch.record("mla_prep", compiled)

    def attend(
        self,
        config: AttendLaunch,
        q: torch.Tensor,
        positions: torch.Tensor,
        latent_cache: torch.Tensor,
        rope_cache: torch.Tensor,
        part: torch.Tensor,
        ml: torch.Tensor,
    ) -> None:
        """Each split's partial output (latent space), running max and sum into part [splits, block_m,
        rank] and ml [splits, block_m, 2] (rows token x head); splits past the ones in use are not written."""
        t = q.shape[0]
        block_m = part.shape[1]
        launch = self.launch.at(t)
        if config.gluon:  # (its launch is built in _attend_ring: none of the Triton kernels' arguments below)
            compiled = self._attend_ring(config, q, positions, latent_cache, rope_cache, part, ml, launch)
            launch.record("mla_attend", compiled)
            return
        # the accumulator at most ROWS_PER_PROGRAM x 512 floats: several tokens split their rows (token x
        # head) over programs, each computing its rows' scores once (splitting the value columns instead
        # made every program recompute all rows' scores: 2.2 ms for 7 layers at 4 tokens and 32K on the H200)
        budget = config.rows_per_program * 512
        row_block = max(16, min(block_m, budget // self.rank))
        d_parts = max(1, row_block * self.rank // budget)
        while self.rank % (d_parts * 16):
            d_parts //= 2
        args = (q, positions, latent_cache, rope_cache, part, ml, self.counter[1:2], self.scale)
        shared = dict(
            T=t,
            HEADS=self.heads,
            RANK=self.rank,
            ROPE=self.rope,
            SPLITS=config.splits,
            BLOCK_M=block_m,
            ROW_BLOCK=row_block,
            BLOCK_L=config.block_l,
            MIN_CHUNK=config.min_chunk,
            BF16_DOTS=config.bf16_dots,
            PDL=launch.pdl,
            num_warps=config.warps,
            num_stages=config.stages,
            **({"maxnreg": config.maxnreg} if config.maxnreg else {}),
            **launch.options,
        )
        if config.transposed:
            if d_parts != 1:
                raise ValueError(f"{config}: the transposed attention computes every value column of its rows")
            early = dict(EARLY=config.early_chunks, AHEAD=config.ahead_steps, THREADS=32 * config.warps)
            early = early if config.early_chunks or config.ahead_steps else {}
            compiled = _mla_attend_t[(config.splits, block_m // row_block)](*args, **early, **shared)
        else:
            if config.early_chunks or config.ahead_steps:
                raise ValueError(f"{config}: the L2 asks for the cache rows are the transposed attention's")
            rows_adjacent = config.rows_adjacent and block_m > row_block
            grid = (config.splits, d_parts, block_m // row_block)
            compiled = _mla_attend[grid[::-1] if rows_adjacent else grid](
                *args, D_PARTS=d_parts, ROWS_ADJACENT=rows_adjacent, **shared
            )
        launch.record("mla_attend", compiled)

    def _attend_ring(
        self,
        config: AttendLaunch,
        q: torch.Tensor,
        positions: torch.Tensor,
        latent_cache: torch.Tensor,
        rope_cache: torch.Tensor,
        part: torch.Tensor,
        ml: torch.Tensor,
        launch: LaunchPolicy,
    ) -> object:
        """The attention as solo.kernels.gluon_mla's ring (AttendLaunch.gluon; several tokens' rows in programs of
        rows_per_program); refused, naming why, where it cannot run."""
        from solo.kernels import gluon_mla

        key = (latent_cache.data_ptr(), rope_cache.data_ptr(), latent_cache.shape[0], config, q.shape[0])
        if key not in self._descriptors:  # (graphs point at them; a launch is checked before its first use)
            self._check_gluon(config, q.shape[0], q.device)
            self._descriptors[key] = gluon_mla.cache_descriptors(latent_cache, rope_cache, config.block_l)
        return gluon_mla.attend_ring(
            q,
            positions,
            latent_cache,
            rope_cache,
            self._descriptors[key],
            part,
            ml,
            self.counter[1:2],
            self.scale,
            splits=config.splits,
            min_chunk=config.min_chunk,
            block_l=config.block_l,
            buffers=config.ring_buffers,
            early=config.early_chunks and max(config.early_chunks, config.ring_buffers),
            ahead=config.ahead_steps,
            warps=config.warps,
            pdl=launch.pdl,
            launch_options=launch.options,
            rows=config.rows_per_program,
        )

    def combine(
        self,
        config: AttendLaunch,
        proj: torch.Tensor,
        positions: torch.Tensor,
        part: torch.Tensor,
        ml: torch.Tensor,
        out: torch.Tensor,
    ) -> torch.Tensor:
        """The splits' partials merged, through w_uv, gated: out [T, heads * v]."""
        t = proj.shape[0]
        block_m = part.shape[1]
        launch = self.launch.at(t)
        gate = proj[:, self.gate_offset :]
        if config.combine_rank_parts:
            return self._combine_ranks(config, t, positions, part, ml, gate, out, launch)
        v_per = min(config.v_per_program, self.v_dim & -self.v_dim)  # a power of two dividing v_head_dim
        token_programs = config.combine_token_programs and t > 1
        compiled = _mla_combine[(self.heads, self.v_dim // v_per, t if token_programs else 1)](
            part,
            ml,
            positions,
            self.w_uv,
            gate,
            gate.stride(0),
            out,
            out.stride(0),
            self.counter[2:3],
            T=t,
            HEADS=self.heads,
            RANK=self.rank,
            V=self.v_dim,
            SPLITS=config.splits,
            BLOCK_M=block_m,
            V_PER=v_per,
            MIN_CHUNK=config.min_chunk,
            T_POW2=triton.next_power_of_2(t),
            TOKEN_PROGRAMS=token_programs,
            CH=min(config.combine_chunk, config.splits),
            PDL=launch.pdl,
            num_warps=config.combine_warps,
            **launch.options,
        )
        launch.record("mla_combine", compiled)
        return out

    def _combine_ranks(
        self,
        config: AttendLaunch,
        t: int,
        positions: torch.Tensor,
        part: torch.Tensor,
        ml: torch.Tensor,
        gate: torch.Tensor,
        out: torch.Tensor,
        launch: LaunchPolicy,
    ) -> torch.Tensor:
        """The combine as _mla_combine_ranks: programs (head, slice of the latent columns, token)."""
        self._check_rank_parts(config)
        parts, v_block = config.combine_rank_parts, triton.next_power_of_2(self.v_dim)
        key = (t, parts)
        if key not in self._combine_scratch:  # (per call shape: graphs point at them)
            self._combine_scratch[key] = (
                torch.empty((t * self.heads, parts, v_block), dtype=torch.float32, device=part.device),
                torch.zeros(t * self.heads, dtype=torch.int32, device=part.device),  # zero between launches
            )
        opart, arrived = self._combine_scratch[key]
        compiled = _mla_combine_ranks[(self.heads, parts, t)](
            part,
            ml,
            positions,
            self.w_uv,
            gate,
            gate.stride(0),
            out,
            out.stride(0),
            opart,
            arrived,
            self.counter[2:3],
            T=t,
            HEADS=self.heads,
            RANK=self.rank,
            V=self.v_dim,
            V_BLOCK=v_block,
            SPLITS=config.splits,
            BLOCK_M=part.shape[1],
            PARTS=parts,
            MIN_CHUNK=config.min_chunk,
            T_POW2=triton.next_power_of_2(t),
            PDL=launch.pdl,
            num_warps=config.combine_warps,
            **launch.options,
        )
        launch.record("mla_combine", compiled)
        return out

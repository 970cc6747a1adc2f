"""Routed MoE in MXFP4 for few tokens (decode, verification, short prompts) on the CUDA cores: a GEMV
per (token, expert).

Why not the tensor cores: at decode the token side of an MMA is padded to 16 rows, and Triton's
MXFP4 MMA path (``tl.dot_scaled``) widens every code through layout shuffles; on the H200 that ran
at about 0.9 TB/s. A GEMV needs one multiply-add per weight, so the cost to beat is the unpacking.

Code words. ``TritonMoE`` repacks the E2M1 codes at load into 32-bit words laid out for this
unpacking (``pack_e2m1_words``; same size as the checkpoint's codes). Word ``c`` holds elements
8c..8c+7; element ``8c + j`` (j < 4) lives in the low half-word, ``8c + j + 4`` at the same places in
the high half. Per half-word, code j's three magnitude bits (e1 e0 m) and its sign sit at

    j = 0: bits 9-11, sign 15      j = 1: bits 6-8, sign 12
    j = 2: bits 3-5,  sign 14      j = 3: bits 0-2, sign 13

so one AND (j = 0), a shift and an AND (j = 1), or two shifts and two ANDs (j = 2, 3) move both
halves' codes to ``s << 15 | (e1 e0 m) << 9``, the fp16 bit pattern of value * 2^-14, exactly,
including the subnormal code 0.5 (fp16 keeps subnormals; the widening to fp32 is exact). That is 11
integer operations per 8 codes; the checkpoint's nibble order needs 17 (timed on the H200: 17.5 ->
16.9 us at one token, 46.0 -> 41.4 us at four, ``dev/gemv_variants.py``). Products are summed
in fp32 per 32-code group, multiplied by the group's E8M0 scale (``s << 23`` read as fp32 is
2^(s-127)) and the 2^14 is put back once at the end.

The activations are read as uint32 pairs of bf16 (one 4-byte load gives two of them, widened by a
shift or a mask). The K loop is unrolled at compile time (faster on the H200 than a pipelined loop;
docs/kernels.md lists what else was tried). Two launches, like the tensor-core path in
solo.kernels.triton_moe (same layouts, same contracts):
``_gemv_gate_up_act`` (grid: assignments x I/BLOCK_N; gate and up rows of one expert, SwiGLU in fp32,
act stored in bf16) and ``_gemv_down_combine`` (grid: tokens x H/BLOCK_N x expert splits; walks the
token's experts, routing weight folded into the group scale, last-arriver reduction of the splits).
With ``PDL`` (Hopper+, programmatic dependent launch) the down kernel is launched while gate_up still
runs and waits with ``gdc_wait`` before it reads act; with ``EARLY_WEIGHTS`` (asked for above one
token) it issues its weight loads before that wait.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from solo.kernels.triton_epilogues import store_split_sum, swiglu_store

try:  # grid dependency control (programmatic dependent launch), Triton >= 3.4, SM90+
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # pragma: no cover - older Triton: the launcher never asks for PDL then
    gdc_launch_dependents = gdc_wait = None


EEM_BITS = (9, 6, 3, 0)  # lowest magnitude bit of code j (j = 0..3) in a half-word of a packed word
SIGN_BITS = (15, 12, 14, 13)  # its sign bit


PACK_SLICE_WORDS = 1 << 24  # words packed at a time (64 MB of codes)


def pack_e2m1_words(codes: torch.Tensor) -> torch.Tensor:
    """Checkpoint E2M1 bytes [..., K/2] (element 2i in the low nibble) -> packed int32 words [..., K/8]
    in the layout of the module docstring. K must be a multiple of 8."""
    if codes.dtype != torch.uint8 or codes.shape[-1] % 4:
        raise ValueError(f"need uint8 codes with K/2 a multiple of 4, got {codes.dtype} {tuple(codes.shape)}")
    words = codes.contiguous().view(torch.int32)
    flat = words.reshape(-1, words.shape[-1])
    out = torch.empty_like(flat)
    # in slices: the int64 temporaries are 2 bytes per code each, about 10 GB for one layer's gate_up at
    # full Ling shape, which is what kept the full-shape model off an 80 GB GPU
    step = max(1, PACK_SLICE_WORDS // max(1, flat.shape[1]))
    for i in range(0, flat.shape[0], step):
        out[i : i + step] = _pack_words(flat[i : i + step])
    return out.view(words.shape)


def _pack_words(words: torch.Tensor) -> torch.Tensor:
    std = words.to(torch.int64) & 0xFFFFFFFF  # code n at bits 4n..4n+3
    out = torch.zeros_like(std)
    for n in range(8):
        j, half = n % 4, 16 * (n // 4)
        code = (std >> (4 * n)) & 0xF
        out |= ((code & 0x7) << (EEM_BITS[j] + half)) | ((code >> 3) << (SIGN_BITS[j] + half))
    return torch.where(out >= 2**31, out - 2**32, out).to(torch.int32)


def unpack_e2m1_words(words: torch.Tensor) -> torch.Tensor:
    """Inverse of ``pack_e2m1_words`` (for tests and for reading the layout back)."""
    packed = words.to(torch.int64) & 0xFFFFFFFF
    std = torch.zeros_like(packed)
    for n in range(8):
        j, half = n % 4, 16 * (n // 4)
        eem = (packed >> (EEM_BITS[j] + half)) & 0x7
        sign = (packed >> (SIGN_BITS[j] + half)) & 0x1
        std |= (eem | (sign << 3)) << (4 * n)
    std = torch.where(std >= 2**31, std - 2**32, std).to(torch.int32)
    return std.view(torch.uint8).reshape(*words.shape[:-1], words.shape[-1] * 4)


@triton.jit
def e2m1_pair_f16(w, J: tl.constexpr):
    """Codes J and J+4 of every packed uint32 word of ``w``, as fp16 values times 2^-14."""
    if J == 0:
        bits = w & 0x8E008E00
    elif J == 1:
        bits = (w << 3) & 0x8E008E00
    elif J == 2:
        bits = ((w << 6) & 0x0E000E00) | ((w << 1) & 0x80008000)
    else:
        bits = ((w << 9) & 0x0E000E00) | ((w << 2) & 0x80008000)
    return bits.to(tl.uint16).to(tl.float16, bitcast=True), (bits >> 16).to(tl.uint16).to(tl.float16, bitcast=True)


@triton.jit
def _e2m1_pair(w, J: tl.constexpr):
    """Codes J and J+4 of every packed uint32 word of ``w``, as fp32 values times 2^-14."""
    lo, hi = e2m1_pair_f16(w, J)
    return lo.to(tl.float32), hi.to(tl.float32)


@triton.jit
def e2m1_standard_bytes(w):
    """Packed uint32 words [R, C] -> the checkpoint's E2M1 bytes [R, 4C] (for ``tl.dot_scaled``)."""
    std = (
        ((w >> 9) & 0x00070007)
        | ((w >> 12) & 0x00080008)
        | ((w >> 2) & 0x00700070)
        | ((w >> 5) & 0x00800080)
        | ((w << 5) & 0x07000700)
        | ((w >> 3) & 0x08000800)
        | ((w << 12) & 0x70007000)
        | ((w << 2) & 0x80008000)
    )
    b0 = (std & 0xFF).to(tl.uint8)
    b1 = ((std >> 8) & 0xFF).to(tl.uint8)
    b2 = ((std >> 16) & 0xFF).to(tl.uint8)
    b3 = (std >> 24).to(tl.uint8)
    both = tl.join(tl.join(b0, b2), tl.join(b1, b3))  # [R, C, 2, 2]: byte 2*m + l at [.., m, l]
    return tl.reshape(both, (w.shape[0], w.shape[1] * 4))


@triton.jit
def _e8m0(s):
    """E8M0 scale bytes -> fp32 2^(s-127) (s = 0 reads as 0)."""
    return (s.to(tl.uint32) << 23).to(tl.float32, bitcast=True)


@triton.jit
def _bf16_pair(xq):
    """The two bf16 halves of uint32 words as fp32 (element 2q is the low half)."""
    return (xq << 16).to(tl.float32, bitcast=True), (xq & 0xFFFF0000).to(tl.float32, bitcast=True)


@triton.jit
def _words_dot(w, xq_ptrs, x_mask, MASKED: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_W: tl.constexpr):
    """Per-group sums [BLOCK_N, BLOCK_W // 4] of codes(w) . x.

    ``xq_ptrs`` points at the activations as uint32 pairs of bf16: word q = 0..3 of code word c
    holds elements 8c + 2q and 8c + 2q + 1. Pair j of ``_e2m1_pair`` needs elements j and j + 4.
    """
    if MASKED:
        xq0 = tl.load(xq_ptrs, mask=x_mask, other=0).to(tl.uint32, bitcast=True)
        xq1 = tl.load(xq_ptrs + 1, mask=x_mask, other=0).to(tl.uint32, bitcast=True)
        xq2 = tl.load(xq_ptrs + 2, mask=x_mask, other=0).to(tl.uint32, bitcast=True)
        xq3 = tl.load(xq_ptrs + 3, mask=x_mask, other=0).to(tl.uint32, bitcast=True)
    else:
        xq0 = tl.load(xq_ptrs).to(tl.uint32, bitcast=True)
        xq1 = tl.load(xq_ptrs + 1).to(tl.uint32, bitcast=True)
        xq2 = tl.load(xq_ptrs + 2).to(tl.uint32, bitcast=True)
        xq3 = tl.load(xq_ptrs + 3).to(tl.uint32, bitcast=True)
    x0, x1 = _bf16_pair(xq0)
    x2, x3 = _bf16_pair(xq1)
    x4, x5 = _bf16_pair(xq2)
    x6, x7 = _bf16_pair(xq3)
    lo, hi = _e2m1_pair(w, 0)
    part = lo * x0[None, :]
    part = tl.fma(hi, x4[None, :], part)
    lo, hi = _e2m1_pair(w, 1)
    part = tl.fma(lo, x1[None, :], part)
    part = tl.fma(hi, x5[None, :], part)
    lo, hi = _e2m1_pair(w, 2)
    part = tl.fma(lo, x2[None, :], part)
    part = tl.fma(hi, x6[None, :], part)
    lo, hi = _e2m1_pair(w, 3)
    part = tl.fma(lo, x3[None, :], part)
    part = tl.fma(hi, x7[None, :], part)
    return tl.sum(tl.reshape(part, (BLOCK_N, BLOCK_W // 4, 4)), axis=2)


@triton.jit
def _gemv_gate_up_act(
    xq_ptr,
    ids_ptr,
    w_ptr,
    s_ptr,
    act_ptr,
    stride_xq,
    limit,
    H: tl.constexpr,
    I: tl.constexpr,
    TOPK: tl.constexpr,
    HAS_LIMIT: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_W: tl.constexpr,
    PDL: tl.constexpr,
):
    a = tl.program_id(0)
    pid_n = tl.program_id(1)
    if PDL:
        gdc_launch_dependents()  # the down kernel may start now; it waits (gdc_wait) before reading act
    t = a // TOPK
    e = tl.load(ids_ptr + a).to(tl.int64)
    HW: tl.constexpr = H // 8  # code words per row
    HG: tl.constexpr = H // 32  # scale groups per row
    G: tl.constexpr = BLOCK_W // 4
    NK: tl.constexpr = (HW + BLOCK_W - 1) // BLOCK_W
    EVEN_N: tl.constexpr = I % BLOCK_N == 0
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rw = tl.arange(0, BLOCK_W)
    rg = tl.arange(0, G)
    n_ok = rn < I
    wg_ptrs = w_ptr + e * (2 * I * HW) + rn[:, None] * HW + rw[None, :]
    sg_ptrs = s_ptr + e * (2 * I * HG) + rn[:, None] * HG + rg[None, :]
    xq_ptrs = xq_ptr + t * stride_xq + rw * 4
    acc_g = tl.zeros((BLOCK_N, G), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_N, G), dtype=tl.float32)
    # Fully unrolled over K (NK is small): every tile's loads can be issued before the first
    # tile's arithmetic, which keeps enough bytes in flight at one token.
    for kt in tl.static_range(NK):
        k0 = kt * BLOCK_W
        MASKED = not EVEN_N or k0 + BLOCK_W > HW
        w_ok = (k0 + rw) < HW
        if MASKED:
            wmask = n_ok[:, None] & w_ok[None, :]
            smask = n_ok[:, None] & ((k0 // 4 + rg) < HG)[None, :]
            wg = tl.load(wg_ptrs + k0, mask=wmask, other=0, eviction_policy="evict_first")
            wu = tl.load(wg_ptrs + (I * HW + k0), mask=wmask, other=0, eviction_policy="evict_first")
            sg = tl.load(sg_ptrs + k0 // 4, mask=smask, other=0)
            su = tl.load(sg_ptrs + (I * HG + k0 // 4), mask=smask, other=0)
        else:
            wg = tl.load(wg_ptrs + k0, eviction_policy="evict_first")
            wu = tl.load(wg_ptrs + (I * HW + k0), eviction_policy="evict_first")
            sg = tl.load(sg_ptrs + k0 // 4)
            su = tl.load(sg_ptrs + (I * HG + k0 // 4))
        xp = xq_ptrs + k0 * 4
        acc_g += _words_dot(wg.to(tl.uint32, bitcast=True), xp, w_ok, MASKED, BLOCK_N, BLOCK_W) * _e8m0(sg)
        acc_u += _words_dot(wu.to(tl.uint32, bitcast=True), xp, w_ok, MASKED, BLOCK_N, BLOCK_W) * _e8m0(su)
    g = tl.sum(acc_g, axis=1) * 16384.0  # 2^14 (see module docstring)
    u = tl.sum(acc_u, axis=1) * 16384.0  # 2^14 (see module docstring)
    swiglu_store(g, u, act_ptr, a * I + rn, n_ok, limit, HAS_LIMIT, EVEN_N)


@triton.jit
def _down_tile(w_ptr, s_ptr, e, kt, w_off, s_off, n_ok, rw, rg, H, IW, IG, BLOCK_W: tl.constexpr, EVEN_N: tl.constexpr):
    """Code words and scale bytes of K tile ``kt`` of expert ``e``'s down rows (see the kernel)."""
    k0 = kt * BLOCK_W
    w_ptrs = w_ptr + e * (H * IW) + k0 + w_off
    s_ptrs = s_ptr + e * (H * IG) + k0 // 4 + s_off
    if not EVEN_N or k0 + BLOCK_W > IW:
        w_ok = (k0 + rw) < IW
        w = tl.load(w_ptrs, mask=n_ok[:, None] & w_ok[None, :], other=0, eviction_policy="evict_first")
        s = tl.load(s_ptrs, mask=n_ok[:, None] & ((k0 // 4 + rg) < IG)[None, :], other=0)
    else:
        w = tl.load(w_ptrs, eviction_policy="evict_first")
        s = tl.load(s_ptrs)
    return w, s


@triton.jit
def _down_tile_dot(w, s, wt, xa, kt, rw, IW, BLOCK_N: tl.constexpr, BLOCK_W: tl.constexpr, EVEN_N: tl.constexpr):
    """Group-scaled partial sums of K tile ``kt`` against the assignment's act (bf16 pairs at xa)."""
    k0 = kt * BLOCK_W
    w_ok = (k0 + rw) < IW
    masked = not EVEN_N or k0 + BLOCK_W > IW
    dots = _words_dot(w.to(tl.uint32, bitcast=True), xa + (k0 + rw) * 4, w_ok, masked, BLOCK_N, BLOCK_W)
    return dots * (_e8m0(s) * wt)


@triton.jit
def _gemv_down_combine(
    aq_ptr,
    ids_ptr,
    wt_ptr,
    w_ptr,
    s_ptr,
    o_ptr,
    part_ptr,
    cnt_ptr,
    stride_ot,
    sh_ptr,
    H: tl.constexpr,
    I: tl.constexpr,
    TOPK: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_W: tl.constexpr,
    SPLIT_E: tl.constexpr,
    PDL: tl.constexpr,
    EARLY_WEIGHTS: tl.constexpr,
    ONTO: tl.constexpr = False,
):
    # ONTO: o_ptr is the residual stream and the sum is added onto it with the shared expert's output sh_ptr (same
    # strides), in the order of the shared down's epilogue (triton_epilogues.store_rows_onto)
    t = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_e = tl.program_id(2)
    IW: tl.constexpr = I // 8
    IG: tl.constexpr = I // 32
    G: tl.constexpr = BLOCK_W // 4
    NK: tl.constexpr = (IW + BLOCK_W - 1) // BLOCK_W
    EPS: tl.constexpr = TOPK // SPLIT_E  # experts handled by this program
    EVEN_N: tl.constexpr = H % BLOCK_N == 0
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rw = tl.arange(0, BLOCK_W)
    rg = tl.arange(0, G)
    n_ok = rn < H
    w_off = rn[:, None] * IW + rw[None, :]
    s_off = rn[:, None] * IG + rg[None, :]
    acc = tl.zeros((BLOCK_N, G), dtype=tl.float32)
    if EARLY_WEIGHTS and EPS == 1 and NK <= 4:
        # One expert, few K tiles: issue all of its weight loads before waiting for gate_up's act,
        # so under PDL the expert's bytes are fetched while gate_up is still running. Measured on
        # the H200: 4 tokens 46.4 -> 44.7 us, but 1 token 17.2 -> 18.3 us (the early loads slow the
        # gate_up kernel they overlap), so the launcher asks for it only above one token.
        a = t * TOPK + pid_e
        e = tl.load(ids_ptr + a).to(tl.int64)
        wt = tl.load(wt_ptr + a)
        w0, s0 = _down_tile(w_ptr, s_ptr, e, 0, w_off, s_off, n_ok, rw, rg, H, IW, IG, BLOCK_W, EVEN_N)
        w1, s1, w2, s2, w3, s3 = w0, s0, w0, s0, w0, s0
        if NK > 1:
            w1, s1 = _down_tile(w_ptr, s_ptr, e, 1, w_off, s_off, n_ok, rw, rg, H, IW, IG, BLOCK_W, EVEN_N)
        if NK > 2:
            w2, s2 = _down_tile(w_ptr, s_ptr, e, 2, w_off, s_off, n_ok, rw, rg, H, IW, IG, BLOCK_W, EVEN_N)
        if NK > 3:
            w3, s3 = _down_tile(w_ptr, s_ptr, e, 3, w_off, s_off, n_ok, rw, rg, H, IW, IG, BLOCK_W, EVEN_N)
        if PDL:  # launched early (programmatic dependent launch): wait for gate_up's act to be complete
            gdc_wait()
        xa = aq_ptr + a * (I // 2)
        acc += _down_tile_dot(w0, s0, wt, xa, 0, rw, IW, BLOCK_N, BLOCK_W, EVEN_N)
        if NK > 1:
            acc += _down_tile_dot(w1, s1, wt, xa, 1, rw, IW, BLOCK_N, BLOCK_W, EVEN_N)
        if NK > 2:
            acc += _down_tile_dot(w2, s2, wt, xa, 2, rw, IW, BLOCK_N, BLOCK_W, EVEN_N)
        if NK > 3:
            acc += _down_tile_dot(w3, s3, wt, xa, 3, rw, IW, BLOCK_N, BLOCK_W, EVEN_N)
    else:
        if PDL:
            gdc_wait()
        for j in tl.static_range(EPS):  # unrolled (few experts x few K tiles), see the gate_up kernel
            a = t * TOPK + pid_e * EPS + j
            e = tl.load(ids_ptr + a).to(tl.int64)
            wt = tl.load(wt_ptr + a)
            xa = aq_ptr + a * (I // 2)
            for kt in tl.static_range(NK):
                w, s = _down_tile(w_ptr, s_ptr, e, kt, w_off, s_off, n_ok, rw, rg, H, IW, IG, BLOCK_W, EVEN_N)
                acc += _down_tile_dot(w, s, wt, xa, kt, rw, IW, BLOCK_N, BLOCK_W, EVEN_N)
    y = tl.sum(acc, axis=1) * 16384.0  # 2^14 (see module docstring)
    slot = t * tl.num_programs(1) + pid_n
    offs = t * stride_ot + rn
    store_split_sum(y, o_ptr, offs, n_ok, part_ptr, cnt_ptr, slot, pid_e, SPLIT_E, BLOCK_N, EVEN_N, sh_ptr, ONTO)

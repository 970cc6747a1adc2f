"""Epilogues shared by the Triton MoE kernels (tensor-core and GEMV paths).

``store_split_sum``: a program owning BLOCK rows of one output either stores them (no split) or,
when its work was split across SPLIT programs, parks its fp32 partial in a scratch buffer and bumps
an acq_rel counter; the last program to arrive adds the partials in a fixed order (deterministic),
stores the rows once and resets the counter to zero, so CUDA-graph replays need no memset. With ONTO the
stored rows are added onto the output (the residual stream) with the shared expert's output, as the shared
expert's down projection would add them (``store_rows_onto``).
``split_scratch`` keeps the host side: the partials and counters those reductions use.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


def split_scratch(
    store: dict, key: object, numel: int, dtype: torch.dtype, zero: bool, device: torch.device, first: int = 0
) -> torch.Tensor:
    """A scratch buffer of at least ``numel`` elements, kept in ``store`` under ``key``.

    A stored buffer is never replaced: a captured CUDA graph may point at it, and freeing it would
    leave the graph writing into memory that other tensors reuse. A call needing more (a long
    prefill) gets a buffer of its own. The first buffer stored holds at least ``first`` elements.
    Counters (``zero``) start at zero; the reductions leave them at zero.
    """
    buf = store.get(key)
    if buf is not None and buf.numel() >= numel:
        return buf
    size = max(numel, first if buf is None else 0, 1)
    fresh = (torch.zeros if zero else torch.empty)(size, dtype=dtype, device=device)
    if buf is None:
        store[key] = fresh
    return fresh


@triton.jit
def round_bf16(x):
    """fp32 -> the nearest bf16 value (ties to even), kept in fp32. Explicit so that Triton's CPU
    interpreter (which truncates in `.to(tl.bfloat16)`) rounds as the GPU and the reference do."""
    bits = x.to(tl.int32, bitcast=True)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & -65536
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def store_rows(o_ptr, offs, y, ok, EVEN: tl.constexpr):
    """out[offs] = y in the output's dtype (masked by ok unless the tile is EVEN)."""
    if EVEN:
        tl.store(o_ptr + offs, y.to(o_ptr.dtype.element_ty))
    else:
        tl.store(o_ptr + offs, y.to(o_ptr.dtype.element_ty), mask=ok)


@triton.jit
def store_rows_onto(o_ptr, offs, y, ok, sh_ptr, ONTO: tl.constexpr, EVEN: tl.constexpr):
    """ONTO: out[offs] = (out[offs] + shared[offs]) + y rounded to out's dtype, summed in fp32 and rounded once,
    the order in which the shared expert's down projection adds its own output and the routed sum onto the residual
    stream (solo/kernels/cuda/gemv_decode.cu, EPI 1 with ADD); else out[offs] = y (store_rows)."""
    if ONTO:  # (bf16 rows: add_onto_residual checks them; rounded explicitly, as round_bf16 says why)
        y = round_bf16(y)
        if EVEN:
            residual = tl.load(o_ptr + offs).to(tl.float32)
            shared = tl.load(sh_ptr + offs).to(tl.float32)
        else:
            residual = tl.load(o_ptr + offs, mask=ok, other=0.0).to(tl.float32)
            shared = tl.load(sh_ptr + offs, mask=ok, other=0.0).to(tl.float32)
        y = round_bf16((residual + shared) + y)
    store_rows(o_ptr, offs, y, ok, EVEN)


@triton.jit
def store_split_sum(
    y,
    o_ptr,
    offs,
    ok,
    part_ptr,
    cnt_ptr,
    slot,
    split_id,
    SPLIT: tl.constexpr,
    BLOCK: tl.constexpr,
    EVEN: tl.constexpr,
    sh_ptr=None,
    ONTO: tl.constexpr = False,
):
    """Store y [BLOCK] fp32, summed over the SPLIT programs sharing ``slot`` (see module docstring); with ONTO
    added onto the residual stream ``out`` with the shared expert's output ``sh_ptr`` (store_rows_onto)."""
    if SPLIT == 1:
        store_rows_onto(o_ptr, offs, y, ok, sh_ptr, ONTO, EVEN)
    else:
        rl = tl.arange(0, BLOCK)
        p_base = part_ptr + slot * (SPLIT * BLOCK)
        tl.store(p_base + split_id * BLOCK + rl, y)
        tl.debug_barrier()
        arrived = tl.atomic_add(cnt_ptr + slot, 1, sem="acq_rel", scope="gpu")
        if arrived == SPLIT - 1:
            total = tl.zeros((BLOCK,), dtype=tl.float32)
            for j in tl.static_range(SPLIT):
                total += tl.load(p_base + j * BLOCK + rl, cache_modifier=".cg")
            store_rows_onto(o_ptr, offs, total, ok, sh_ptr, ONTO, EVEN)
            tl.atomic_xchg(cnt_ptr + slot, 0, sem="relaxed", scope="gpu")


@triton.jit
def swiglu_store(g, u, a_ptr, offs, ok, limit, HAS_LIMIT: tl.constexpr, EVEN: tl.constexpr):
    """act = silu(g) * u in fp32 (optional Ling clamp: silu(g).clamp(max=L) * u.clamp(-L, L)), stored bf16."""
    act = g / (1.0 + tl.exp(-g))
    if HAS_LIMIT:
        act = tl.minimum(act, limit)
        u = tl.minimum(tl.maximum(u, -limit), limit)
    store_rows(a_ptr, offs, act * u, ok, EVEN)

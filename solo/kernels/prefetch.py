"""Weights into the L2 ahead of use: bulk prefetches of row segments (sm_90 `cp.async.bulk.prefetch.L2`).

A kernel's weights depend on nothing the step computes, so a program can ask for all of its slice
before it waits for its predecessor (under PDL, while that predecessor still runs). The instruction
takes no registers and returns nothing; it is a hint, so the arithmetic is unchanged. Addresses must
be 16-byte aligned and sizes multiples of 16 bytes (`prefetch_unavailable` checks a weight).

Used by the router, whose scores are a latency-bound 2.6 MB (on the H200 with PDL: 11.1 us per
router against 12.2 without the prefetch, dev/launch_probe.py). Measured and dropped for the fused
GEMVs, which stream at a steady rate once started: 12.8 us per kernel of the step's projection chain
with it against 9.1 without (11.6 with PDL).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from solo.kernels.triton_fp8 import interpreter_mode


@triton.jit
def _bulk_prefetch(address, nbytes):
    """For each element: ask the L2 for `nbytes` bytes from the int64 `address` (0 bytes: nothing)."""
    tl.inline_asm_elementwise(
        "{ .reg .pred p; setp.ne.u32 p, $2, 0; @p cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0; }",
        "=r,l,r",
        [address, nbytes],
        dtype=tl.int32,
        is_pure=False,
        pack=1,
    )


@triton.jit
def prefetch_rows_to_l2(first_ptr, row_bytes, rows, seg_bytes, ROWS: tl.constexpr, THREADS: tl.constexpr):
    """Prefetch `rows` (<= ROWS) segments of `seg_bytes` bytes, `row_bytes` apart, from `first_ptr`.

    Spread so that each of the program's THREADS threads issues one request (a [THREADS] tensor has
    one element per thread, none replicated): with fewer rows than threads every row is cut into
    THREADS // ROWS chunks of whole 16-byte units."""
    SLOTS: tl.constexpr = ROWS if ROWS > THREADS else THREADS
    CHUNKS: tl.constexpr = SLOTS // ROWS
    slot = tl.arange(0, SLOTS)
    row = slot % ROWS
    chunk = slot // ROWS
    size = (seg_bytes + (16 * CHUNKS - 1)) // (16 * CHUNKS) * 16
    offset = chunk * size
    nbytes = tl.minimum(tl.maximum(seg_bytes - offset, 0), size)
    nbytes = tl.where(row < rows, nbytes, 0)
    address = first_ptr.to(tl.int64) + row.to(tl.int64) * row_bytes + offset
    _bulk_prefetch(address, nbytes.to(tl.int32))


def prefetch_unavailable(tensor: torch.Tensor, *row_bytes: int) -> str | None:
    """Why rows of `tensor` (each segment `row_bytes` long) cannot be bulk-prefetched, or None when they can."""
    if interpreter_mode():
        return "Triton's CPU interpreter runs no PTX"
    if tensor.device.type != "cuda":
        return f"the bulk L2 prefetch needs an NVIDIA GPU; the weight is on '{tensor.device.type}'"
    if torch.cuda.get_device_capability(tensor.device)[0] < 9:
        return "the bulk L2 prefetch needs compute capability 9.0 (Hopper) or later"
    if tensor.data_ptr() % 16 or any(n % 16 for n in row_bytes):
        return "bulk prefetches need 16-byte aligned rows and segments"
    return None

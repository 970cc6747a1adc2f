"""Weights into the L2 ahead of use: bulk prefetches of contiguous blocks (sm_90 `cp.async.bulk.prefetch.L2`).

A kernel's weights depend on nothing the step computes, so a program can ask for all of its slice
(contiguous rows) before it waits for its predecessor (under PDL, while that predecessor still
runs). The instruction takes no registers and returns nothing; it is a hint, so the arithmetic is
unchanged. Addresses must be 16-byte aligned and sizes multiples of 16 bytes (`prefetch_unavailable`
checks a weight).

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
def _prefetch_span(address, nbytes, MAX_BYTES: tl.constexpr, THREADS: tl.constexpr):
    """Ask the L2 for the `nbytes` (a multiple of 16, at most MAX_BYTES) from the int64 byte `address`, cut into
    one request per thread of the program's THREADS (a [THREADS] tensor has one element per thread, none
    replicated), whole 16-byte units."""
    SIZE: tl.constexpr = (MAX_BYTES + 16 * THREADS - 1) // (16 * THREADS) * 16
    offset = tl.arange(0, THREADS) * SIZE
    size = tl.minimum(tl.maximum(nbytes - offset, 0), SIZE)
    _bulk_prefetch(address + offset, size.to(tl.int32))


@triton.jit
def prefetch_to_l2(ptr, NBYTES: tl.constexpr, THREADS: tl.constexpr):
    """Prefetch NBYTES contiguous bytes from `ptr`."""
    _prefetch_span(ptr.to(tl.int64), NBYTES, NBYTES, THREADS)


@triton.jit
def prefetch_bytes_to_l2(ptr, nbytes, MAX_BYTES: tl.constexpr, THREADS: tl.constexpr):
    """Prefetch the first `nbytes` (a multiple of 16, at most MAX_BYTES) from `ptr`."""
    _prefetch_span(ptr.to(tl.int64), nbytes, MAX_BYTES, THREADS)


@triton.jit
def prefetch_part_to_l2(ptr, total_bytes, part, SHARE: tl.constexpr, THREADS: tl.constexpr):
    """Prefetch part `part` of the `total_bytes` (a multiple of 16) from `ptr`, parts of SHARE bytes (a
    multiple of 16) each, the last one cut at the end."""
    start = part.to(tl.int64) * SHARE
    _prefetch_span(ptr.to(tl.int64) + start, tl.minimum(total_bytes - start, SHARE), SHARE, THREADS)


def prefetch_unavailable(tensor: torch.Tensor, block_bytes: int) -> str | None:
    """Why blocks of `block_bytes` of `tensor` cannot be bulk-prefetched, or None when they can."""
    if interpreter_mode():
        return "Triton's CPU interpreter runs no PTX"
    if tensor.device.type != "cuda":
        return f"the bulk L2 prefetch needs an NVIDIA GPU; the weight is on '{tensor.device.type}'"
    if torch.cuda.get_device_capability(tensor.device)[0] < 9:
        return "the bulk L2 prefetch needs compute capability 9.0 (Hopper) or later"
    if tensor.data_ptr() % 16 or block_bytes % 16:
        return "bulk prefetches need 16-byte aligned blocks of whole 16-byte units"
    return None

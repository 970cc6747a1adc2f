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

Weights ahead (`weights_ahead`): a kernel whose own time is latency, not bytes (the KDA recurrence,
the MoE kernel's routing phase), asks the L2 for the weights of the kernel after it, which then reads
them from the L2 instead of waiting on HBM. Each of its programs asks for its share of the bytes.
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
def prefetch_to_l2(ptr, NBYTES: tl.constexpr, THREADS: tl.constexpr):
    """Prefetch NBYTES contiguous bytes from `ptr`, cut into one request per thread of the program's
    THREADS (a [THREADS] tensor has one element per thread, none replicated), whole 16-byte units."""
    SIZE: tl.constexpr = (NBYTES + 16 * THREADS - 1) // (16 * THREADS) * 16
    offset = tl.arange(0, THREADS) * SIZE
    nbytes = tl.minimum(tl.maximum(NBYTES - offset, 0), SIZE)
    _bulk_prefetch(ptr.to(tl.int64) + offset, nbytes.to(tl.int32))


@triton.jit
def prefetch_share_to_l2(ptr, NBYTES: tl.constexpr, share, SHARES: tl.constexpr, THREADS: tl.constexpr):
    """Prefetch share `share` of SHARES (whole 16-byte units, the last one shorter) of NBYTES contiguous
    bytes from `ptr`, one request per thread of the program's THREADS. NBYTES == 0: nothing."""
    if NBYTES > 0:
        SLICE: tl.constexpr = (NBYTES + 16 * SHARES - 1) // (16 * SHARES) * 16
        SIZE: tl.constexpr = (SLICE + 16 * THREADS - 1) // (16 * THREADS) * 16
        offset = tl.arange(0, THREADS) * SIZE
        start = share.to(tl.int64) * SLICE + offset
        nbytes = tl.minimum(tl.minimum(tl.maximum(SLICE - offset, 0), SIZE), tl.maximum(NBYTES - start, 0))
        _bulk_prefetch(ptr.to(tl.int64) + start, nbytes.to(tl.int32))


def weights_ahead(tensors: tuple[torch.Tensor, ...], most: int = 2) -> list[tuple[torch.Tensor, int]]:
    """(tensor, bytes) of the weights a kernel prefetches for the kernel after it, each checked
    (`prefetch_unavailable`); ValueError naming the problem where one cannot be prefetched."""
    if len(tensors) > most:
        raise ValueError(f"a kernel prefetches at most {most} weights ahead, got {len(tensors)}")
    regions = []
    for t in tensors:
        if not t.is_contiguous():
            raise ValueError("weights prefetched ahead must be contiguous")
        nbytes = t.numel() * t.element_size()
        if nbytes >= 2**31:
            raise ValueError(f"a weight prefetched ahead must be under 2 GiB, got {nbytes} bytes")
        if (reason := prefetch_unavailable(t, nbytes)) is not None:
            raise ValueError(f"weights cannot be prefetched ahead into the L2: {reason}")
        regions.append((t, nbytes))
    return regions


def ahead_unavailable(device: torch.device | str) -> str | None:
    """Why kernels on `device` cannot prefetch weights ahead (None: they can)."""
    device = torch.device(device)
    if interpreter_mode():
        return "Triton's CPU interpreter runs no PTX"
    if device.type != "cuda" or not torch.cuda.is_available():
        return f"the bulk L2 prefetch needs an NVIDIA GPU; the model is on '{device.type}'"
    major, minor = torch.cuda.get_device_capability(device)
    if major < 9:
        return f"the bulk L2 prefetch needs compute capability 9.0 (Hopper) or later, not {major}.{minor}"
    return None


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

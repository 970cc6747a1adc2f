"""Hand-offs inside the decode step: a kernel that starts on the rows it needs while the GEMV before it
still computes the rest (solo.kernels.cuda_step.Handoff, gemv_decode.cu SIGNAL).

The GEMV computes a consumer's rows first and every block adds 1 to a counter once its share of them is
stored and visible; the consumer's programs wait for that count (acquire) instead of for the GEMV's end
(`griddepcontrol.wait`), then let their own successor launch. The last program past the wait zeroes the
counter (and the count of programs past it) for the next hand-off; every program still waits for the
GEMV's end before it ends (under PDL), so the kernel after the consumer finds the rest (the output gate,
which the consumer does not read) written. Where the previous kernel is not a signalling GEMV, the
consumer takes the plain wait. (A consumer lets its successor launch before the GEMV has ended, so no
successor of one may read the GEMV's output before its own wait: gemv_decode.cu's LATE_WAIT is not for
the kernel after a consumer.)
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from solo.kernels.pdl import after_previous_kernel, let_next_kernel_launch, wait_for_previous_kernel


@triton.jit
def wait_for_rows(handoff_ptr, target, PROGRAMS: tl.constexpr, HANDOFF: tl.constexpr, PDL: tl.constexpr):
    """Before reading what the previous kernel wrote: with HANDOFF, until handoff_ptr[0] reaches `target`
    signals (the last of the PROGRAMS programs past it zeroes handoff_ptr[0:2]); otherwise the plain wait."""
    if HANDOFF:
        seen = tl.atomic_add(handoff_ptr, 0, sem="acquire", scope="gpu")
        while seen < target:
            seen = tl.atomic_add(handoff_ptr, 0, sem="acquire", scope="gpu")
        let_next_kernel_launch(PDL)
        passed = tl.atomic_add(handoff_ptr + 1, 1, sem="acq_rel", scope="gpu")
        if passed == PROGRAMS - 1:  # every program is past the wait: zero the counters for the next hand-off
            tl.atomic_xchg(handoff_ptr, 0, sem="relaxed", scope="gpu")
            tl.atomic_xchg(handoff_ptr + 1, 0, sem="relaxed", scope="gpu")
    else:
        after_previous_kernel(PDL)


@triton.jit
def end_after_previous(HANDOFF: tl.constexpr, PDL: tl.constexpr):
    """At a hand-off consumer's end: under PDL, wait for the GEMV's end, so this kernel ends after it."""
    if HANDOFF:
        wait_for_previous_kernel(PDL)


def check_handoff(handoff: tuple[torch.Tensor, int] | None) -> None:
    """A consumer's (counters, signals): two int32 counters (zero between hand-offs), signals >= 1."""
    if handoff is None:
        return
    counters, signals = handoff
    if counters.dtype != torch.int32 or counters.numel() < 2 or signals < 1:
        raise ValueError("a hand-off needs two zeroed int32 counters and at least one signal to wait for")

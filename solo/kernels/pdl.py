"""Programmatic dependent launch (PDL) between the fused decode step's kernels (sm_90 and later).

A batch-1 decode step is a chain of about 300 short kernels, each waiting for the one before; in a
CUDA graph every boundary still costs the next kernel's launch and ramp-up. With PDL a kernel is
launched while its predecessor runs: its programs start, block in `griddepcontrol.wait` until the
predecessor has finished and its writes are visible, then signal that their own successor may be
launched. Every fused kernel takes a `PDL` constexpr and calls `after_previous_kernel(PDL)` before
it reads or writes anything, so the data flow is that of plain stream order; only launch latency
overlaps. The MoE backends launch their own kernels (the `cuda` and `triton` ones already with PDL);
kernels launched without it (torch's) are waited for as usual.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from solo.kernels.triton_fp8 import interpreter_mode

try:  # grid dependency control, Triton >= 3.4 (as solo.kernels.triton_mxfp4_gemv uses it)
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # pragma: no cover - older Triton: pdl_unavailable says so and PDL is never set
    gdc_launch_dependents = gdc_wait = None


@triton.jit
def wait_for_previous_kernel(PDL: tl.constexpr):
    """Under PDL: wait until the previous kernel in the stream has finished and its writes are visible."""
    if PDL:
        gdc_wait()


@triton.jit
def let_next_kernel_launch(PDL: tl.constexpr):
    """Under PDL: let the next kernel in the stream launch (its programs wait in griddepcontrol.wait for
    this one's end). For kernels that learn by other means that their inputs are ready."""
    if PDL:
        gdc_launch_dependents()


@triton.jit
def after_previous_kernel(PDL: tl.constexpr):
    """Under PDL: wait until the previous kernel in the stream has finished (its writes visible), then
    let the next one launch. A no-op otherwise (and in Triton's CPU interpreter, which never sets PDL)."""
    wait_for_previous_kernel(PDL)
    let_next_kernel_launch(PDL)


def pdl_unavailable(device: torch.device | str) -> str | None:
    """Why PDL cannot run on `device`, or None when it can."""
    device = torch.device(device)
    if interpreter_mode():
        return "Triton's CPU interpreter (TRITON_INTERPRET=1) has no programmatic dependent launch"
    if gdc_wait is None:
        return f"this Triton ({triton.__version__}) has no grid dependency control; install Triton 3.4 or later"
    if device.type != "cuda" or not torch.cuda.is_available():
        return f"programmatic dependent launch needs an NVIDIA GPU; the model is on '{device.type}'"
    major, minor = torch.cuda.get_device_capability(device)
    if major < 9:
        return f"programmatic dependent launch needs compute capability 9.0 (Hopper) or later, not {major}.{minor}"
    return None


def launch_options(pdl: bool) -> dict[str, bool]:
    """Keyword arguments for a Triton launch: `launch_pdl` only when asked, so older launchers and the
    interpreter see the call they always saw."""
    return {"launch_pdl": True} if pdl else {}


class LaunchPolicy:
    """How one fused decode step launches its kernels (with PDL or not), and what its launches
    reported: the kernel's own `launch_pdl` flag per kernel family, which is how the start-up check
    proves PDL was really on (asked for is not the same as launched with). `one_token_only`: PDL for
    one-token calls (decode, NEXTN drafts) only; calls of several tokens (verification) launch plainly,
    which measured faster for them on the H200 (docs/performance.md section 0)."""

    def __init__(self, pdl: bool = False, prefetch: bool | None = None, one_token_only: bool = False) -> None:
        self.pdl = pdl
        # the router's weight prefetch into the L2 before the wait (solo.kernels.prefetch): on with PDL
        # unless set
        self.prefetch = pdl if prefetch is None else prefetch
        self.options = launch_options(pdl)
        self.one_token_only = one_token_only
        self.seen: dict[str, set[bool]] = {}
        self._several: LaunchPolicy | None = None

    def at(self, tokens: int) -> LaunchPolicy:
        """The policy for a call of `tokens` tokens (itself, or plain launches where PDL is one-token only)."""
        if not self.pdl or not self.one_token_only or tokens == 1:
            return self
        if self._several is None:
            self._several = LaunchPolicy(False, False)
        return self._several

    def record(self, family: str, compiled: object) -> None:
        """After a launch: `compiled` is what Triton's launch returned (None under the interpreter)."""
        metadata = getattr(compiled, "metadata", None)
        flag = getattr(metadata, "launch_pdl", None)
        if flag is None:  # a solo.kernels.cuda_runtime.CudaKernel: the attribute of its last launch
            flag = getattr(compiled, "last_dependent", False)
        self.seen.setdefault(family, set()).add(bool(flag))

    def families_with_pdl(self) -> dict[str, bool]:
        """family -> whether every launch of it so far that PDL applies to was a PDL launch."""
        return {family: flags == {True} for family, flags in sorted(self.seen.items())}


PLAIN = LaunchPolicy()  # kernels built outside a decode step (tests, benchmarks of one kernel)

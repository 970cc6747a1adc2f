"""Does programmatic dependent launch take effect for solo's Triton kernels (launch_pdl=True)?

    python3 dev/pdl_probe_triton.py

A primary kernel calls gdc_launch_dependents and then does a few hundred dependent atomic adds
before it raises a flag; the secondary, launched with launch_pdl=True, reads the flag *before* its
gdc_wait. If it read 0 it started while the primary still ran. Eager and inside a CUDA graph, with
and without launch_pdl (without it the secondary must always see the flag raised).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait


@triton.jit
def _primary(state_ptr, ITERS: tl.constexpr):
    gdc_launch_dependents()
    acc = 0
    for _ in range(ITERS):  # a chain of dependent round trips through L2
        acc += tl.atomic_add(state_ptr + 2, 1, sem="relaxed")
    tl.atomic_xchg(state_ptr, 1 + acc * 0, sem="release")


@triton.jit
def _secondary(state_ptr):
    seen = tl.atomic_add(state_ptr, 0, sem="acquire")  # the flag, before waiting for the primary
    tl.store(state_ptr + 1, seen)
    gdc_wait()


def main() -> None:
    state = torch.zeros(3, dtype=torch.int32, device="cuda")

    def pair(pdl: bool) -> None:
        state.zero_()
        _primary[(1,)](state, ITERS=400)
        _secondary[(1,)](state, **({"launch_pdl": True} if pdl else {}))

    for pdl in (False, True):
        pair(pdl)
        torch.cuda.synchronize()
        print(f"eager launch_pdl={pdl}: secondary saw the primary finished = {bool(state[1])}")
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            pair(pdl)
        g.replay()
        torch.cuda.synchronize()
        print(f"graph launch_pdl={pdl}: secondary saw the primary finished = {bool(state[1])}")


if __name__ == "__main__":
    main()

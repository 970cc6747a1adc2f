"""How soon a dependent kernel can start on its predecessor's results (lent Hopper GPU): griddepcontrol.wait
against a counter the predecessor's blocks bump, the question behind the decode step's fixed cost per
kernel boundary (the persistent MoE kernel's trace shows its wait returning 1.3-1.7 us after the
previous grid's last block ended).

    python3 dev/handoff_probe.py [--blocks 132] [--spin-us 5] [--poll-ns 0,64] [--pairs 16]

`--pairs` primary / secondary pairs in one CUDA graph, each secondary launched with programmatic
dependent launch (so it is resident while its primary runs): the wait hand-off (griddepcontrol.wait)
and the flag hand-off (acquire-polling a counter that every primary block bumps after a fence; one
counter per pair, zeroed at the graph's start). Printed per hand-off, over the pairs of the last replay:
the latency from the primary's last block end to the secondary's blocks starting their work (min,
median, max over blocks, median over pairs), whether every secondary saw its primary's stores, and
the graph's time per pair. Lab code (dev/handoff_probe.cu); nothing in solo uses a flag hand-off.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from solo.bench.decode import time_graph  # noqa: E402
from solo.kernels.cuda_runtime import CudaKernel  # noqa: E402

SOURCE = Path(__file__).with_name("handoff_probe.cu")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--blocks", type=int, default=132)
    p.add_argument("--spin-us", type=float, default=5.0)
    p.add_argument("--poll-ns", default="0,64")
    p.add_argument("--pairs", type=int, default=16)
    args = p.parse_args()
    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9:
        raise SystemExit("handoff_probe needs a Hopper (sm_90) or later GPU")
    device = torch.device("cuda")
    blocks, pairs = args.blocks, args.pairs
    spin = {"SPIN_NS": int(args.spin_us * 1000), "POLL_NS": 0}
    primary = CudaKernel(SOURCE, "primary", spin, device)
    waiter = CudaKernel(SOURCE, "wait_secondary", spin, device)
    flaggers = {
        int(n): CudaKernel(SOURCE, "flag_secondary", {**spin, "POLL_NS": int(n)}, device)
        for n in args.poll_ns.split(",")
    }

    def buffers():
        return (
            torch.zeros(pairs, blocks, dtype=torch.int64, device=device),  # primary end
            torch.zeros(pairs, blocks, dtype=torch.int64, device=device),  # secondary start
            torch.zeros(pairs, dtype=torch.int32, device=device),  # arrivals per pair
            torch.zeros(pairs, blocks, dtype=torch.int32, device=device),  # payload
            torch.zeros(pairs, blocks, dtype=torch.int32, device=device),  # what the secondary saw
        )

    def chain(kind: str, poll_ns: int, bufs) -> None:
        end, start, arrived, payload, seen = bufs
        arrived.zero_()
        payload.zero_()
        for i in range(pairs):
            primary.launch(blocks, 128, [end[i], arrived[i : i + 1], payload[i]], dependent=True)
            if kind == "wait":
                waiter.launch(blocks, 128, [start[i], payload[i], seen[i]], dependent=True)
            else:
                flag = flaggers[poll_ns]
                flag.launch(blocks, 128, [start[i], payload[i], seen[i], arrived[i : i + 1], blocks], dependent=True)

    variants = [("wait", 0)] + [("flag", n) for n in flaggers]
    for kind, poll_ns in variants:
        bufs = buffers()
        chain(kind, poll_ns, bufs)  # eager once (compiles nothing: the kernels are loaded)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            chain(kind, poll_ns, bufs)
        per_pair_us = time_graph(graph, replays=20, rounds=3) * 1e6 / pairs
        graph.replay()
        torch.cuda.synchronize()
        end, start, _, payload, seen = bufs
        lat = (start - end.max(dim=1, keepdim=True).values).double() / 1e3  # us after the primary's last block
        mins, meds, maxs = (lat.min(1).values, lat.median(1).values, lat.max(1).values)
        ok = bool(torch.equal(seen, payload))
        name = "griddepcontrol.wait" if kind == "wait" else f"flag (poll back-off {poll_ns} ns)"
        print(
            f"{name:34s}: start after the primary's last block min {statistics.median(mins.tolist()):6.2f} "
            f"median {statistics.median(meds.tolist()):6.2f} max {statistics.median(maxs.tolist()):6.2f} us; "
            f"saw the stores {ok}; {per_pair_us:.2f} us per pair in the graph",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())

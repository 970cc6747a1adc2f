"""Where one token's shared expert runs, A/B inside the whole decode step at full shape, in one process
(lent GPU).

    python3 dev/shared_order_ab.py [--context 32768] [--variants 'after;inside'] [--json OUT]

With the router inside the persistent MoE kernel, the layer's MoE part is that kernel, then the shared
expert's gate_up (from the normalised x the kernel returns) and its down (+ routed + residual). The MoE
kernel fills every SM (shared memory and registers), so the kernel after it cannot become resident
early under PDL and stream its first weights while it ends. Variants, each captured once and timed
interleaved (same load, same clocks):
  after          the product: MoE kernel -> shared gate_up -> shared down
  inside         the shared expert inside the MoE kernel (--moe-shared fused)
A third order, the shared gate_up (its own RMSNorm of x) before the MoE kernel so that it could overlap
the attention's output projection, measured 2.619 ms against 2.507 (after) and 2.772 (inside) at 32K
(docs/results/h200_shared_order_ab.log) and was removed from the product.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from verify_kernels_ab import load_full_shape  # noqa: E402

from solo.bench.decode import copy_bandwidth, time_graph  # noqa: E402
from solo.engine.graphs import EagerStep, GraphCapture  # noqa: E402
from solo.model.cache import HybridCache  # noqa: E402

VARIANTS = ("after", "inside")


def configure(moes: list, variant: str) -> None:
    for moe in moes:
        moe.shared_in_experts = moe.shared_expert() if variant == "inside" else None


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--context", type=int, default=32768)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--variants", default=";".join(VARIANTS), help="names separated by ';'")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    model, times = load_full_shape("fused+cuda+pdl", 4)
    step = model.decode_step
    device = model.device
    moes = step.routers_in_experts()
    print(f"loaded in {times}; {len(moes)} MoE layers with the router inside", flush=True)
    cache = HybridCache(model.config, args.context + 16, device, model.dtype, with_nextn=True)
    ids1 = torch.randint(0, model.config.vocab_size, (1,), device=device)
    pos1 = torch.full((1,), args.context - 2, device=device)
    eager = EagerStep(model)
    graphs = GraphCapture()
    captured, outputs = {}, {}
    for name in (v.strip() for v in args.variants.split(";")):
        configure(moes, name)
        graph, out = graphs.capture(lambda: eager(ids1, pos1, cache))
        captured[name] = graph
        outputs[name] = out
        print(f"{name}: captured", flush=True)
    decode: dict[str, list[float]] = {name: [] for name in captured}
    for _ in range(args.rounds):
        for name, graph in captured.items():
            decode[name].append(time_graph(graph, replays=50, rounds=1) * 1e3)
    report = {
        "copy_gbs": copy_bandwidth(device) / 1e9,
        "context": args.context,
        "decode_ms": {n: statistics.median(v) for n, v in decode.items()},
        "all": decode,
    }
    for name in captured:
        print(f"@ {args.context}: {name:14s} decode {report['decode_ms'][name]:.3f} ms", flush=True)
    configure(moes, "after")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

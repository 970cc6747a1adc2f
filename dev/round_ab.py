"""The NEXTN round's pieces outside the forward passes, A/B inside the whole round at full shape, in one
process (lent GPU).

    python3 dev/round_ab.py [--contexts 4096,32768] [--rounds 5] [--json OUT.json]

Loads the full Ling-3.0-flash shape with random weights as `solo bench decode --random-weights` does
(MoE cuda, FP8 head, the fused step with CUDA kernels and PDL), captures the round once per variant and
times the graphs interleaved at each context (positions are read on the device):
  - greedy: the product's greedy round (argmax acceptance and drafts, the KDA states of every layer
    rolled back in two gathers);
  - greedy, per-layer rollback: the same with the history as a plain dict, so the cache rolls each
    layer back with its own copies (the step before);
  - sampled: the round at the seed's GSM8K sampling (t 0.6, top-p 0.95, top-k 29), the product's
    top-p cut over the top-k list;
  - sampled, top-p by sort: the same with the vocabulary sorted for the top-p cut (the step before).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from solo.bench.decode import GSM8K_SAMPLING, Config, add_arguments, copy_bandwidth, load, time_graph  # noqa: E402
from solo.engine import sampling  # noqa: E402
from solo.engine.graphs import GraphCapture  # noqa: E402
from solo.engine.sampling import SamplingParams  # noqa: E402
from solo.model.cache import HybridCache  # noqa: E402
from solo.speculative.nextn import NextNDecoder, SpeculativeConfig  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--contexts", default="4096,32768")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    bench = argparse.ArgumentParser()
    add_arguments(bench)
    model, times = load(
        bench.parse_args(["--random-weights", "ling-3.0-flash"]), Config("cuda", "fp8", "fused+cuda+pdl")
    )
    device = model.device
    print(f"loaded in {times}", flush=True)
    contexts = [int(c) for c in args.contexts.split(",")]
    cache = HybridCache(model.config, max(contexts) + 32, device, model.dtype, with_nextn=True)
    spec = NextNDecoder(model, SpeculativeConfig())
    state = spec.state_for(cache)
    state.drafts.random_(0, model.config.vocab_size)
    start = torch.zeros(1, dtype=torch.long, device=device)
    packed = spec.history_for(cache)
    plain = dict(packed)  # the same tensors, but not a KDAHistories: rolled back layer by layer
    generator = torch.Generator(device=device)
    generator.manual_seed(int(torch.randint(0, 2**31 - 1, ())))
    greedy, sampled = SamplingParams(), SamplingParams(**GSM8K_SAMPLING)
    variants = {  # name: (params, history, top-k bound of the walk)
        "greedy": (greedy, packed, sampling.TOP_K_WITHOUT_SORT),
        "greedy, per-layer rollback": (greedy, plain, sampling.TOP_K_WITHOUT_SORT),
        "sampled": (sampled, packed, sampling.TOP_K_WITHOUT_SORT),
        "sampled, top-p by sort": (sampled, packed, 0),
    }
    graphs = GraphCapture()
    captured = {}
    for name, (params, history, walk) in variants.items():
        sampling.TOP_K_WITHOUT_SORT = walk  # read when the round is recorded
        spec._history = (id(cache), history)

        def one_round(params=params) -> None:  # every replay starts at the same position
            state.position.copy_(start)
            spec.round(state, cache, params, None if params.greedy else generator)

        captured[name], _ = graphs.capture(one_round, None if params.greedy else generator)
    report = {"copy_gbs": copy_bandwidth(device) / 1e9, "contexts": {}}
    for context in contexts:
        start.fill_(context - 5)
        times_ms: dict[str, list[float]] = {name: [] for name in variants}
        for _ in range(args.rounds):
            for name, graph in captured.items():
                times_ms[name].append(time_graph(graph, replays=30, rounds=1) * 1e3)
        medians = {name: statistics.median(v) for name, v in times_ms.items()}
        report["contexts"][str(context)] = {"round_ms": medians, "all_ms": times_ms}
        for name, v in medians.items():
            each = ", ".join(f"{x:.3f}" for x in times_ms[name])
            print(f"round @ {context}: {name:28s} {v:.3f} ms  ({each})", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

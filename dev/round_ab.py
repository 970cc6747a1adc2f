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
  - sampled, eager distribution: the round at the seed's GSM8K sampling (t 0.6, top-p 0.95, top-k 29)
    with `sampling.probabilities` run eagerly (softmax from the top-k values as elementwise ops, the
    top-p cut over the top-k list, ties ranked by two short scans);
  - sampled, row-wise softmax and scan: torch's softmax over the vocabulary and one scan along each row
    for the ties (this session's first top-k walk, `probabilities_row_kernels` below);
  - sampled, top-p by sort: torch's softmax and the vocabulary sorted for the top-p cut (the session's
    start, `probabilities_by_sort` below);
  - sampled (the product): the distribution through `torch.compile` (`sampling.CompiledDistribution`:
    Inductor fuses its ops over the vocabulary into a few Triton kernels; compiled in the warm-up runs,
    before the capture), and the same with the acceptance (`accept_drafts`) compiled too: the sampled
    round runs about 300 kernels more than the greedy one, most of them these ops.
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
from solo.speculative import nextn  # noqa: E402
from solo.speculative.nextn import NextNDecoder, SpeculativeConfig  # noqa: E402


def probabilities_by_sort(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """solo.engine.sampling.probabilities at the session's start (3905ef4)."""
    logits = logits.float() / params.temperature
    kth = logits.topk(params.top_k, dim=-1).values[..., -1:]
    probs = torch.softmax(logits.masked_fill(logits < kth, float("-inf")), dim=-1)
    return renormalised(probs, sampling.top_p_drop_by_sort(probs, params.top_p))


def probabilities_row_kernels(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The first top-k walk (362f4de): torch's softmax, and the ties' ranks by one scan per row."""
    logits = logits.float() / params.temperature
    values, top = logits.topk(params.top_k, dim=-1)
    probs = torch.softmax(logits.masked_fill(logits < values[..., -1:], float("-inf")), dim=-1)
    ranked = probs.gather(-1, top)
    drop = torch.zeros_like(probs, dtype=torch.bool).scatter_(-1, top, ranked.cumsum(-1) - ranked >= params.top_p)
    extra = logits == values[..., -1:]
    extra.scatter_(-1, top, False)
    mass_before = ranked.sum(-1, keepdim=True) + (extra.long().cumsum(-1) - 1) * ranked[..., -1:]
    return renormalised(probs, drop | (extra & (mass_before >= params.top_p)))


def renormalised(probs: torch.Tensor, drop: torch.Tensor) -> torch.Tensor:
    probs = probs.masked_fill(drop, 0.0)
    return probs / probs.sum(-1, keepdim=True)


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
    eager, product = sampling.probabilities, spec.distribution  # the product's: compiled on the GPU
    accept, compiled_accept = nextn.accept_drafts, torch.compile(nextn.accept_drafts, dynamic=False)
    variants = {  # name: (params, history, the distribution function the round uses, its acceptance)
        "greedy": (greedy, packed, product, accept),
        "greedy, per-layer rollback": (greedy, plain, product, accept),
        "sampled, eager distribution": (sampled, packed, eager, accept),
        "sampled, row-wise softmax and scan": (sampled, packed, probabilities_row_kernels, accept),
        "sampled, top-p by sort": (sampled, packed, probabilities_by_sort, accept),
        "sampled (the product: compiled distribution)": (sampled, packed, product, accept),
        "sampled, compiled distribution and acceptance": (sampled, packed, product, compiled_accept),
    }
    graphs = GraphCapture()
    captured = {}
    for name, (params, history, distribution, acceptance) in variants.items():
        spec.distribution = distribution  # read when the round is recorded
        nextn.accept_drafts = acceptance
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
            print(f"round @ {context}: {name:36s} {v:.3f} ms  ({each})", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Verification (NEXTN window) kernels A/B inside the whole step at full shape, in one process (lent GPU).

    python3 dev/verify_kernels_ab.py [--context 4096] [--tokens 4] [--json OUT.json]

Loads the full Ling-3.0-flash shape with random weights (as `solo bench decode --random-weights`),
the fused step on the CUDA step kernels with PDL for every call, then captures the verification step
(T tokens, KDA history) once per variant and times the graphs interleaved (A B C A B C ...), so the
variants share one load, one clock history and one L2 state:
  - cuda: projections and routers of T tokens on the CUDA kernels (the product's default);
  - triton routers: routers of T tokens back on the Triton kernels (GEMVs stay CUDA);
  - triton: all of them on Triton (the step before the CUDA kernels took T > 1).
Variants flip each kernel object's `max_tokens`; nothing else changes between captures.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from solo.bench.decode import Config, add_arguments, copy_bandwidth, load, time_graph  # noqa: E402
from solo.engine.graphs import EagerStep, GraphCapture  # noqa: E402
from solo.kernels.cuda_step import CudaGemv, CudaRouter  # noqa: E402
from solo.model.cache import HybridCache  # noqa: E402


def load_full_shape(step: str, verify_tokens: int):
    """(model, load times) of `solo bench decode --random-weights ling-3.0-flash` (the bench's own
    defaults and loader), MoE cuda, FP8 head, the fused step with modifiers `step`."""
    p = argparse.ArgumentParser()
    add_arguments(p)
    args = p.parse_args(["--random-weights", "ling-3.0-flash", "--verify-tokens", str(verify_tokens)])
    return load(args, Config("cuda", "fp8", step))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--context", type=int, default=4096)
    p.add_argument("--tokens", type=int, default=4)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    model, times = load_full_shape("fused+cuda+pdlall", args.tokens)
    step = model.decode_step
    device = model.device
    kernels = [getattr(o, a) for o, a in step._slots()]
    gemvs = [k for k in kernels if isinstance(k, CudaGemv)]
    routers = [k for k in kernels if isinstance(k, CudaRouter)]
    print(f"loaded in {times}; {len(gemvs)} CUDA GEMVs, {len(routers)} CUDA routers", flush=True)
    cache = HybridCache(model.config, args.context + 16, device, model.dtype, with_nextn=True)
    history = cache.new_history(args.tokens)
    ids = torch.randint(0, model.config.vocab_size, (args.tokens,), device=device)
    pos = torch.arange(args.context - args.tokens - 1, args.context - 1, device=device)
    eager = EagerStep(model)
    graphs = GraphCapture()
    variants = {"cuda": (8, 8), "triton routers": (8, 1), "triton": (1, 1)}
    captured = {}
    for name, (gemv_tokens, router_tokens) in variants.items():
        for k in gemvs:
            k.max_tokens = gemv_tokens
        for k in routers:
            k.max_tokens = router_tokens
        captured[name], _ = graphs.capture(lambda: eager(ids, pos, cache, history))
    times_ms: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(args.rounds):
        for name, graph in captured.items():
            times_ms[name].append(time_graph(graph, replays=30, rounds=1) * 1e3)
    report = {
        "copy_gbs": copy_bandwidth(device) / 1e9,
        "tokens": args.tokens,
        "context": args.context,
        "verify_ms": {name: statistics.median(v) for name, v in times_ms.items()},
        "all_ms": times_ms,
    }
    for name, v in report["verify_ms"].items():
        each = ", ".join(f"{x:.3f}" for x in times_ms[name])
        print(f"verify T={args.tokens} @ {args.context}: {name:16s} {v:.3f} ms  ({each})")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

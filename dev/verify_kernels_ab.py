"""Verification (NEXTN window) kernels A/B inside the whole step at full shape, in one process (lent GPU).

    python3 dev/verify_kernels_ab.py [--contexts 4096,32768] [--tokens 4] [--json OUT.json]

Loads the full Ling-3.0-flash shape with random weights (as `solo bench decode --random-weights`),
the fused step as the product runs it (CUDA step kernels, PDL), then captures the verification step
(T tokens, KDA history) once per variant and times the graphs interleaved (A B C A B C ...), so the
variants share one load, one clock history and one L2 state:
  - product: the defaults (projections and routers of T tokens on the CUDA kernels, one MLA combine
    program per token, fused_kda.WINDOW_VALUE_SPLITS programs per KDA head);
  - triton routers: routers of T tokens back on the Triton kernels (GEMVs stay CUDA);
  - triton: projections and routers on Triton (the step before the CUDA kernels took T > 1);
  - mla combine loop: one MLA combine program for all T tokens in turn (the step before);
  - mla rows adjacent: the MLA attention's grid with or without a split's row programs side by side;
  - mla combine N rows: N value rows per MLA combine program (--combine-v-per);
  - kda N splits: N programs per KDA head (--kda-splits).
Variants flip each kernel object's `max_tokens` or a launch setting the kernels read at call time;
nothing else changes between captures.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from dataclasses import replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from solo.bench.decode import Config, add_arguments, copy_bandwidth, load, time_graph  # noqa: E402
from solo.engine.graphs import EagerStep, GraphCapture  # noqa: E402
from solo.kernels import fused_kda  # noqa: E402
from solo.kernels.cuda_step import CudaGemv, CudaRouter  # noqa: E402
from solo.kernels.fused_mla import FusedMLA  # noqa: E402
from solo.model.cache import HybridCache  # noqa: E402


def load_full_shape(step: str, verify_tokens: int, num_experts: int | None = None):
    """(model, load times) of `solo bench decode --random-weights ling-3.0-flash` (the bench's own
    defaults and loader), MoE cuda, FP8 head, the fused step with modifiers `step`. `num_experts`: fewer
    experts (the same 8 a token, the same bytes a step but for the router's rows), so that the shape fits
    on an 80 GB H100."""
    p = argparse.ArgumentParser()
    add_arguments(p)
    argv = ["--random-weights", "ling-3.0-flash", "--verify-tokens", str(verify_tokens)]
    args = p.parse_args(argv + (["--num-experts", str(num_experts)] if num_experts else []))
    return load(args, Config("cuda", "fp8", step))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--contexts", default="4096,32768", help="the graphs are captured once, timed at each")
    p.add_argument("--tokens", type=int, default=4)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--json", default=None)
    p.add_argument("--kda-splits", default="8", help="comma list of KDA programs per head to try (0: none)")
    p.add_argument("--combine-v-per", default="64", help="comma list of MLA combine value rows to try (0: none)")
    args = p.parse_args()
    model, times = load_full_shape("fused+cuda+pdl", args.tokens)  # the product's step
    step = model.decode_step
    device = model.device
    kernels = [getattr(o, a) for o, a in step._slots()]
    gemvs = [k for k in kernels if isinstance(k, CudaGemv)]
    routers = [k for k in kernels if isinstance(k, CudaRouter)]
    print(f"loaded in {times}; {len(gemvs)} CUDA GEMVs, {len(routers)} CUDA routers", flush=True)
    contexts = [int(c) for c in args.contexts.split(",")]
    cache = HybridCache(model.config, max(contexts) + 16, device, model.dtype, with_nextn=True)
    history = cache.new_history(args.tokens)
    ids = torch.randint(0, model.config.vocab_size, (args.tokens,), device=device)
    pos = torch.zeros(args.tokens, dtype=torch.long, device=device)  # read on the device: set per context
    eager = EagerStep(model)
    graphs = GraphCapture()
    product = {
        "gemv_tokens": 8,
        "router_tokens": 8,
        "combine_token_programs": FusedMLA.WINDOW.combine_token_programs,
        "kda_splits": fused_kda.WINDOW_VALUE_SPLITS,
        "attend_rows_adjacent": FusedMLA.WINDOW.rows_adjacent,
        "combine_v_per": FusedMLA.WINDOW.v_per_program,
    }
    variants = {
        "product": {},
        "triton routers": {"router_tokens": 1},
        "triton": {"gemv_tokens": 1, "router_tokens": 1},
        "mla combine loop": {"combine_token_programs": False},
        "mla rows adjacent": {"attend_rows_adjacent": not product["attend_rows_adjacent"]},
    }
    for n in (int(v) for v in args.combine_v_per.split(",") if int(v) and int(v) != product["combine_v_per"]):
        variants[f"mla combine {n} rows"] = {"combine_v_per": n}
    for n in (int(v) for v in args.kda_splits.split(",") if int(v) and int(v) != product["kda_splits"]):
        variants[f"kda {n} splits"] = {"kda_splits": n}
    captured, logits = {}, {}
    for name, changes in variants.items():
        v = {**product, **changes}
        for k in gemvs:
            k.max_tokens = v["gemv_tokens"]
        for k in routers:
            k.max_tokens = v["router_tokens"]
        FusedMLA.WINDOW = replace(
            FusedMLA.WINDOW,
            combine_token_programs=v["combine_token_programs"],
            rows_adjacent=v["attend_rows_adjacent"],
            v_per_program=v["combine_v_per"],
        )
        fused_kda.WINDOW_VALUE_SPLITS = v["kda_splits"]
        captured[name], logits[name] = graphs.capture(lambda: eager(ids, pos, cache, history)[1])
    report = {"copy_gbs": copy_bandwidth(device) / 1e9, "tokens": args.tokens, "contexts": {}}
    for context in contexts:
        pos.copy_(torch.arange(context - args.tokens - 1, context - 1, device=device))
        agree = {}
        for name, graph in captured.items():  # the same verification, up to fp32 summation order
            cache.reset()
            graph.replay()
            torch.cuda.synchronize()
            if name == "product":
                want = logits[name].clone()
            else:
                got = logits[name]
                agree[name] = {
                    "same_argmax": bool(torch.equal(got.argmax(-1), want.argmax(-1))),
                    "max_abs_diff": float((got - want).abs().max()),
                }
            print(f"@ {context} {name}: {agree.get(name, 'reference')}", flush=True)
        times_ms: dict[str, list[float]] = {name: [] for name in variants}
        for _ in range(args.rounds):
            for name, graph in captured.items():
                times_ms[name].append(time_graph(graph, replays=30, rounds=1) * 1e3)
        report["contexts"][str(context)] = {
            "verify_ms": {name: statistics.median(v) for name, v in times_ms.items()},
            "against_product": agree,
            "all_ms": times_ms,
        }
        for name, v in report["contexts"][str(context)]["verify_ms"].items():
            each = ", ".join(f"{x:.3f}" for x in times_ms[name])
            print(f"verify T={args.tokens} @ {context}: {name:20s} {v:.3f} ms  ({each})", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

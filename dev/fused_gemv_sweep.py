"""Which launch configuration of the decode step's fused GEMV streams each full-shape projection
fastest (lent H200).

    python3 dev/fused_gemv_sweep.py [--tokens 1,4] [--shapes qkvfgb,o_proj,...] [--jobs 12]
                                    [--budget-s 300] [--json OUT.json]

For every projection of Ling-3.0-flash's decode step (the fused row layouts `FusedDecodeStep`
builds: KDA q|k|v|f|g|b, o_proj with the gated norm, MLA q|kv_a|g, the shared and dense SwiGLU
pairs, the LM head with row scales) and every token count, each configuration of a grid
(rows per program, K chunk, split K, warps, stages) is compiled first in `--jobs` worker
processes (into Triton's cache, so the timing process only loads them), then timed in one process:
a CUDA graph of C calls that cycle through C copies of the weights (C copies >= 400 MB, so no call
finds its weight in the 60 MB L2), median of 5 rounds of 20 replays. Each configuration's output
is compared with the default configuration's (split K changes only the summation order). Printed
per shape: the best configurations, their time, GB/s and fraction of the device-to-device copy
bandwidth measured in the same run, and the configuration the product picks today (tuned table or rule) for comparison.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import multiprocessing as mp
import os
import sys
import time
from dataclasses import asdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from solo.bench.decode import copy_bandwidth, time_graph  # noqa: E402
from solo.kernels.fused_gemv import FusedGemv, GemvConfig, tuned_key  # noqa: E402

H, E_INT, D_INT, HEADS, HD = 2560, 768, 6144, 32, 128
# name: (rows N, K, how it is called, calls per decode step)
SHAPES = {
    "qkvfgb": (5 * HEADS * HD + 32, H, "rms", 35),
    "o_proj": (H, HEADS * HD, "gated_residual", 35),
    "mla_proj": (6784 + 32, H, "rms", 7),
    "mla_dense": (H, HEADS * HD, "residual", 7),
    "shared_gate_up": (2 * E_INT, H, "swiglu", 40),
    "shared_down": (H, E_INT, "residual_add", 40),
    "dense_gate_up": (2 * D_INT, H, "swiglu_rms", 2),
    "dense_down": (H, D_INT, "residual", 2),
    "lm_head": (157184, H, "row", 1),
    "eh_proj": (H, 2 * H, "store", 1),
}


def grid(tokens: int, rows: int, k: int, kind: str) -> list[GemvConfig]:
    out = []
    block_ks = (128, 256, 512) if tokens == 1 else (32, 64, 128)
    if kind == "gated_residual":
        block_ks = (HD,)  # one K chunk per norm group
    for bn in (16, 32, 64):
        for bk in block_ks:
            for warps in (4, 8):
                threads = 32 * warps
                acc = max(tokens, 1) * bn * bk * (2 if kind.startswith("swiglu") else 1)
                if not 8 <= acc // threads <= 128:
                    continue
                chunks = math.ceil(k / bk)
                programs = math.ceil((rows // 2 if kind.startswith("swiglu") else rows) / bn)
                for split in (1, 2, 4, 8, 16):
                    if split > max(1, chunks // 2) or not 66 <= programs * split <= 4096:
                        continue
                    out.append(GemvConfig(block_n=bn, block_k=bk, split_k=split, num_warps=warps, num_stages=3))
    if tokens > 1 and kind != "row_bf16":  # the tensor-core path: weights as the left operand
        for bn in (32, 64, 128):
            for bk in (32, 64, 128) if kind != "gated_residual" else (HD,):
                for warps in (4, 8):
                    chunks = math.ceil(k / bk)
                    programs = math.ceil((rows // 2 if kind.startswith("swiglu") else rows) / bn)
                    for split in (1, 2, 4, 8, 16):
                        if split > max(1, chunks // 2) or not 66 <= programs * split <= 4096:
                            continue
                        for stages in (2, 4):
                            out.append(GemvConfig(bn, bk, split, warps, stages, dot=True))
    return out


def table_key(gemv: FusedGemv, tokens: int, kind: str) -> str:
    call = "swiglu" if gemv.half else "gated" if kind == "gated_residual" else "plain"
    return tuned_key(gemv.rows, gemv.k, tokens, call)


def make(name: str, copies: int, device: torch.device, seed: int = 0):
    """C GEMVs of one shape (fresh random FP8 weights and scales) and their inputs."""
    rows, k, kind, _ = SHAPES[name]
    g = torch.Generator(device=device).manual_seed(seed)
    gemvs = []
    for _ in range(copies):
        w = (torch.randn(rows, k, device=device, generator=g) * 0.5).to(torch.float8_e4m3fn)
        if kind == "row":
            s = torch.rand(rows, device=device, generator=g) * 1e-2 + 1e-3
            gemvs.append(FusedGemv(w, s, "row", name=name))
        else:
            exps = torch.randint(-9, -5, (math.ceil(rows / 128), math.ceil(k / 128)), device=device, generator=g)
            s = torch.pow(2.0, exps.float())
            half = rows // 2 if kind.startswith("swiglu") else None
            gemvs.append(FusedGemv(w, s, "block", swiglu_half=half, swiglu_limit=7.0 if half else None, name=name))
    return gemvs


def call_kwargs(name: str, tokens: int, device: torch.device) -> dict:
    rows, k, kind, _ = SHAPES[name]
    g = torch.Generator(device=device).manual_seed(1)
    x = torch.randn(tokens, k, device=device, generator=g).to(torch.bfloat16)
    kw: dict = {"x": x}
    if kind in ("rms", "swiglu_rms"):
        kw["norm_weight"] = (1 + 0.1 * torch.randn(k, device=device, generator=g)).to(torch.bfloat16)
    if kind == "gated_residual":
        kw["norm_weight"] = (1 + 0.1 * torch.randn(HD, device=device, generator=g)).to(torch.bfloat16)
        kw["gate"] = torch.randn(tokens, k, device=device, generator=g).to(torch.bfloat16)
    if kind.startswith("residual") or kind == "gated_residual":
        kw["residual"] = torch.randn(tokens, rows, device=device, generator=g).to(torch.bfloat16)
    if kind == "residual_add":
        kw["addend"] = torch.randn(tokens, rows, device=device, generator=g).to(torch.bfloat16)
    return kw


def run_once(gemv: FusedGemv, kw: dict, out: torch.Tensor) -> torch.Tensor:
    """One call; a residual epilogue writes to `out`, not in place, so every call sees the same input."""
    args = dict(kw)
    x = args.pop("x")
    return gemv(x, out=out, **args)


def compile_worker(jobs: list[tuple[str, int, dict]]) -> int:
    device = torch.device("cuda")
    done = 0
    made: dict[str, FusedGemv] = {}
    for name, tokens, cfg in jobs:
        if name not in made:
            made[name] = make(name, 1, device)[0]
        gemv = made[name]
        gemv.set_config(tokens, GemvConfig(**cfg))
        kw = call_kwargs(name, tokens, device)
        out = torch.empty((tokens, gemv.rows), dtype=torch.bfloat16, device=device)
        try:
            run_once(gemv, kw, out)
            torch.cuda.synchronize()
            done += 1
        except Exception as exc:  # a configuration the compiler refuses (e.g. out of shared memory)
            print(f"compile failed {name} T={tokens} {cfg}: {type(exc).__name__}: {str(exc)[:120]}", flush=True)
    return done


def time_config(gemvs: list[FusedGemv], tokens: int, cfg: GemvConfig, kw: dict) -> tuple[float, torch.Tensor]:
    for g in gemvs:
        g.set_config(tokens, cfg)
    outs = [torch.empty((tokens, g.rows), dtype=torch.bfloat16, device=kw["x"].device) for g in gemvs]
    for g, o in zip(gemvs, outs, strict=True):
        run_once(g, kw, o)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for g, o in zip(gemvs, outs, strict=True):
            run_once(g, kw, o)
    seconds = time_graph(graph, replays=20, rounds=5) / len(gemvs)
    del graph
    return seconds, outs[0].clone()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", default="1,4")
    p.add_argument("--shapes", default=",".join(SHAPES))
    p.add_argument("--jobs", type=int, default=12)
    p.add_argument("--budget-s", type=float, default=300.0, help="stop timing new configurations after this")
    p.add_argument("--json", default=None)
    p.add_argument("--table", default=None, help="write the best configuration per shape here (tuned table)")
    args = p.parse_args()
    device = torch.device("cuda")
    token_counts = [int(t) for t in args.tokens.split(",")]
    names = args.shapes.split(",")
    plan = []
    for name in names:
        rows, k, kind, _ = SHAPES[name]
        for t in token_counts:
            for cfg in grid(t, rows, k, kind):
                plan.append((name, t, asdict(cfg)))
    t0 = time.time()
    ctx = mp.get_context("spawn")
    chunks = [plan[i :: args.jobs] for i in range(args.jobs)]
    with ctx.Pool(args.jobs) as pool:
        compiled = sum(pool.map(compile_worker, chunks))
    print(f"compiled {compiled}/{len(plan)} configurations in {time.time() - t0:.0f} s", flush=True)

    copy_gbs = copy_bandwidth(device) / 1e9
    print(f"device-to-device copy bandwidth: {copy_gbs:.0f} GB/s", flush=True)
    results: dict = {"copy_gbs": copy_gbs, "device": torch.cuda.get_device_name(), "shapes": {}}
    table: dict = {}
    start = time.time()
    step_now = step_best = 0.0
    for name in names:
        rows, k, kind, per_step = SHAPES[name]
        probe = make(name, 1, device)[0]
        nbytes = probe.nbytes()
        copies = max(2, min(40, math.ceil(400e6 / nbytes)))
        gemvs = make(name, copies, device)
        for t in token_counts:
            kw = call_kwargs(name, t, device)
            default = gemvs[0].config(t, gated=kind == "gated_residual")
            if kind == "gated_residual":
                default = dataclasses.replace(default, block_k=HD)
            base_s, base_out = time_config(gemvs, t, default, kw)
            rows_out = [{"config": asdict(default), "us": base_s * 1e6, "default": True}]
            for cfg in grid(t, rows, k, kind):
                if time.time() - start > args.budget_s:
                    break
                if cfg == default:
                    continue
                try:
                    s, out = time_config(gemvs, t, cfg, kw)
                except Exception as exc:
                    print(f"  skip {cfg}: {type(exc).__name__}", flush=True)
                    continue
                ref = base_out.float()
                err = ((out.float() - ref).abs().max() / ref.abs().max().clamp_min(1e-6)).item()
                rows_out.append({"config": asdict(cfg), "us": s * 1e6, "rel_err_vs_default": err})
            for r in rows_out:
                r["gbs"] = nbytes / (r["us"] * 1e-6) / 1e9
                r["of_copy"] = r["gbs"] / copy_gbs
            rows_out.sort(key=lambda r: r["us"])
            results["shapes"][f"{name}/T{t}"] = {
                "rows": rows,
                "k": k,
                "bytes": nbytes,
                "per_step": per_step,
                "runs": rows_out,
            }
            best = rows_out[0]
            print(
                f"{name:15s} T={t} N={rows} K={k} {nbytes / 1e6:.1f} MB x{per_step}: default {base_s * 1e6:.2f} us "
                f"({nbytes / base_s / 1e9:.0f} GB/s, {nbytes / base_s / 1e9 / copy_gbs:.0%}); best {best['us']:.2f} us "
                f"({best['gbs']:.0f} GB/s, {best['of_copy']:.0%}) {best['config']}",
                flush=True,
            )
            table[table_key(gemvs[0], t, kind)] = best["config"]
            for r in rows_out[1:4]:
                print(f"    {r['us']:.2f} us {r['of_copy']:.0%} {r['config']} err {r.get('rel_err_vs_default', 0):.1e}")
            if t == 1:
                step_now += base_s * per_step
                step_best += best["us"] * 1e-6 * per_step
        del gemvs
        torch.cuda.empty_cache()
    print(f"one-token GEMVs per decode step: default {step_now * 1e3:.3f} ms, best {step_best * 1e3:.3f} ms")
    results["step_ms"] = {"default": step_now * 1e3, "best": step_best * 1e3}
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    if args.table:  # the product's tuned table (solo/kernels/tuned/): the best configuration of each shape
        meta = {"device": results["device"], "copy_gbs": round(copy_gbs), "command": " ".join(sys.argv)}
        Path(args.table).write_text(json.dumps({"measured": meta, "configs": table}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    raise SystemExit(main())

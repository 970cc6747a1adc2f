"""The CUDA step kernels (solo/kernels/cuda_step.py) against the Triton ones, shape by shape (lent GPU).

    python3 dev/step_kernels_probe.py [--shapes qkvfgb,o_proj,...] [--json OUT.json] [--quick] [--bulk]
    python3 dev/step_kernels_probe.py --steady qkvfgb,o_proj [--scales 1,2,4,8]

1. Every one-token projection of Ling-3.0-flash's decode step (dev/fused_gemv_sweep.py's shapes and
   call kinds): the CUDA GEMV's output against the Triton FusedGemv's (relative error; the two sum
   in different orders), then each timed as a CUDA graph of calls cycling through copies of the
   weights (>= 400 MB, over the L2): the Triton kernel in the product's configuration against CUDA
   launch configurations (warps splitting K, loads in flight, blocks per SM). The LM head (row scales)
   is timed against the product's head kernel (solo.kernels.triton_fp8.fp8_rowwise_linear).
2. A chain like the decode step's projections (qkvfgb, o_proj, shared gate_up, shared down per
   layer, 10 layers, distinct weights): Triton vs CUDA, each with plain launches and with PDL
   (the CUDA kernels load their first weights before waiting on the previous kernel).
3. 40 routers (512 experts, hidden 2560, 8 groups keep 4, top-8) of one token and of a verification
   window (--router-tokens): Triton vs CUDA, same experts chosen, weights within rounding.
Prints a table per part; --json writes everything.

--steady (alone): where a projection's time goes, ramp and tail or the stream itself. Each named shape
with its rows multiplied by each of --scales (the same kernel, K and launch rule; more tasks a block),
timed as in part 1 with the product's launch and with the L2 hints (GemvLaunch.l2_ahead, l2_fetch): if
the fraction of the copy bandwidth rises toward the copy's with the rows, the kernel's fixed costs are
what the step pays; if it stays, the stream itself is bound (bytes in flight, issue).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from fused_gemv_sweep import SHAPES, call_kwargs, make, run_once  # noqa: E402
from launch_probe import graph_seconds  # noqa: E402

from solo.bench.decode import copy_bandwidth  # noqa: E402
from solo.kernels.cuda_step import CudaGemv, CudaRouter, GemvLaunch  # noqa: E402
from solo.kernels.fused_router import FusedRouter  # noqa: E402
from solo.kernels.pdl import LaunchPolicy  # noqa: E402

CHAIN = ("qkvfgb", "o_proj", "shared_gate_up", "shared_down")


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30))


def variants(name: str, quick: bool, bulk: bool = False) -> list[GemvLaunch]:
    if bulk:  # the product's choice against the weights through a ring of bulk copies (gemv_decode.cu BULK)
        return [
            GemvLaunch(),
            GemvLaunch(bulk=1),
            GemvLaunch(bulk=1, warps=8),
            GemvLaunch(bulk=1, warps=16),
            GemvLaunch(bulk=2),
            GemvLaunch(bulk=2, warps=8),
        ]
    out = [GemvLaunch()]  # the product's choice
    for warps in (4, 8, 16):
        for most in (4, 8):
            out.append(GemvLaunch(warps=warps, max_in_flight=most))
    out.append(GemvLaunch(blocks_per_sm=2))
    if quick:
        out = out[:3]
    return list(dict.fromkeys(out))


def weight_copies(name: str, device: torch.device) -> tuple[list, dict, torch.Tensor, list[torch.Tensor]]:
    """Copies of shape `name`'s weights, >= 400 MB together (calls cycling through them read HBM, not the
    L2), with one token's call keywords, a launch counter and an output per copy."""
    copies = max(2, -(-400_000_000 // make(name, 1, device)[0].nbytes()))
    gemvs = make(name, copies, device, seed=3)
    counter = torch.zeros(1, dtype=torch.int32, device=device)
    outs = [torch.empty((1, g.rows), dtype=torch.bfloat16, device=device) for g in gemvs]
    return gemvs, call_kwargs(name, 1, device), counter, outs


def shape_rows(name: str, copy_gbs: float, device: torch.device, quick: bool, bulk: bool = False) -> dict:
    rows, k, kind, _ = SHAPES[name]
    gemvs, kw, counter, outs = weight_copies(name, device)
    nbytes = gemvs[0].nbytes()
    result: dict = {"shape": name, "rows": rows, "k": k, "kind": kind, "mb": nbytes / 1e6, "runs": []}

    if kind == "row":  # the product's LM head kernel
        from solo.kernels.triton_fp8 import fp8_rowwise_linear

        def triton_call(i):
            return fp8_rowwise_linear(kw["x"], gemvs[i].weight, gemvs[i].scale, out=outs[i])
    else:

        def triton_call(i):
            return run_once(gemvs[i], kw, outs[i])

    want = triton_call(0).clone()
    secs = graph_seconds([lambda i=i: triton_call(i) for i in range(len(gemvs))])
    result["runs"].append({"impl": "triton", "us": secs * 1e6, "of_copy": nbytes / secs / 1e9 / copy_gbs})
    for launch in variants(name, quick, bulk):
        try:
            cudas = [CudaGemv(g, counter, launch) for g in gemvs]
            got = run_once(cudas[0], kw, outs[0]).clone()
            secs = graph_seconds([lambda c=c, o=o: run_once(c, kw, o) for c, o in zip(cudas, outs, strict=True)])
        except Exception as exc:  # noqa: BLE001 (a configuration that cannot run is reported)
            result["runs"].append({"impl": "cuda", "launch": vars(launch), "error": str(exc)[:300]})
            print(f"  {name} {launch}: {str(exc)[:200]}", flush=True)
            continue
        row = {"impl": "cuda", "launch": vars(launch), "us": secs * 1e6, "of_copy": nbytes / secs / 1e9 / copy_gbs}
        row["rel_err_vs_triton"] = rel(got, want)
        _, grid, threads, defines = next(iter(cudas[0]._kernels.values()))
        row.update(grid=grid, warps=defines["WARPS"], in_flight=defines["PF"], slots=defines.get("SLOTS", 0))
        result["runs"].append(row)
    best = min((r for r in result["runs"] if "us" in r), key=lambda r: r["us"])
    result["best"] = best
    tri = result["runs"][0]
    print(
        f"{name:15s} {nbytes / 1e6:6.1f} MB  triton {tri['us']:6.2f} us ({tri['of_copy']:.0%})  "
        + "  ".join(
            f"[{r['warps']}w {'s' + str(r['slots']) if r['slots'] else 'pf' + str(r['in_flight'])} g{r['grid']}] "
            f"{r['us']:6.2f} ({r['of_copy']:.0%}, "
            f"err {r['rel_err_vs_triton']:.1e})"
            for r in result["runs"][1:]
            if "us" in r
        ),
        flush=True,
    )
    return result


STEADY_LAUNCHES = {
    "product": GemvLaunch(),
    "L2 fetch 256 B": GemvLaunch(l2_fetch=256),
    "L2 ahead 2": GemvLaunch(l2_ahead=2),
    "L2 first 4": GemvLaunch(l2_ahead=4, l2_loop=False),
    # (twenty-fourth session) the weights through rings of shared memory filled by bulk copies, up to about 200 KB
    # an SM in flight against the registers' 60: does the H200's stream, which stops near 2.9 TB/s, rise with them?
    # (warps other than the product's sum K in another order: their outputs are not compared)
    "8 warps": GemvLaunch(warps=8),
    "bulk 2x8": GemvLaunch(bulk=2, warps=8),
    "bulk 4x4": GemvLaunch(bulk=4, warps=4),
}


def steady(name: str, scales: list[int], copy_gbs: float, device: torch.device) -> list[dict]:
    """The shape `name` with its rows times each scale: us and fraction of the copy bandwidth per launch."""
    rows, k, kind, per_step = SHAPES[name]
    out = []
    for m in scales:
        scaled = f"{name} x{m}"
        SHAPES[scaled] = (rows * m, k, kind, per_step)
        try:
            gemvs, kw, counter, outs = weight_copies(scaled, device)
            nbytes = gemvs[0].nbytes()
            want = None
            line = f"{scaled:14s} {nbytes / 1e6:7.1f} MB"
            for label, launch in STEADY_LAUNCHES.items():
                cudas = [CudaGemv(g, counter, launch) for g in gemvs]
                got = run_once(cudas[0], kw, outs[0]).clone()
                warps = next(iter(cudas[0]._kernels.values()))[3]["WARPS"]
                if want is None:  # (the product, first)
                    want, product_warps, same = got, warps, True
                else:  # (None: not compared, the sums run in another order)
                    same = torch.equal(got, want) if warps == product_warps else None
                calls = [lambda c=c, o=o, kw=kw: run_once(c, kw, o) for c, o in zip(cudas, outs, strict=True)]
                secs = graph_seconds(calls)
                row = {"shape": scaled, "mb": nbytes / 1e6, "launch": label, "us": secs * 1e6}
                row.update(of_copy=nbytes / secs / 1e9 / copy_gbs, same_as_product=same)
                out.append(row)
                line += f"  {label} {row['us']:7.2f} us ({row['of_copy']:.0%}{', DIFFERS' if same is False else ''})"
            print(line, flush=True)
        finally:
            del SHAPES[scaled]
            torch.cuda.empty_cache()
    return out


def chain(copy_gbs: float, device: torch.device, layers: int = 10) -> dict:
    gemvs = {name: make(name, layers, device, seed=i) for i, name in enumerate(CHAIN)}
    counter = torch.zeros(1, dtype=torch.int32, device=device)
    cudas = {name: [CudaGemv(g, counter) for g in gemvs[name]] for name in CHAIN}
    kwargs = {name: call_kwargs(name, 1, device) for name in CHAIN}
    nbytes = sum(g.nbytes() for name in CHAIN for g in gemvs[name])
    outs = {
        name: [torch.empty((1, g.rows), dtype=torch.bfloat16, device=device) for g in gemvs[name]] for name in CHAIN
    }
    result: dict = {"kernels": layers * len(CHAIN), "mb": nbytes / 1e6}
    reference = None
    for impl in ("triton", "cuda"):
        for pdl in (False, True):
            policy = LaunchPolicy(pdl, prefetch=False)
            for name in CHAIN:
                for g in gemvs[name]:
                    g.launch = policy
            made = gemvs if impl == "triton" else cudas
            calls = [
                lambda g=made[name][i], o=outs[name][i], kw=kwargs[name]: run_once(g, kw, o)
                for i in range(layers)
                for name in CHAIN
            ]
            secs = graph_seconds(calls)
            got = torch.cat([o.flatten() for name in CHAIN for o in outs[name]])
            if reference is None:
                reference = got.clone()
            key = f"{impl}{'+pdl' if pdl else ''}"
            result[key] = {
                "us_per_kernel": secs * 1e6,
                "of_copy": nbytes / (secs * result["kernels"]) / 1e9 / copy_gbs,
                "rel_err_vs_triton": rel(got, reference),
                "pdl_flags": policy.families_with_pdl(),
            }
            r = result[key]
            print(
                f"chain ({result['kernels']} kernels, {nbytes / 1e6:.0f} MB) {key:12s}: {r['us_per_kernel']:6.2f} us "
                f"per kernel ({r['of_copy']:.0%} of copy), err vs triton {r['rel_err_vs_triton']:.1e}",
                flush=True,
            )
    return result


def routers(copy_gbs: float, device: torch.device, tokens: int = 1, count: int = 40) -> dict:
    experts, hidden = 512, 2560
    g = torch.Generator(device=device).manual_seed(int(time.time()))
    weights = [torch.randn(experts, hidden, device=device, generator=g).mul(0.02).bfloat16() for _ in range(count)]
    biases = [torch.randn(experts, device=device, generator=g) * 0.01 for _ in range(count)]
    norm = (1 + 0.1 * torch.randn(hidden, device=device, generator=g)).to(torch.bfloat16)
    xs = [torch.randn(tokens, hidden, device=device, generator=g).to(torch.bfloat16) for _ in range(count)]
    counters = torch.zeros(3, dtype=torch.int32, device=device)
    out: dict = {}
    picks = {}
    for impl in ("triton", "cuda"):
        for pdl in (False, True):
            policy = LaunchPolicy(pdl, prefetch=False)
            made = [
                FusedRouter(w, b, norm, 1e-6, 8, 8, 4, True, 2.5, counters[0:1], counters[1:2], policy)
                for w, b in zip(weights, biases, strict=True)
            ]
            if impl == "cuda":
                made = [CudaRouter(r, counters[2:3]) for r in made]
            results: list = [None] * count

            def call(i, made=made, results=results):
                results[i] = made[i](xs[i])

            secs = graph_seconds([lambda i=i: call(i) for i in range(count)])
            key = f"T={tokens} {impl}{'+pdl' if pdl else ''}"
            picks[key] = results
            out[key] = {"us": secs * 1e6}
    ref = picks[f"T={tokens} triton"]
    for key, results in picks.items():
        same_ids = all(torch.equal(a[1], b[1]) for a, b in zip(results, ref, strict=True))
        wts_err = max(rel(a[2], b[2]) for a, b in zip(results, ref, strict=True))
        xn_err = max(rel(a[0], b[0]) for a, b in zip(results, ref, strict=True))
        out[key].update(same_ids=same_ids, wts_rel_err=wts_err, xn_rel_err=xn_err)
        print(
            f"router {key:12s}: {out[key]['us']:6.2f} us, same experts {same_ids}, weights err {wts_err:.1e}, "
            f"xn err {xn_err:.1e}",
            flush=True,
        )
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", default=",".join(SHAPES))
    p.add_argument("--json", default=None)
    p.add_argument("--quick", action="store_true", help="three CUDA configurations per shape")
    p.add_argument("--router-tokens", default="1,4", help="token counts of the router part")
    p.add_argument("--only-routers", action="store_true")
    p.add_argument("--bulk", action="store_true", help="the product's launch against bulk rings (no chain, routers)")
    p.add_argument("--steady", default="", help="shapes to time with their rows scaled (only this part)")
    p.add_argument("--scales", default="1,2,4,8", help="row multiples of --steady")
    args = p.parse_args()
    device = torch.device("cuda")
    copy_gbs = copy_bandwidth(device) / 1e9
    print(f"device-to-device copy bandwidth: {copy_gbs:.0f} GB/s ({torch.cuda.get_device_name()})", flush=True)
    report: dict = {"device": torch.cuda.get_device_name(), "copy_gbs": copy_gbs, "torch": torch.__version__}
    if args.steady:
        scales = [int(m) for m in args.scales.split(",")]
        report["steady"] = [row for name in args.steady.split(",") for row in steady(name, scales, copy_gbs, device)]
        if args.json:
            Path(args.json).write_text(json.dumps(report, indent=1))
        return 0
    if not args.bulk:
        report["routers"] = {t: routers(copy_gbs, device, int(t)) for t in args.router_tokens.split(",")}
    shapes = [] if args.only_routers else args.shapes.split(",")
    if shapes and not args.bulk:
        report["chain"] = chain(copy_gbs, device)
    report["shapes"] = []
    for name in shapes:
        report["shapes"].append(shape_rows(name, copy_gbs, device, args.quick, args.bulk))
        torch.cuda.empty_cache()
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Where the launch-bound part of the decode step goes (lent H200): PDL on chains of fused GEMVs, and
the router's scores vs its selection.

    python3 dev/launch_probe.py [--layers 10] [--json OUT.json]

1. A chain like the decode step's projections (per layer: KDA q|k|v|f|g|b with its RMSNorm, o_proj
   with the gated norm and residual, the shared expert's gate_up and down), `--layers` of them with
   distinct weights (over the L2), captured in one CUDA graph, timed with plain launches and with
   programmatic dependent launch (solo.kernels.pdl). Outputs must be bit-identical: PDL moves
   launches, not arithmetic. Printed: per-kernel time of each and GB/s against the copy bandwidth of
   the same run.
2. 40 routers (Ling-3.0-flash: 512 experts, hidden 2560, 8 groups keep 4, top-8; distinct weights),
   one token each, in one graph: the product's configuration (4 experts x 1 warp per program,
   selection by the last program) against other experts per program, selection in a second launch,
   PDL, the weight prefetch and the scores' K loop unrolled. Every variant must choose the same
   experts with the same weights.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from fused_gemv_sweep import call_kwargs, make, run_once  # noqa: E402

from solo.bench.decode import copy_bandwidth, time_graph  # noqa: E402
from solo.kernels.fused_router import FusedRouter  # noqa: E402
from solo.kernels.pdl import LaunchPolicy  # noqa: E402

CHAIN = ("qkvfgb", "o_proj", "shared_gate_up", "shared_down")
# name, PDL (measured on the H200, 2026-12-02: also with each program's weights bulk-prefetched into
# the L2 first, before the wait: 12.8 us per kernel against 9.1 plain, 11.6 with PDL; dropped)
CHAIN_VARIANTS = (("plain", False), ("pdl", True))


def graph_seconds(calls) -> float:
    """Per call: `calls` (zero-argument callables) captured in order in one graph."""
    for call in calls:
        call()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for call in calls:
            call()
    seconds = time_graph(graph, replays=20, rounds=7) / len(calls)
    del graph
    return seconds


def gemv_chain(layers: int, copy_gbs: float, device: torch.device) -> dict:
    gemvs = {name: make(name, layers, device, seed=i) for i, name in enumerate(CHAIN)}
    kwargs = {name: call_kwargs(name, 1, device) for name in CHAIN}
    nbytes = sum(g.nbytes() for name in CHAIN for g in gemvs[name])
    outs = {
        name: [torch.empty((1, g.rows), dtype=torch.bfloat16, device=device) for g in gemvs[name]] for name in CHAIN
    }

    def calls():
        out = []
        for layer in range(layers):
            for name in CHAIN:
                g, o = gemvs[name][layer], outs[name][layer]
                out.append(lambda g=g, o=o, kw=kwargs[name]: run_once(g, kw, o))
        return out

    result: dict = {"kernels": layers * len(CHAIN), "bytes": nbytes}
    reference = None
    for key, pdl in CHAIN_VARIANTS:
        policy = LaunchPolicy(pdl)
        for name in CHAIN:
            for g in gemvs[name]:
                g.launch = policy
        seconds = graph_seconds(calls())
        got = torch.cat([o.flatten() for name in CHAIN for o in outs[name]])
        if reference is None:
            reference = got.clone()
        result[key] = {
            "us_per_kernel": seconds * 1e6,
            "gbs": nbytes / (seconds * result["kernels"]) / 1e9,
            "identical": bool(torch.equal(got, reference)),
            "launched_with_pdl": policy.families_with_pdl(),
        }
        result[key]["of_copy"] = result[key]["gbs"] / copy_gbs
    return result


def routers(copy_gbs: float, device: torch.device) -> list[dict]:
    experts, hidden, count = 512, 2560, 40
    g = torch.Generator(device=device).manual_seed(7)
    weights = [torch.randn(experts, hidden, device=device, generator=g).mul(0.02).bfloat16() for _ in range(count)]
    biases = [torch.randn(experts, device=device, generator=g) * 0.01 for _ in range(count)]
    norm = (1 + 0.1 * torch.randn(hidden, device=device, generator=g)).to(torch.bfloat16)
    xs = [torch.randn(1, hidden, device=device, generator=g).to(torch.bfloat16) for _ in range(count)]
    counters = torch.zeros(2, dtype=torch.int32, device=device)
    # experts per program, warps, separate selection, PDL, prefetch, unrolled K loop; the product's first.
    # (Other warp counts sum in another order: their weights differ in the last bits, so "same choice"
    # compares exactly and reads False for them; the ids agree.)
    variants = [(4, 1, False, False, False, False)]
    variants += [(e, 1, False, False, pf, un) for e in (2, 4, 8) for pf in (False, True) for un in (False, True)]
    variants += [(4, 1, sep, True, pf, un) for sep in (False, True) for pf in (False, True) for un in (False, True)]
    variants += [(e, 1, False, True, True, True) for e in (2, 8)]
    rows, reference = [], None
    for block_e, warps, separate, pdl, prefetch, unroll in dict.fromkeys(variants):
        made = []
        policy = LaunchPolicy(pdl, prefetch)
        for w, b in zip(weights, biases, strict=True):
            r = FusedRouter(w, b, norm, 1e-6, 8, 8, 4, True, 2.5, counters[0:1], counters[1:2], policy)
            r.BLOCK_E, r.WARPS, r.select_separately, r.unroll = block_e, warps, separate, unroll
            made.append(r)
        results: list = [None] * count

        def call(i, made=made, results=results):
            results[i] = made[i](xs[i])

        try:
            seconds = graph_seconds([lambda i=i: call(i) for i in range(count)])
        except Exception as exc:  # noqa: BLE001 (a variant the compiler refuses is reported, not fatal)
            rows.append(
                {"block_e": block_e, "separate": separate, "pdl": pdl, "prefetch": prefetch, "error": str(exc)[:200]}
            )
            continue
        chosen = torch.cat([torch.cat([ids.float(), wts], 1) for _, ids, wts in results])
        if reference is None:
            reference = chosen.clone()
        row = {"block_e": block_e, "warps": warps, "separate": separate, "pdl": pdl, "prefetch": prefetch}
        row.update(unroll=unroll, us=seconds * 1e6)
        row["same_choice"] = bool(torch.equal(chosen, reference))
        row["of_copy"] = experts * hidden * 2 / seconds / 1e9 / copy_gbs
        rows.append(row)
        print(
            f"router E/prog {block_e:2d} warps {warps} separate {separate!s:5} pdl {pdl!s:5} prefetch {prefetch!s:5} "
            f"unroll {unroll!s:5}: {row['us']:6.2f} us "
            f"({row['of_copy']:.0%} of copy) same choice {row['same_choice']}",
            flush=True,
        )
    return rows


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=10)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    device = torch.device("cuda")
    copy_gbs = copy_bandwidth(device) / 1e9
    print(f"device-to-device copy bandwidth: {copy_gbs:.0f} GB/s ({torch.cuda.get_device_name()})", flush=True)
    chain = gemv_chain(args.layers, copy_gbs, device)
    for key, _ in CHAIN_VARIANTS:
        c = chain[key]
        head = f"GEMV chain ({chain['kernels']} kernels, {chain['bytes'] / 1e6:.0f} MB) {key:12s}"
        speed = f"{c['gbs']:.0f} GB/s ({c['of_copy']:.0%} of copy)"
        print(f"{head}: {c['us_per_kernel']:.2f} us per kernel, {speed}, identical {c['identical']}", flush=True)
    report = {"device": torch.cuda.get_device_name(), "copy_gbs": copy_gbs, "gemv_chain": chain}
    report["routers"] = routers(copy_gbs, device)
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

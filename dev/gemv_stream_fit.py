"""Fixed cost and stream rate of the decode step's CUDA GEMVs, read from bench timelines (no GPU).

    python3 dev/gemv_stream_fit.py docs/results/h200_bench_decode_lab16.json docs/results/h100_bench_lab58.json \
        [--context 32768]

A `solo bench decode` JSON keeps one profiled replay's timeline (kernel, duration, critical-path time).
The step's GEMVs all show as `gemv_decode`; each is named here by its neighbours in the step's fixed order
(the KDA projections before `_kda_decode`, MLA's q|kv_a|g before `_mla_prep`, an output projection after the
KDA kernel or the MLA combine, the shared expert after the MoE kernel, the dense MLP after a dense layer's
output projection). Each GEMV's weight bytes come from Ling-3.0-flash's shape (FP8, one byte a weight; the
block scales, under 0.01%, are left out). Per file it prints each GEMV's median critical-path time and rate,
and the least-squares line time = fixed + bytes / stream over the GEMVs' medians: `fixed` is what a GEMV
pays whatever its size (ramp, tail, the wait on its predecessor), `stream` the rate its bytes flow at once
it streams, against the copy bandwidth measured in the same run (the JSON's roofline). If the stream is
near the copy bandwidth, only the fixed costs are left to win; if not, the stream itself is bound (bytes in
flight, issue). The steady probe (`dev/step_kernels_probe.py --steady`) measures the same on a GPU.
Where the MoE kernels ask the L2 for the next projection's first megabytes (`l2_next` in the JSON), those
projections start with part of their bytes on chip and look faster than their stream. The persistent MoE kernels
(`moe_decode`, the router inside) get a line too: their median critical-path time against the routed experts' and the
router's bytes at the copy bandwidth.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys

from solo.checkpoint.synthetic import LING_3_FLASH


def gemv_bytes(cfg: dict) -> dict[str, int]:
    """Weight bytes of each one-token GEMV of the step (FP8: a byte a weight)."""
    h = cfg["hidden_size"]
    heads, dim = cfg["linear_num_heads"], cfg["linear_head_dim"]
    kda_rows = 5 * heads * dim + heads  # q, k, v, the forget gate f, the output gate g; beta b a row a head
    mla_q = cfg["num_attention_heads"] * (cfg["qk_nope_head_dim"] + cfg["qk_rope_head_dim"])
    mla_rows = mla_q + cfg["kv_lora_rank"] + cfg["qk_rope_head_dim"] + cfg["num_attention_heads"] * cfg["v_head_dim"]
    shared = cfg["moe_intermediate_size"] * cfg["n_shared_experts"]
    dense = cfg["intermediate_size"]
    return {
        "qkvfgb": kda_rows * h,
        "mla q|kv_a|g": mla_rows * h,
        "o_proj": h * heads * dim,  # (MLA's output projection has the same shape: 32 heads x 128)
        "shared gate_up": 2 * shared * h,
        "shared down": h * shared,
        "MLP gate_up": 2 * dense * h,
        "MLP down": h * dense,
    }


def name_gemvs(timeline: list[list]) -> list[tuple[str, float]]:
    """(name, critical-path us) per kernel, the GEMVs named by their neighbours (module docstring)."""
    named: list[tuple[str, float]] = []
    for i, (kernel, _duration, critical) in enumerate(timeline):
        if kernel != "gemv_decode":
            named.append((kernel, critical))
            continue
        following = timeline[i + 1][0] if i + 1 < len(timeline) else ""
        before = named[-1][0] if named else ""
        if following == "_kda_decode":
            name = "qkvfgb"
        elif following == "_mla_prep":
            name = "mla q|kv_a|g"
        elif before in ("_kda_decode", "_mla_combine_ranks"):
            name = "o_proj"
        elif before == "moe_decode":
            name = "shared gate_up"
        elif before == "shared gate_up":
            name = "shared down"
        elif before == "o_proj":
            name = "MLP gate_up"
        elif before == "MLP gate_up":
            name = "MLP down"
        else:
            name = "unnamed"
        named.append((name, critical))
    return named


def fit(points: list[tuple[float, float]]) -> tuple[float, float]:
    """Least squares of us = fixed + MB / rate over (MB, us): (fixed us, rate in MB/us = TB/s)."""
    slope, fixed = statistics.linear_regression([x for x, _ in points], [y for _, y in points])
    return fixed, 1.0 / slope


def report(path: str, context: str, sizes: dict[str, int]) -> None:
    with open(path) as f:
        data = json.load(f)
    device = data.get("environment", {}).get("device", "?")
    result = data["results"][0]
    run = result["contexts"][context]
    copy_tbs = run["bytes_per_token"]["total"] / run["roofline_ms"] / 1e9
    named = name_gemvs(run["profile"]["timeline"])
    l2_next = result.get("l2_next", "not recorded")  # (benches before the eighteenth session: no such asks)
    print(f"{path} ({device}, context {context}; copy bandwidth {copy_tbs:.2f} TB/s; l2_next {l2_next})")
    points = []
    for name, size in sizes.items():
        times = [us for n, us in named if n == name]
        if not times:
            continue
        median = statistics.median(times)
        mb = size / 1e6
        points.append((mb, median))
        print(f"  {name:15s} x{len(times):2d} {mb:5.1f} MB  median {median:6.2f} us  {mb / median:4.2f} TB/s")
    unnamed = sum(1 for n, _ in named if n == "unnamed")
    if unnamed:
        print(f"  ({unnamed} GEMVs not named: the step's order is not the one this script knows)")
    fixed, rate = fit(points)
    print(f"  fit: fixed {fixed:.2f} us a GEMV, stream {rate:.2f} TB/s ({rate / copy_tbs:.0%} of the copy bandwidth)")
    moe = [us for n, us in named if n == "moe_decode"]
    if moe:  # the persistent MoE kernel with its router inside: the routed experts' and the router's bytes
        share = run["bytes_per_token"]
        mb = (share["experts"] + share.get("routers", 0)) / len(moe) / 1e6
        median = statistics.median(moe)
        print(
            f"  MoE kernel      x{len(moe):2d} {mb:5.1f} MB  median {median:6.2f} us, its bytes at the copy bandwidth "
            f"{mb / copy_tbs:5.2f} us: {median - mb / copy_tbs:5.2f} us more"
        )


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("files", nargs="+", help="solo bench decode --json outputs")
    p.add_argument("--context", default="32768")
    args = p.parse_args()
    sizes = gemv_bytes(LING_3_FLASH)
    for path in args.files:
        report(path, args.context, sizes)
    return 0


if __name__ == "__main__":
    sys.exit(main())

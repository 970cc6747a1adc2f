"""One token's KDA front alone: the fused launch (solo/kernels/cuda/kda_front.cu) against the CUDA GEMV + the Triton
recurrence, at Ling-3.0-flash's widths, over `--layers` layers of distinct random weights (so that the L2 holds none),
each side captured in one CUDA graph under PDL. Prints each build's registers, local bytes, resident clusters and
microseconds a layer, and the pair's.

    python3 dev/kda_front_probe.py [--layers 35] [--builds 2:1:10:0:g,1:1:10:0:g:r4]   # see --help
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from types import SimpleNamespace

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from solo.bench.decode import copy_bandwidth, time_graph  # noqa: E402
from solo.kernels.cuda_kda import SPLIT, CudaKdaFront  # noqa: E402
from solo.kernels.cuda_step import CudaGemv  # noqa: E402
from solo.kernels.fused_gemv import FusedGemv  # noqa: E402
from solo.kernels.fused_kda import kda_decode  # noqa: E402
from solo.kernels.pdl import LaunchPolicy  # noqa: E402

HIDDEN, HEADS, DK = 2560, 32, 128


def layer(device: torch.device) -> SimpleNamespace:
    d = HEADS * DK
    rows = 5 * d + HEADS
    weight = (torch.randn(rows, HIDDEN, device=device) * 0.5).to(torch.float8_e4m3fn)
    scales = torch.rand(-(-rows // 128), HIDDEN // 128, device=device) * 0.01 + 0.001
    attn = SimpleNamespace(
        num_heads=HEADS,
        head_dim=DK,
        kernel_size=4,
        safe_gate=True,
        lower_bound=-5.0,
        A_log=torch.randn(HEADS, device=device) * 0.1,
        dt_bias=torch.randn(d, device=device) * 0.1,
        conv_weight=torch.randn(3 * d, 4, device=device) * 0.5,
    )
    return SimpleNamespace(
        weight=weight,
        scales=scales,
        attn=attn,
        norm=(torch.rand(HIDDEN, device=device) + 0.5).to(torch.bfloat16),
        conv=torch.randn(3 * d, 3, device=device),
        state=torch.randn(HEADS, DK, DK, device=device) * 0.05,
        o=torch.empty(1, d, dtype=torch.bfloat16, device=device),
    )


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=35)
    p.add_argument(
        "--builds",
        default="2:1:10:0:g,1:1:10:0:g:r4,1:1:10:0:g:r3,1:1:10:0:g:r2",
        help="tasks ahead : min blocks : warps [: tasks asked of the L2] [: g (global exchange)] [: rN (a ring of N "
        "slots)], comma separated",
    )
    args = p.parse_args()
    device = torch.device("cuda")
    torch.manual_seed(0)
    layers = [layer(device) for _ in range(args.layers)]
    x = torch.randn(1, HIDDEN, device=device).to(torch.bfloat16)
    counter = torch.zeros(4, dtype=torch.int32, device=device)
    sync = torch.zeros(HEADS, dtype=torch.int32, device=device)
    launch = LaunchPolicy(True)
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    print(f"{torch.cuda.get_device_name(device)}, {sms} SMs, copy {copy_bandwidth(device) / 1e12:.2f} TB/s")
    nbytes = layers[0].weight.nbytes + layers[0].scales.nbytes + 2 * layers[0].state.nbytes

    def timed(name: str, run_layer) -> float:
        for i in range(len(layers)):  # (compiles)
            run_layer(i)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for i in range(len(layers)):
                run_layer(i)
        us = time_graph(graph, replays=20, rounds=5) * 1e6 / len(layers)
        print(f"{name:40s} {us:6.2f} us a layer ({nbytes / us / 1e6:.2f} TB/s of weights + state)", flush=True)
        return us

    gemvs = [
        CudaGemv(FusedGemv(lay.weight, lay.scales, "block", counter=counter[:1], launch=launch), counter[1:2])
        for lay in layers
    ]

    def pair(i: int) -> None:
        lay = layers[i]
        proj = gemvs[i](x, norm_weight=lay.norm, eps=1e-6)
        a = lay.attn
        kda_decode(
            proj,
            a.conv_weight,
            lay.conv,
            lay.state,
            a.A_log,
            a.dt_bias,
            lay.o,
            counter[2:3],
            -5.0,
            True,
            None,
            None,
            sync,
            launch,
        )

    base = timed("CUDA GEMV + Triton recurrence", pair)
    for build in args.builds.split(","):
        fields = build.split(":")
        exchange = "global" if "g" in fields else "cluster"
        ring = int(next((f[1:] for f in fields if f.startswith("r")), 0))
        ahead, blocks, warps, l2 = ([int(v) for v in fields if v != "g" and not v.startswith("r")] + [0])[:4]
        fronts = [
            CudaKdaFront(lay.weight, lay.scales, lay.attn, counter[3:4], ahead, blocks, warps, l2, exchange, ring=ring)
            for lay in layers
        ]
        kernel = fronts[0].kernel()
        regs, local = kernel.registers()
        clusters = kernel.max_active_clusters(HEADS * SPLIT, 32 * warps) if exchange == "cluster" else 0
        print(
            f"front {ahead} tasks ahead, {blocks} blocks/SM build, {warps} warps: {regs} registers, {local} local "
            f"bytes, {clusters} clusters of {SPLIT} resident at once (needs {HEADS})"
        )

        def one(i: int, fronts=fronts) -> None:
            lay = layers[i]
            fronts[i](x, lay.norm, 1e-6, lay.conv, lay.state, lay.o, launch)

        us = timed(f"front {ahead} ahead, {blocks}/SM, {warps} warps, L2 {l2}, {exchange}, ring {ring}", one)
        print(f"  {us - base:+.2f} us a layer against the pair")
    return 0


if __name__ == "__main__":
    sys.exit(main())

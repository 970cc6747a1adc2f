"""Does streaming the weights across the grid-wide waits pay? (lent Hopper GPU)

    python3 dev/gemv_chain_probe.py [--layers 10] [--variants 20x10g1.10.4,20x10g1.10.4n] [--json OUT.json]

A variant WxD[gQ.U.O][n][pP]: W warps a block, D ring steps a warp; gQ.U.O: the warps that share a task
(splitting its K) in the q|k|v|f|g|b projections, the gate_up and the down (1 each by default); n: no
waits between the stages (a timing probe: the stages' inputs are their own, so the outputs are the same;
what the streaming alone costs); pP: the waits poll with a back-off of P ns.

The decode step's GEMV-only stretch of every layer, the shared expert's gate_up and down then the next
layer's q|k|v|f|g|b projections (58.4 MB a layer, full Ling-3.0-flash widths, distinct random FP8
weights per layer so nothing stays in the L2), over `--layers` layers, timed as one CUDA graph:

1. product: the product's CUDA GEMV kernels (`CudaGemv`, gemv_decode.cu) one launch each, under PDL;
2. chain WxD: dev/gemv_chain.cu, every stage in ONE persistent launch (W warps a block, each warp's ring
   D steps of 1 KB deep, streaming across the stages' grid-wide waits);
3. chain WxD per layer: the same kernel, one launch of three stages a layer, under PDL.

Each variant's outputs are compared with the product's, stage by stage (the chain sums K in another
order, so they agree to rounding: relative error and the share of bf16 values that differ). Prints us
per layer, the bytes' rate and its fraction of the copy bandwidth measured in the same run.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import struct
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from fused_gemv_sweep import call_kwargs, make, run_once  # noqa: E402
from launch_probe import graph_seconds  # noqa: E402

from solo.bench.decode import copy_bandwidth  # noqa: E402
from solo.kernels.cuda_runtime import CudaKernel  # noqa: E402
from solo.kernels.cuda_step import CudaGemv  # noqa: E402
from solo.kernels.pdl import LaunchPolicy  # noqa: E402

ORDER = ("shared_gate_up", "shared_down", "qkvfgb")  # stage kinds 1, 2, 0 of gemv_chain.cu
KIND = {"qkvfgb": 0, "shared_gate_up": 1, "shared_down": 2}
K_OF_KIND = {0: 2560, 1: 2560, 2: 768}
STAGE_FORMAT = "<7Q4i2f"  # struct Stage: 7 pointers, kind, k, rows, pad, limit, eps (80 bytes)


def chain_source() -> Path:
    """gemv_chain.cu beside a copy of the product's step_common.cuh (NVRTC inlines headers beside it)."""
    folder = Path(tempfile.mkdtemp(prefix="gemv_chain_"))
    here = Path(__file__).resolve().parent
    shutil.copy(here / "gemv_chain.cu", folder / "gemv_chain.cu")
    shutil.copy(here.parent / "solo" / "kernels" / "cuda" / "step_common.cuh", folder / "step_common.cuh")
    return folder / "gemv_chain.cu"


def ptr(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.data_ptr()


class Chain:
    """One launch of gemv_chain.cu over `stages` [(name, FusedGemv, kwargs, out)]."""

    def __init__(
        self, source: Path, stages: list, warps: int, depth: int, device: torch.device, extra: dict | None = None
    ) -> None:
        self.stages = stages
        self.threads = 32 * warps
        packed = b""
        for name, g, kw, out in stages:
            kind = KIND[name]
            if g.k != K_OF_KIND[kind]:
                raise ValueError(f"{name}: K {g.k}, the kernel is compiled for {K_OF_KIND[kind]}")
            packed += struct.pack(
                STAGE_FORMAT,
                ptr(g.weight), ptr(g.scale), ptr(kw["x"]), ptr(kw.get("norm_weight")), ptr(out),
                ptr(kw.get("residual")), ptr(kw.get("addend")),
                kind, g.k, g.rows, 0, float(g.limit or 0.0), 1e-6,
            )  # fmt: skip
        self.desc = torch.frombuffer(bytearray(packed), dtype=torch.uint8).to(device)
        self.counters = torch.zeros(len(stages) + 1, dtype=torch.int32, device=device)
        self.count = torch.zeros(1, dtype=torch.int32, device=device)
        defines = {"WARPS": warps, "D": depth, "STAGES": len(stages)} | (extra or {})
        self.kernel = CudaKernel(source, "gemv_chain", defines, device)
        shared = 4096 * 2 + 132 * warps + 80 * len(stages) + 256  # struct Shared (with slack for its padding)
        shared = (shared + 127) // 128 * 128 + warps * depth * 1024
        self.kernel.set_shared_bytes(shared)
        per_sm = self.kernel.max_blocks_per_sm(self.threads, shared)
        if per_sm < 1:
            raise RuntimeError(f"gemv_chain {warps}x{depth}: {shared} bytes of shared memory do not fit an SM")
        self.grid = per_sm * torch.cuda.get_device_properties(device).multi_processor_count
        self.shared = shared

    def __call__(self) -> None:
        self.kernel.launch(self.grid, self.threads, [self.desc, self.counters, self.count], dependent=True)


def parse_variant(spec: str) -> tuple[int, int, dict]:
    """'WxD[gQ.U.O][n][pP]' -> warps, depth, defines (see the module's docstring)."""
    m = re.fullmatch(r"(\d+)x(\d+)(?:g(\d+)\.(\d+)\.(\d+))?(n)?(?:p(\d+))?", spec)
    if not m:
        raise SystemExit(f"variant {spec!r}: expected WxD[gQ.U.O][n][pP]")
    extra: dict = {}
    if m.group(3):
        extra.update(G_QKV=int(m.group(3)), G_GATE_UP=int(m.group(4)), G_DOWN=int(m.group(5)))
    if m.group(6):
        extra["NOWAIT"] = 1
    if m.group(7):
        extra["POLL_NS"] = int(m.group(7))
    return int(m.group(1)), int(m.group(2)), extra


def compare(outs: list[torch.Tensor], ref: list[torch.Tensor]) -> tuple[float, float]:
    worst_rel, differ = 0.0, 0
    total = 0
    for a, b in zip(outs, ref, strict=True):
        af, bf = a.float(), b.float()
        worst_rel = max(worst_rel, float((af - bf).norm() / bf.norm().clamp_min(1e-30)))
        differ += int((a != b).sum())
        total += a.numel()
    return worst_rel, differ / total


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=10)
    ap.add_argument("--variants", default="20x10g1.10.4,20x10g1.10.4n,20x8g2.10.4,10x20g1.10.2,12x16")
    ap.add_argument("--order", default=",".join(ORDER), help="the stages of a layer (a subset of the default)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    device = torch.device("cuda")
    torch.manual_seed(0)
    copy_gbs = copy_bandwidth(device) / 1e9
    print(f"{torch.cuda.get_device_name(device)}, torch {torch.__version__}; copy bandwidth {copy_gbs:.0f} GB/s")
    layers = args.layers
    stage_names = args.order.split(",")
    if not set(stage_names) <= set(ORDER):
        raise SystemExit(f"--order: stages are among {ORDER}")
    gemvs = {name: make(name, layers, device, seed=11 + i) for i, name in enumerate(stage_names)}
    policy = LaunchPolicy(True, prefetch=False)
    for name in stage_names:
        for g in gemvs[name]:
            g.launch = policy
    counter = torch.zeros(1, dtype=torch.int32, device=device)
    kwargs = {name: call_kwargs(name, 1, device) for name in stage_names}
    order = [(name, i) for i in range(layers) for name in stage_names]
    nbytes = sum(gemvs[n][i].nbytes() for n, i in order)
    outs = {key: torch.empty((1, gemvs[key[0]][key[1]].rows), dtype=torch.bfloat16, device=device) for key in order}
    cudas = {key: CudaGemv(gemvs[key[0]][key[1]], counter) for key in order}
    results: dict = {"device": torch.cuda.get_device_name(device), "copy_gbs": copy_gbs, "layers": layers,
                     "mb_per_layer": nbytes / layers / 1e6, "variants": []}  # fmt: skip

    def report(label: str, seconds: float, err: tuple[float, float] | None) -> None:
        us = seconds * 1e6 / layers
        gbs = nbytes / seconds / 1e9
        row = {"variant": label, "us_per_layer": us, "gbs": gbs, "of_copy": gbs / copy_gbs}
        if err is not None:
            row.update(rel_err=err[0], bf16_differ=err[1])
        results["variants"].append(row)
        tail = f", rel err {err[0]:.1e}, {err[1]:.2%} of values differ" if err else ""
        print(f"{label:28s} {us:7.2f} us a layer, {gbs:6.0f} GB/s ({gbs / copy_gbs:.0%} of copy){tail}", flush=True)

    def timed(calls) -> float:  # the whole graph of `calls`
        return graph_seconds(calls) * len(calls)

    product_calls = [lambda k=key: run_once(cudas[k], kwargs[k[0]], outs[k]) for key in order]
    for call in product_calls:
        call()
    torch.cuda.synchronize()
    ref = [outs[key].clone() for key in order]
    report("product (PDL)", timed(product_calls), None)

    source = chain_source()
    for spec in args.variants.split(","):
        warps, depth, extra = parse_variant(spec)
        for per_layer in (False, True) if not ("NOWAIT" in extra or "POLL_NS" in extra) else (False,):
            label = f"chain {spec}" + (" per layer" if per_layer else "")
            try:
                per = len(stage_names)
                groups = [order[i : i + per] for i in range(0, len(order), per)] if per_layer else [order]
                chains = [
                    Chain(
                        source,
                        [(n, gemvs[n][i], kwargs[n], outs[(n, i)]) for n, i in grp],
                        warps,
                        depth,
                        device,
                        extra,
                    )
                    for grp in groups
                ]
                for o in outs.values():
                    o.fill_(0)
                for c in chains:
                    c()
                torch.cuda.synchronize()
                err = compare([outs[key] for key in order], ref)
                report(label + f" [grid {chains[0].grid}, {chains[0].shared} B]", timed(chains), err)
            except Exception as exc:  # noqa: BLE001 (a variant that cannot run is reported)
                print(f"{label}: FAILED {type(exc).__name__}: {str(exc)[:300]}", flush=True)
                results["variants"].append({"variant": label, "error": str(exc)[:300]})
    report("product again (PDL)", timed(product_calls), None)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()

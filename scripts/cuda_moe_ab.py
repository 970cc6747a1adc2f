"""A/B of the one-token MoE on the GPU: the persistent CUDA kernel (--moe-backend cuda) and its
variants against the Triton GEMV path and Humming, timed in the same run, with correctness checks.

    python3 scripts/cuda_moe_ab.py [--rounds 3] [--variants "order=gate_up_first;evict_first=1"] [--trace]

Timing is the kernel benchmark's (solo.bench.kernels.Timer): 16 routings over disjoint experts
captured in one CUDA graph (400 MB of experts per replay, so L2 cannot hold them), median replay / 16.
Rounds alternate the implementations so clock drift hits all of them alike.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from solo.bench.kernels import Shapes, Timer, random_experts, routing_sets  # noqa: E402
from solo.kernels.cuda_moe import PersistentDecodeMoE  # noqa: E402
from solo.kernels.cuda_moe_plan import DecodeKernelConfig  # noqa: E402
from solo.kernels.moe import MXFP4Experts  # noqa: E402
from solo.kernels.triton_moe import TritonMoE  # noqa: E402
from solo.testing.moe import moe_reference_fp32  # noqa: E402


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


def parse_variants(text: str) -> list[tuple[str, DecodeKernelConfig]]:
    out = [("persistent", DecodeKernelConfig())]
    for spec in filter(None, (v.strip() for v in text.split(";"))):
        kw = {}
        for item in spec.split(","):
            k, v = item.split("=")
            field = {f.name: f for f in dataclasses.fields(DecodeKernelConfig)}[k.strip()]
            kw[k.strip()] = v.strip() if field.type == "str" else (int(v) if field.type == "int" else bool(int(v)))
        out.append((f"persistent[{spec}]", dataclasses.replace(DecodeKernelConfig(), **kw)))
    return out


def check(moe: PersistentDecodeMoE, experts: MXFP4Experts, dev, log, top_k=8, limit=None, id_dtype=torch.int64):
    """Fresh random inputs: persistent vs fp32 reference and vs the Triton GEMV; graph replay == eager."""
    for trial in range(3):
        ids = torch.randperm(experts.gate_up.shape[0], device=dev)[:top_k].view(1, top_k).to(id_dtype)
        w = torch.rand((1, top_k), device=dev) + 0.05
        x = torch.randn((1, moe.hidden), device=dev).to(torch.bfloat16)
        out = torch.full((1, moe.hidden), float("nan"), dtype=torch.bfloat16, device=dev)  # poisoned
        moe.forward(x, ids, w, out)
        tri = triton_forward(moe, x, ids, w)
        ref = moe_reference_fp32(experts, x, ids, w, limit)
        e_p, e_t = rel(out, ref), rel(tri, ref)
        log(f"  check {trial}: rel err persistent {e_p:.2e}, triton {e_t:.2e}, nan={bool(out.isnan().any())}")
        assert not out.isnan().any() and e_p < 1e-2, "persistent kernel disagrees with the reference"
    # graph replay equals eager, across launches (the launch tags advance)
    g = torch.cuda.CUDAGraph()
    out_g = torch.empty((1, moe.hidden), dtype=torch.bfloat16, device=dev)
    with torch.cuda.graph(g):
        moe.forward(x, ids, w, out_g)
    for _ in range(3):
        out_g.fill_(float("nan"))
        g.replay()
        torch.cuda.synchronize()
        eager = moe.forward(x, ids, w)
        assert torch.equal(out_g, eager), "graph replay differs from eager"
    log("  graph replays equal eager")


def triton_forward(moe: PersistentDecodeMoE, x, ids, w) -> torch.Tensor:
    """The same call on the Triton GEMV kernels (the backend's base class), same weights."""
    return TritonMoE.forward(moe, x, ids, w)


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--variants", default="")
    p.add_argument("--trace", nargs="?", const="", default=None, help="variant spec to trace (default: base)")
    p.add_argument("--trace-out", default="", help="save the raw per-block stamps and the schedule here")
    p.add_argument("--no-humming", action="store_true")
    p.add_argument("--checks-only", action="store_true")
    args = p.parse_args()
    dev = torch.device("cuda")
    log = lambda m: print(m, flush=True)  # noqa: E731
    log(f"device {torch.cuda.get_device_name(dev)}, torch {torch.__version__}")
    s = Shapes()
    experts = random_experts(s, dev)
    t0 = time.perf_counter()
    moe = PersistentDecodeMoE(experts)
    log(f"warm-up {moe.warmup(top_k=s.top_k, max_tokens=4)} ({time.perf_counter() - t0:.1f} s)")
    sched = moe.kernel_for(8, True)[1]
    log(
        f"schedule: {moe.blocks} blocks, <= {sched.max_gate_up} gate_up + {sched.max_down} down tiles, "
        f"bytes per block {min(sched.block_bytes)}..{sched.most_bytes}"
    )
    try:  # can a cooperative launch be captured into a CUDA graph here?
        g = torch.cuda.CUDAGraph()
        x, ids, w = routing_sets(s, 1, 1, dev)[0]
        with torch.cuda.graph(g):
            moe.forward(x, ids, w)
        g.replay()
        torch.cuda.synchronize()
        log("cooperative launch captured and replayed in a CUDA graph: ok")
    except Exception as exc:  # noqa: BLE001
        log(f"cooperative launch in a graph FAILED ({type(exc).__name__}: {exc}); continuing without it")
        moe.set_kernel_config(dataclasses.replace(moe.kernel_config, cooperative=False))
    log("checks (Ling shapes, int64 ids):")
    check(moe, experts, dev, log)

    # a second configuration: SwiGLU limit, int32 ids, top-6, fewer experts
    small = dataclasses.replace(s, experts=64)
    ex2 = random_experts(small, dev)
    moe2 = PersistentDecodeMoE(ex2, swiglu_limit=0.7)
    log("checks (limit 0.7, int32 ids, top-6):")
    check(moe2, ex2, dev, log, top_k=6, limit=0.7, id_dtype=torch.int32)
    del moe2, ex2
    if args.checks_only:
        return 0

    variants = parse_variants(args.variants)
    for name, kc in variants[1:]:
        moe.set_kernel_config(kc)
        log(f"checks {name}:")
        check(moe, experts, dev, log)
    hum = None
    if not args.no_humming:
        try:
            from solo.kernels.humming_moe import HummingMoE

            hum = HummingMoE(experts, dtype=torch.bfloat16)
            hum.warmup(s.top_k, (1,))
        except Exception as exc:  # noqa: BLE001
            log(f"humming unavailable: {type(exc).__name__}: {exc}")
    timer = Timer(dev)
    data = routing_sets(s, 1, 16, dev)
    results: dict[str, list[float]] = {}
    for r in range(args.rounds):
        results.setdefault("triton GEMV", []).append(timer([lambda d=d: triton_forward(moe, *d) for d in data]))
        for name, kc in variants:
            moe.set_kernel_config(kc)
            results.setdefault(name, []).append(timer([lambda d=d: moe.forward(*d) for d in data]))
        if hum is not None:
            results.setdefault("humming", []).append(timer([lambda d=d: hum.forward(*d) for d in data]))
        log(f"round {r}: " + ", ".join(f"{k} {v[-1]:.2f}" for k, v in results.items()))
    log("\none token x top-8, us per MoE (median of 20 graph replays / 16; rounds):")
    for k, v in results.items():
        log(f"  {k:48s} {statistics.median(v):7.2f}   [{', '.join(f'{t:.2f}' for t in v)}]")

    if args.trace is not None:
        traced = parse_variants(args.trace)[-1][1]
        moe.set_kernel_config(dataclasses.replace(traced, trace=True))
        log(f"trace of {traced}")
        moe.forward(*data[0])  # compile before capture
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for d in data:
                moe.forward(*d)
        g.replay()
        g.replay()
        torch.cuda.synchronize()
        tr = moe.trace.cpu()
        if args.trace_out:
            sched = moe.kernel_for(8, True)[1]
            torch.save({"trace": tr, "table": sched.table, "block_bytes": sched.block_bytes}, args.trace_out)
        start = tr[:, 0].min()
        rel_t = (tr - start).float() / 1000.0
        log("trace of the last op (us from the first block's start): min, median, max over blocks")
        names = ["start", "end", "first gate_up tile landed", "last gate_up tile published"]
        names += [f"act of slot pair {p} read" for p in range(4)]
        names += ["producer issued all copies", "(unused)", "last gate_up tile landed"]
        names += ["down products done"]
        for col in (0, 2, 10, 3, 4, 5, 6, 7, 8, 11, 1):
            c = rel_t[:, col]
            log(f"  {names[col]:30s}: {c.min():.2f} {c.median():.2f} {c.max():.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""A/B of the one-token MoE on the GPU: the persistent CUDA kernel (--moe-backend cuda) and its
variants against the Triton GEMV path and Humming, timed in the same run, with correctness checks.

    python3 dev/cuda_moe_ab.py [--rounds 3] [--variants "order=gate_up_first;evict_first=1"]
        [--trace "spec;probe=copy_only"] [--trace-out prefix]

Probes (DecodeKernelConfig.probe) time parts of the kernel and give wrong results by design.

Timing is the kernel benchmark's (solo.bench.kernels.Timer): 16 routings over disjoint experts
captured in one CUDA graph (400 MB of experts per replay, so L2 cannot hold them), median replay / 16.
Rounds alternate the implementations so clock drift hits all of them alike.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from solo.bench.kernels import Shapes, Timer, random_experts, routing_sets  # noqa: E402
from solo.kernels import cuda_moe  # noqa: E402
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


@contextlib.contextmanager
def baseline_kernel(moe: PersistentDecodeMoE, args):
    """Inside: moe's kernels are compiled from --baseline-source (with its extra shared memory)."""
    current, config = (cuda_moe.SOURCE, cuda_moe.SHARED_MEMORY_SLACK), moe.kernel_config
    cuda_moe.SOURCE = Path(args.baseline_source)
    cuda_moe.SHARED_MEMORY_SLACK = current[1] + args.baseline_extra_smem
    moe.set_kernel_config(DecodeKernelConfig())
    try:
        yield
    finally:
        cuda_moe.SOURCE, cuda_moe.SHARED_MEMORY_SLACK = current
        moe.set_kernel_config(config)  # (drops the baseline's compiled kernels)


def triton_forward(moe: PersistentDecodeMoE, x, ids, w) -> torch.Tensor:
    """The same call on the Triton GEMV kernels (the backend's base class), same weights."""
    return TritonMoE.forward(moe, x, ids, w)


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--variants", default="")
    p.add_argument("--trace", nargs="?", const="", default=None, help="';'-separated variants to trace")
    p.add_argument("--trace-out", default="", help="save raw stamps to PREFIX.i.pt")
    p.add_argument("--baseline-source", default="", help="also time this moe_decode.cu (an earlier build, same ABI)")
    p.add_argument("--baseline-extra-smem", type=int, default=0, help="bytes of shared memory its layout needs more")
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
        if kc.probe:
            log(f"{name}: a probe (wrong results by design), timing only")
            continue
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
    if args.baseline_source:
        with baseline_kernel(moe, args):
            log("checks (baseline source):")
            check(moe, experts, dev, log)
    results: dict[str, list[float]] = {}
    for r in range(args.rounds):
        results.setdefault("triton GEMV", []).append(timer([lambda d=d: triton_forward(moe, *d) for d in data]))
        if args.baseline_source:
            with baseline_kernel(moe, args):
                results.setdefault("baseline source", []).append(timer([lambda d=d: moe.forward(*d) for d in data]))
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
        specs = [v.strip() for v in args.trace.split(";")] if args.trace else [""]
        for i, spec in enumerate(specs):
            traced = parse_variants(spec)[-1][1]
            out = f"{args.trace_out}.{i}.pt" if args.trace_out else ""
            trace_report(moe, dataclasses.replace(traced, trace=True), data, log, out)
    return 0


# trace row slots, as moe_decode.cu defines them (T_*, C_*, N_POLLS0)
T_START, T_END, T_GROUP0, C_PAIR0, N_POLLS0, C_START, C_END = 0, 1, 16, 32, 48, 56, 57
TRACE_ROWS = [  # (slot, what it stamps)
    (0, "block start"),
    (13, "previous launch complete (griddepcontrol.wait)"),
    (9, "expert ids read"),
    (2, "first gate_up tile landed"),
    (8, "producer issued all copies"),
    (10, "last gate_up tile landed"),
    (3, "last gate_up tile published"),
    (4, "act of slot pair 0 staged"),
    (5, "act of slot pair 1 staged"),
    (6, "act of slot pair 2 staged"),
    (7, "act of slot pair 3 staged"),
    (11, "down products done"),
    (1, "block end"),
]


def trace_report(moe: PersistentDecodeMoE, kc: DecodeKernelConfig, data, log, out: str) -> None:
    """Per-block globaltimer stamps of the last of 16 graph-captured calls (and the gap after the one before)."""
    moe.set_kernel_config(kc)
    moe.trace.zero_()
    moe.forward(*data[0])  # compile before capture
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for d in data:
            moe.forward(*d)
    g.replay()
    g.replay()
    torch.cuda.synchronize()
    tr = moe.trace.cpu()
    last = int(tr[1, :, T_END].max() > tr[0, :, T_END].max())
    cur, prev = tr[last], tr[1 - last]
    sched = moe.kernel_for(8, True)[1]
    if out:
        torch.save({"trace": tr, "last": last, "table": sched.table, "block_bytes": sched.block_bytes}, out)
    start = cur[:, T_START].min()
    rel_t = (cur - start).double() / 1000.0
    log(f"trace of {kc}")
    log(f"  previous launch's last block ended {(prev[:, T_END].max() - start) / 1000.0:+.2f} us from this one's start")
    log("  us from the first block's start: min, median, max over blocks")
    for col, name in TRACE_ROWS:
        c = rel_t[:, col]
        if bool((cur[:, col] == 0).all()):
            continue
        log(f"  {name:48s}: {c.min():6.2f} {c.median():6.2f} {c.max():6.2f}")
    groups = sched.table[:, 0] + (sched.table[:, 1] > 0) * 4
    for q in range(int(groups.max())):
        have = groups > q
        c = rel_t[have, T_GROUP0 + q]
        name = f"copy group {q} complete ({int(have.sum())} blocks)"
        log(f"  {name:48s}: {c.min():6.2f} {c.median():6.2f} {c.max():6.2f}")
    nb = torch.tensor(sched.block_bytes, dtype=torch.float64)
    end = rel_t[:, T_END]
    for n_dn in sorted(set(sched.table[:, 1].tolist())):
        m = sched.table[:, 1] == n_dn
        log(
            f"  blocks with {n_dn} down tiles: {int(m.sum())}, bytes {int(nb[m].min())}..{int(nb[m].max())}, "
            f"end median {end[m].median():.2f} max {end[m].max():.2f}"
        )
    land = rel_t[:, T_GROUP0 : T_GROUP0 + int(groups.max())].max(dim=1).values
    corr = torch.corrcoef(torch.stack([land, nb]))[0, 1]
    log(f"  correlation of the last copy's landing with block bytes: {corr:.2f}")
    # warp 0's down steps per slot pair, in clock cycles
    ghz = ((cur[:, C_END] - cur[:, C_START]).double() / (cur[:, T_END] - cur[:, T_START]).double()).median()
    log(f"  SM clock {ghz:.2f} GHz; warp 0's down steps per slot pair, us (median, max over blocks):")
    have = cur[:, T_END] > 0
    for p in range(4):
        c = [cur[:, C_PAIR0 + 4 * p + k].double() for k in range(4)]
        nxt = cur[:, C_PAIR0 + 4 * (p + 1)].double() if p < 3 else None
        steps = {"stage wait": c[1] - c[0], "rows wait": c[2] - c[1], "products": c[3] - c[2]}
        if nxt is not None:
            steps["to next pair"] = nxt - c[3]
        text = ", ".join(
            f"{k} {(v[have] / ghz / 1000).median():.2f}/{(v[have] / ghz / 1000).max():.2f}" for k, v in steps.items()
        )
        polls = cur[have, N_POLLS0 + p].double()
        log(f"    pair {p}: {text}; poll rounds {polls.median():.0f}/{polls.max():.0f}")


if __name__ == "__main__":
    sys.exit(main())

"""Kernel micro-benchmarks at Ling-3.0-flash shapes, timed inside CUDA graphs.

    python -m solo.bench.kernels [--json out.json] [--tune] [--cases moe,lm_head,block]

Every op is captured R times in one CUDA graph (each capture on a different weight set, expert
set or input, so L2 (60 MB) cannot hide the DRAM traffic), the graph is replayed and timed with
CUDA events, and the median replay over R gives the time per op. The same run measures the
device copy bandwidth (one large device-to-device copy, bytes read + written), which is the
roofline each kernel's bytes/time is compared against.

Bytes per op are the fewest the op must move: the weights it reads in their own format (MXFP4
codes + E8M0 scales, FP8 + scales, BF16), its activations and its outputs.

``--tune`` sweeps the Triton launch configurations on this GPU and prints the best per case
(the defaults in solo.kernels.triton_moe / triton_fp8 come from such a run).
``--smoke`` runs tiny shapes on the CPU under TRITON_INTERPRET=1 (checks the script, not speed).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
import torch.nn.functional as F


@dataclass
class Shapes:
    hidden: int = 2560
    inter: int = 768
    experts: int = 512
    top_k: int = 8
    vocab: int = 157184
    kda_out: int = 4096
    extra_block: tuple[tuple[int, int], ...] = ((2560, 4096), (6144, 2560))  # (N, K): o_proj-like, dense up


SMOKE = Shapes(hidden=128, inter=64, experts=16, top_k=4, vocab=1000, kda_out=256, extra_block=((96, 256),))


@dataclass
class Row:
    case: str
    impl: str
    us: float
    bytes: int
    note: str = ""
    extra: dict[str, Any] = field(default_factory=dict)

    def gbps(self) -> float:
        return self.bytes / (self.us * 1e-6) / 1e9 if self.us > 0 else float("nan")


class Timer:
    """Times a list of R callables (one op each) captured into one CUDA graph."""

    def __init__(self, device: torch.device, replays: int = 20, warmup: int = 3) -> None:
        self.device = device
        self.cuda = device.type == "cuda"
        self.replays = replays
        self.warmup = warmup

    def __call__(self, fns: list[Callable[[], Any]]) -> float:
        """Median microseconds per op."""
        if not self.cuda:
            t0 = time.perf_counter()
            for f in fns:
                f()
            return (time.perf_counter() - t0) * 1e6 / len(fns)
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            for f in fns:  # eager warm-up (compiles, allocator pools) before capture
                f()
        torch.cuda.current_stream(self.device).wait_stream(stream)
        torch.cuda.synchronize(self.device)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for f in fns:
                f()
        for _ in range(self.warmup):
            graph.replay()
        torch.cuda.synchronize(self.device)
        times = []
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        for _ in range(self.replays):
            start.record()
            graph.replay()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) * 1000.0)
        del graph
        return statistics.median(times) / len(fns)


def copy_bandwidth(device: torch.device, nbytes: int, timer: Timer) -> Row:
    """Large device-to-device copy, timed eagerly with events (median of 10), bytes read + written."""
    a = torch.empty(nbytes // 4, dtype=torch.float32, device=device)
    a.uniform_()
    b = torch.empty_like(a)
    if device.type != "cuda":
        return Row("copy", "torch D2D copy", timer([lambda: b.copy_(a)]), 2 * a.nbytes)
    for _ in range(3):
        b.copy_(a)
    times = []
    for _ in range(10):
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        b.copy_(a)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1000.0)
    return Row("copy", "torch D2D copy", statistics.median(times), 2 * a.nbytes, f"{a.nbytes / 2**30:.1f} GiB buffer")


# ----------------------------------------------------------------------------------------- MoE


def random_experts(s: Shapes, device: torch.device):
    from solo.kernels.moe import MXFP4Experts

    e, h, i = s.experts, s.hidden, s.inter
    g = torch.Generator(device=device)
    g.manual_seed(1234)

    def codes(*shape):
        return torch.randint(0, 256, shape, dtype=torch.uint8, device=device, generator=g)

    def scales(*shape):
        return torch.randint(118, 124, shape, dtype=torch.uint8, device=device, generator=g)

    return MXFP4Experts(
        gate_up=codes(e, 2 * i, h // 2),
        gate_up_scale=scales(e, 2 * i, h // 32),
        down=codes(e, h, i // 2),
        down_scale=scales(e, h, i // 32),
    )


def moe_bytes(s: Shapes, distinct: int, tokens: int) -> dict[str, int]:
    h, i = s.hidden, s.inter
    gate_up = distinct * (2 * i * h // 2 + 2 * i * h // 32)
    down = distinct * (h * i // 2 + h * i // 32)
    act = tokens * s.top_k * i * 2
    return {
        "gate_up": gate_up + tokens * h * 2 + act,
        "down": down + act + tokens * h * 2,
        "total": gate_up + down + 2 * tokens * h * 2,
        "bf16_weights": distinct * 3 * h * i * 2,
    }


def routing_sets(s: Shapes, tokens: int, sets: int, device: torch.device):
    """`sets` routings of `tokens` tokens, each using tokens*top_k distinct experts."""
    per = tokens * s.top_k
    perm = torch.randperm(s.experts)
    out = []
    for r in range(sets):
        ids = perm[(torch.arange(per) + r * per) % s.experts].view(tokens, s.top_k).to(device)
        w = torch.rand((tokens, s.top_k)) + 0.05
        w = (w / w.sum(-1, keepdim=True) * 2.5).to(device)
        x = torch.randn((tokens, s.hidden)).to(device=device, dtype=torch.bfloat16)
        out.append((x, ids, w))
    return out


def dense_from_mxfp4(experts, device: torch.device, chunk: int = 32):
    from solo.kernels.moe import DenseExperts
    from solo.quantization.formats import dequantize_mxfp4

    e = experts.gate_up.shape[0]
    gu = torch.empty((e, experts.gate_up.shape[1], experts.gate_up.shape[2] * 2), dtype=torch.bfloat16, device=device)
    dn = torch.empty((e, experts.down.shape[1], experts.down.shape[2] * 2), dtype=torch.bfloat16, device=device)
    for j in range(0, e, chunk):
        gu[j : j + chunk] = dequantize_mxfp4(
            experts.gate_up[j : j + chunk], experts.gate_up_scale[j : j + chunk], torch.bfloat16
        )
        dn[j : j + chunk] = dequantize_mxfp4(
            experts.down[j : j + chunk], experts.down_scale[j : j + chunk], torch.bfloat16
        )
    return DenseExperts(gu, dn)


def bench_moe(
    s: Shapes,
    device: torch.device,
    timer: Timer,
    token_counts: list[int],
    sets: int,
    with_humming: bool,
    with_torch: bool,
    log: Callable[[str], None],
    l2_hot: bool = False,
) -> list[Row]:
    from solo.kernels.triton_moe import TritonMoE

    rows: list[Row] = []
    experts = random_experts(s, device)
    tri = TritonMoE(experts, dtype=torch.bfloat16)
    # Both kernel families at every token count (the engine's choice is marked): the tensor-core
    # kernels forced for small T, the GEMV kernels allowed for large T.
    tri_mma = TritonMoE(experts, config=dataclasses.replace(tri.config, gemv_max_tokens=0))
    most = max(token_counts)
    tri_gemv = TritonMoE(experts, config=dataclasses.replace(tri.config, gemv_max_tokens=max(most, 1)))
    log(f"triton warm-up: {tri.warmup(top_k=s.top_k, max_tokens=most)}")
    tri_mma.warmup(top_k=s.top_k, max_tokens=most)
    tri_gemv.warmup(top_k=s.top_k, max_tokens=most)
    persistent = None
    if 1 in token_counts and device.type == "cuda" and torch.cuda.get_device_capability(device)[0] >= 9:
        try:  # --moe-backend cuda: the one-token call as one persistent CUDA kernel (same packed weights)
            from solo.kernels.cuda_moe import PersistentDecodeMoE

            persistent = PersistentDecodeMoE(experts, dtype=torch.bfloat16)
            log(f"persistent decode kernel warm-up: {persistent.warmup(top_k=s.top_k, max_tokens=1)}")
        except Exception as exc:  # noqa: BLE001 - report and continue
            log(f"persistent decode kernel unavailable: {type(exc).__name__}: {exc}")
    hum = None
    if with_humming:
        try:
            from solo.kernels.humming_moe import HummingMoE

            t0 = time.perf_counter()
            hum = HummingMoE(experts, dtype=torch.bfloat16)
            made = time.perf_counter() - t0
            log(f"humming transform {made:.1f}s; warm-up {hum.warmup(s.top_k, tuple(token_counts))}")
        except Exception as exc:  # noqa: BLE001 - report and continue
            log(f"humming unavailable: {type(exc).__name__}: {exc}")
    ref = None
    if with_torch:
        try:
            from solo.kernels.moe import TorchMoE

            ref = TorchMoE(dense_from_mxfp4(experts, device), torch.bfloat16)
        except Exception as exc:  # noqa: BLE001
            log(f"torch reference unavailable: {type(exc).__name__}: {exc}")
    for t in token_counts:
        data = routing_sets(s, t, sets, device)
        if l2_hot:  # the same experts in every captured op: they stay in L2 (not a decode step's case)
            data = [data[0]] * len(data)
        distinct = min(t * s.top_k, s.experts)
        nb = moe_bytes(s, distinct, t)
        case = f"MoE {t} tok" + (" L2-hot" if l2_hot else "")
        # Complete Triton path (the one the engine uses for T tokens), then the other path.
        k = s.top_k
        acts = [torch.empty((t * k, s.inter), dtype=torch.bfloat16, device=device) for _ in data]
        outs = [torch.empty((t, s.hidden), dtype=torch.bfloat16, device=device) for _ in data]
        flat = [(x, ids.reshape(-1).contiguous(), w.reshape(-1).contiguous()) for x, ids, w in data]
        tri_row = None
        other = tri_mma if tri.uses_gemv(t) else tri_gemv
        for moe in sorted((tri, other), key=lambda m: not m.uses_gemv(t)):
            gemv = moe.uses_gemv(t)
            path = "CUDA-core GEMV" if gemv else "grouped tensor-core"
            us = timer([lambda d=d, moe=moe: moe.forward(*d) for d in data])
            split = moe.down_split(t, s.top_k)
            note = (f"down split E/{split}" if gemv else "") + ("; engine default" if moe is tri else "")
            parts = "2 kernels" if gemv else "tables, 2 kernels, sum"
            row = Row(case, f"triton {path} ({parts})", us, nb["total"], note)
            if moe is tri:
                tri_row = row
            rows.append(row)
            if not gemv:  # the grouped path's kernels share routing tables: timed as a whole only
                continue
            us = timer(
                [
                    lambda f=f, a=a, k=k, moe=moe: moe.launch_gemv_gate_up(f[0], f[1], a, k)
                    for f, a in zip(flat, acts, strict=True)
                ]
            )
            rows.append(Row(case, f"  {path} gate_up+act", us, nb["gate_up"]))
            us = timer(
                [
                    lambda f=f, a=a, o=o, k=k, moe=moe: moe.launch_gemv_down(a, f[1], f[2], o, k)
                    for f, a, o in zip(flat, acts, outs, strict=True)
                ]
            )
            rows.append(Row(case, f"  {path} down+combine", us, nb["down"]))
        assert tri_row is not None
        persistent_row = None
        if persistent is not None and t == 1:
            us = timer([lambda d=d: persistent.forward(*d) for d in data])
            persistent_row = Row(case, "cuda persistent kernel (1 launch; --moe-backend cuda)", us, nb["total"])
            rows.append(persistent_row)
        if hum is not None:
            try:
                us = timer([lambda d=d: hum.forward(*d) for d in data])
                rows.append(Row(case, "humming (complete)", us, nb["total"]))
                hs = [torch.empty((t, s.hidden), dtype=torch.bfloat16, device=device) for _ in data]
                us = timer([lambda d=d, k=k: hum._gemm("gate_up", d[0], d[1], k) for d in data])
                tables = "constant tables" if t * k <= hum.small_call_assignments else "incl. sorting the routing"
                rows.append(Row(case, "  humming gate_up GEMM", us, nb["gate_up"], tables))
                acts_h = [torch.randn((t * k, s.inter), device=device).to(torch.bfloat16) for _ in data]
                us = timer([lambda d=d, a=a: hum._gemm("down", a, d[1], 1) for d, a in zip(data, acts_h, strict=True)])
                rows.append(Row(case, "  humming down GEMM", us, nb["down"], tables))
                del hs
            except Exception as exc:  # noqa: BLE001
                log(f"humming timing failed: {type(exc).__name__}: {exc}")
        if ref is not None:
            try:
                us = timer([lambda d=d: ref.forward(*d) for d in data[: max(2, sets // 4)]])
                rows.append(
                    Row(
                        case,
                        "torch reference (bf16 gather)",
                        us,
                        nb["bf16_weights"],
                        "reads its bf16 copy of the experts",
                    )
                )
            except Exception as exc:  # noqa: BLE001
                log(f"torch reference timing failed: {type(exc).__name__}: {exc}")
        # correctness spot check on the last set against the fp32 reference, on its first 16 tokens
        # (the reference dequantizes the experts of every assignment it checks)
        x, ids, w = data[-1]
        m = min(t, 16)
        from solo.quantization.formats import dequantize_mxfp4

        flat_ids = ids[:m].reshape(-1)
        gu = dequantize_mxfp4(experts.gate_up[flat_ids], experts.gate_up_scale[flat_ids])
        dn = dequantize_mxfp4(experts.down[flat_ids], experts.down_scale[flat_ids])
        hh = torch.einsum("ah,aoh->ao", x[:m].float().repeat_interleave(k, 0), gu)
        act = F.silu(hh[:, : s.inter]) * hh[:, s.inter :]
        y = (torch.einsum("ai,ahi->ah", act, dn).view(m, k, -1) * w[:m, :, None]).sum(1)
        del gu, dn, hh, act
        out = tri.forward(x, ids, w)[:m]
        err = float((out.float() - y).norm() / y.norm())
        tri_row.extra["rel_err_vs_fp32"] = err
        log(f"{case}: triton rel err vs fp32 reference {err:.2e}")
        oerr = float((other.forward(x, ids, w)[:m].float() - y).norm() / y.norm())
        log(f"{case}: triton {'grouped' if tri.uses_gemv(t) else 'GEMV'} (not the default here) rel err {oerr:.2e}")
        if persistent_row is not None:
            perr = float((persistent.forward(x, ids, w)[:m].float() - y).norm() / y.norm())
            persistent_row.extra["rel_err_vs_fp32"] = perr
            log(f"{case}: cuda persistent kernel rel err vs fp32 reference {perr:.2e}")
        if hum is not None:
            herr = float((hum.forward(x, ids, w)[:m].float() - y).norm() / y.norm())
            log(f"{case}: humming rel err vs fp32 reference {herr:.2e}")
    return rows


def launch_floor(device: torch.device, timer: Timer, programs: tuple[int, ...]) -> list[Row]:
    """Empty Triton kernels in the same graph harness: the fixed cost a kernel of that grid pays.

    One kernel per grid in ``programs`` and the chain of all of them (dependent launches, like the
    MoE's two kernels), so the MoE rows can be read against the time launches alone take.
    """
    import triton
    import triton.language as tl

    @triton.jit
    def _touch(out_ptr):
        # One store per program so the launch cannot be optimised away.
        tl.store(out_ptr + tl.program_id(0), tl.program_id(0))

    outs = [torch.empty(max(programs), dtype=torch.int32, device=device) for _ in range(16)]
    rows = []
    for n in programs:
        us = timer([lambda o=o, n=n: _touch[(n,)](o) for o in outs])
        rows.append(Row("launch floor", f"empty kernel, {n} programs", us, 4 * n))
    us = timer([lambda o=o: [_touch[(n,)](o) for n in programs] for o in outs])
    rows.append(Row("launch floor", f"{len(programs)} empty kernels in a row", us, 4 * sum(programs)))
    return rows


# ----------------------------------------------------------------------------------------- FP8


def fp8_weights(n: int, k: int, device: torch.device, sets: int, block: bool):
    out = []
    for _ in range(sets):
        w = (torch.randn((n, k), device=device, dtype=torch.bfloat16) * 64).to(torch.float8_e4m3fn)
        if block:
            s = torch.rand((math.ceil(n / 128), math.ceil(k / 128)), device=device) * 1e-3 + 1e-4
        else:
            s = torch.rand((n,), device=device) * 1e-3 + 1e-4
        out.append((w, s))
    return out


def fp8_bytes(n: int, k: int, t: int, block: bool, weight_bytes: int = 1) -> int:
    scales = math.ceil(n / 128) * math.ceil(k / 128) * 4 if block else n * 4
    return n * k * weight_bytes + (scales if weight_bytes == 1 else 0) + t * k * 2 + t * n * 2


def bench_fp8(s: Shapes, device: torch.device, timer: Timer, log: Callable[[str], None], cases: list[str]) -> list[Row]:
    from solo.kernels.triton_fp8 import fp8_block_linear, fp8_rowwise_linear, warmup_fp8_linear

    rows: list[Row] = []
    l2_sets = 1
    if "lm_head" in cases:
        n, k = s.vocab, s.hidden
        log(f"lm_head warm-up {warmup_fp8_linear('rowwise', n, k, device)}")
        sets = 2 if device.type == "cuda" else 1  # 400 MB each: far larger than L2
        ws = fp8_weights(n, k, device, sets, block=False)
        for t in (1, 4):
            case = f"LM head {n}x{k} T={t}"
            xs = [torch.randn((t, k), device=device).to(torch.bfloat16) for _ in ws]
            fns = [lambda w=w, x=x: fp8_rowwise_linear(x, w[0], w[1]) for w, x in zip(ws, xs, strict=True)]
            rows.append(Row(case, "triton fp8 rowwise", timer(fns * 2), fp8_bytes(n, k, t, False)))
            wb = ws[0][0].to(torch.bfloat16)
            fns = [lambda x=x, wb=wb: F.linear(x, wb) for x in xs] * 2
            rows.append(Row(case, "torch bf16 F.linear (cuBLAS)", timer(fns), fp8_bytes(n, k, t, False, 2)))
            del wb
            if device.type == "cuda":
                try:
                    xq = torch.randn((16, k), device=device).to(torch.float8_e4m3fn)
                    sa = torch.ones((16, 1), device=device)
                    fns = [
                        lambda w=w, xq=xq, sa=sa: torch._scaled_mm(
                            xq, w[0].t(), scale_a=sa, scale_b=w[1].view(1, -1), out_dtype=torch.bfloat16
                        )
                        for w in ws
                    ]
                    rows.append(
                        Row(
                            case,
                            "torch._scaled_mm fp8 (16 rows)",
                            timer(fns * 2),
                            fp8_bytes(n, k, 16, False),
                            "activations pre-quantized to fp8, padded to 16",
                        )
                    )
                except Exception as exc:  # noqa: BLE001
                    log(f"_scaled_mm rowwise failed: {type(exc).__name__}: {exc}")
        del ws
    if "block" in cases:
        shapes = [(s.kda_out, s.hidden)] + list(s.extra_block)
        for si, (n, k) in enumerate(shapes):
            log(f"block fp8 warm-up {warmup_fp8_linear('block', n, k, device)}")
            per_set = n * k
            sets = max(l2_sets, math.ceil(4 * 60e6 / per_set)) if device.type == "cuda" else 1
            ws = fp8_weights(n, k, device, sets, block=True)
            for t in (1, 4) if si == 0 else (1,):
                case = f"block-FP8 {k}->{n} T={t}"
                xs = [torch.randn((t, k), device=device).to(torch.bfloat16) for _ in ws]
                fns = [lambda w=w, x=x: fp8_block_linear(x, w[0], w[1]) for w, x in zip(ws, xs, strict=True)]
                rows.append(Row(case, "triton fp8 block", timer(fns), fp8_bytes(n, k, t, True)))
                if si == 0:
                    wbs = [w[0].to(torch.bfloat16) for w in ws]
                    fns = [lambda w=w, x=x: F.linear(x, w) for w, x in zip(wbs, xs, strict=True)]
                    rows.append(Row(case, "torch bf16 F.linear (cuBLAS)", timer(fns), fp8_bytes(n, k, t, True, 2)))
                    del wbs
            del ws
    return rows


# ----------------------------------------------------------------------------------------- tuning


def tune(
    s: Shapes, device: torch.device, timer: Timer, log: Callable[[str], None], cases: list[str], quick: bool
) -> dict[str, Any]:
    from solo.kernels.triton_fp8 import Fp8Config, fp8_block_linear, fp8_rowwise_linear
    from solo.kernels.triton_moe import MoEConfig, TritonMoE

    results: dict[str, Any] = {}

    def sweep(name: str, candidates: list[Any], run: Callable[[Any], float]) -> None:
        best = None
        table = []
        for cand in candidates:
            try:
                us = run(cand)
            except Exception as exc:  # noqa: BLE001 - a config may not compile
                log(f"  {name} {cand}: FAILED {type(exc).__name__}: {str(exc).splitlines()[0][:160]}")
                continue
            table.append((us, cand))
            if best is None or us < best[0]:
                best = (us, cand)
        table.sort(key=lambda r: r[0])
        for us, cand in table[:5]:
            shown = cand
            if name.startswith("gemv") and hasattr(cand, "__dataclass_fields__"):
                shown = {k: v for k, v in asdict(cand).items() if k.startswith("gv_")}
            log(f"  {name} {us:8.2f} us  {shown}")
        if best:
            results[name] = {
                "us": best[0],
                "config": asdict(best[1]) if hasattr(best[1], "__dataclass_fields__") else best[1],
            }

    if "moe" in cases:  # the grouped (prefill) path, timed whole at prefill-like token counts
        experts = random_experts(s, device)
        for t in (64, 512):
            data = routing_sets(s, t, 4, device)
            cands = [
                MoEConfig(
                    gemv_max_tokens=0,
                    pf_block_i=bi,
                    pf_block_h=bh,
                    pf_block_k=bk,
                    pf_warps=warps,
                    pf_stages=stages,
                    pf_f16=f16,
                )
                for bi, bh in (((64, 64), (128, 128)) if quick else ((32, 32), (64, 64), (128, 128)))
                for bk in (128, 256)
                for warps in (4, 8)
                for stages in ((3,) if quick else (2, 3, 4))
                for f16 in (True, False)
            ]

            def run_grouped(cfg: MoEConfig, data=data) -> float:
                moe = TritonMoE(experts, config=cfg)
                return timer([lambda d=d, moe=moe: moe.forward(*d) for d in data])

            log(f"tuning MoE grouped path T={t}")
            sweep(f"moe_grouped_T{t}", cands, run_grouped)
        del experts
    if "gemv" in cases:  # the CUDA-core MoE path (T <= gemv_max_tokens)
        experts = random_experts(s, device)
        moe = TritonMoE(experts)
        k = s.top_k
        base = MoEConfig()
        for t in (1, 4):
            data = routing_sets(s, t, 16, device)
            flat = [(x, ids.reshape(-1).contiguous(), w.reshape(-1).contiguous()) for x, ids, w in data]
            acts = [torch.empty((t * k, s.inter), dtype=torch.bfloat16, device=device) for _ in data]
            outs = [torch.empty((t, s.hidden), dtype=torch.bfloat16, device=device) for _ in data]
            gu_cands = [  # the K loop is unrolled: num_stages has no loop to pipeline
                dataclasses.replace(base, gv_gu_block_n=bn, gv_gu_block_w=bw, gv_gu_warps=warps)
                for bn in (4, 8, 16, 32)
                for bw in (32, 64, 128)
                for warps in (2, 4, 8)
                if not quick or warps == 4
            ]

            def run_gv_gu(cfg: MoEConfig, flat=flat, acts=acts) -> float:
                moe.config = cfg
                moe._scratch.clear()
                launch = moe.launch_gemv_gate_up
                return timer([lambda f=f, a=a: launch(f[0], f[1], a, k) for f, a in zip(flat, acts, strict=True)])

            log(f"tuning MoE GEMV gate_up T={t}")
            sweep(f"gemv_gate_up_T{t}", gu_cands, run_gv_gu)
            dn_cands = [
                dataclasses.replace(base, gv_dn_block_n=bn, gv_dn_block_w=bw, gv_dn_split_e=se, gv_dn_warps=warps)
                for bn in (16, 32, 64)
                for bw in (32, 64)
                for se in (2, 4, 8)
                for warps in (2, 4)
                if not quick or warps == 4
            ]

            def run_gv_dn(cfg: MoEConfig, flat=flat, acts=acts, outs=outs) -> float:
                moe.config = cfg
                moe._scratch.clear()
                return timer(
                    [
                        lambda f=f, a=a, o=o: moe.launch_gemv_down(a, f[1], f[2], o, k)
                        for f, a, o in zip(flat, acts, outs, strict=True)
                    ]
                )

            log(f"tuning MoE GEMV down T={t}")
            sweep(f"gemv_down_T{t}", dn_cands, run_gv_dn)
        del experts, moe
    if "lm_head" in cases:
        n, kk = s.vocab, s.hidden
        ws = fp8_weights(n, kk, device, 1, block=False)
        for t in (1, 4):
            x = torch.randn((t, kk), device=device).to(torch.bfloat16)
            cands = [
                Fp8Config(bn, bk, bt, lhs, warps, st)
                for bn in (32, 64, 128)
                for bk in (128, 256)
                for bt in (16,)
                for lhs in (True, False)
                for warps in (4,)
                for st in (3, 5)
            ]
            cands += [
                Fp8Config(64, 256, 8, True, 4, 4),
                Fp8Config(128, 128, 16, True, 8, 4),
                Fp8Config(64, 512, 16, True, 4, 3),
                Fp8Config(128, 256, 16, True, 8, 3),
            ]
            log(f"tuning LM head T={t}")
            sweep(
                f"lm_head_T{t}",
                cands,
                lambda c, x=x: timer([lambda: fp8_rowwise_linear(x, ws[0][0], ws[0][1], config=c)] * 4),
            )
        del ws
    if "block" in cases:
        for n, kk in [(s.kda_out, s.hidden)] + ([] if quick else list(s.extra_block)):
            sets = max(1, math.ceil(4 * 60e6 / (n * kk)))
            ws = fp8_weights(n, kk, device, sets, block=True)
            for t in (1, 4):
                x = torch.randn((t, kk), device=device).to(torch.bfloat16)
                cands = [
                    Fp8Config(bn, bk, 16, True, warps, st, split)
                    for bn in (16, 32, 64)
                    for bk in (64, 128)
                    for warps in (2, 4)
                    for st in (3, 6)
                    for split in (1, 2, 4, 8)
                ]
                log(f"tuning block fp8 {kk}->{n} T={t}")
                sweep(
                    f"block_{n}x{kk}_T{t}",
                    cands,
                    lambda c, x=x, ws=ws: timer([lambda w=w: fp8_block_linear(x, w[0], w[1], config=c) for w in ws]),
                )
            del ws
    return results


# ----------------------------------------------------------------------------------------- main


def print_table(rows: list[Row], bw: float, log: Callable[[str], None]) -> None:
    log(f"{'case':<30} {'implementation':<32} {'time us':>9} {'MB':>9} {'GB/s':>8} {'roofline':>8}")
    for r in rows:
        frac = r.gbps() / bw if bw else float("nan")
        log(
            f"{r.case:<30} {r.impl:<32} {r.us:9.2f} {r.bytes / 1e6:9.2f} {r.gbps():8.0f} {frac:8.1%}"
            + (f"  ({r.note})" if r.note else "")
        )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m solo.bench.kernels", description=__doc__.split("\n\n")[0])
    p.add_argument("--json", help="write all measurements to this file")
    p.add_argument("--cases", default="moe,lm_head,block", help="comma list of moe, lm_head, block (--tune also: gemv)")
    p.add_argument("--tokens", default="1,4", help="MoE token counts")
    p.add_argument("--sets", type=int, default=16, help="routings / weight sets rotated per graph")
    p.add_argument("--replays", type=int, default=20)
    p.add_argument("--no-humming", action="store_true")
    p.add_argument(
        "--l2-hot",
        action="store_true",
        help="MoE: reuse one routing in every captured op, so the experts sit in L2 (to compare with "
        "numbers measured that way; decode reads cold experts)",
    )
    p.add_argument("--no-torch", action="store_true", help="skip the torch MoE reference (needs 6 GB)")
    p.add_argument("--tune", action="store_true", help="sweep Triton launch configurations")
    p.add_argument("--quick", action="store_true", help="smaller tuning sweep")
    p.add_argument("--smoke", action="store_true", help="tiny shapes on CPU (TRITON_INTERPRET=1)")
    args = p.parse_args(argv)

    lines: list[str] = []

    def log(msg: str) -> None:
        print(msg, flush=True)
        lines.append(msg)

    if args.smoke:
        os.environ.setdefault("TRITON_INTERPRET", "1")
        device = torch.device("cpu")
        shapes = SMOKE
    else:
        if not torch.cuda.is_available():
            print("solo.bench.kernels needs a CUDA GPU (use --smoke for a CPU dry run)", file=sys.stderr)
            return 2
        device = torch.device("cuda")
        shapes = Shapes()
    cases = [c.strip() for c in args.cases.split(",") if c.strip()]
    timer = Timer(device, replays=args.replays)
    torch.manual_seed(0)
    info: dict[str, Any] = {"torch": torch.__version__, "argv": sys.argv if argv is None else argv}
    try:
        import triton

        info["triton"] = triton.__version__
    except ImportError:
        pass
    if device.type == "cuda":
        info["device"] = torch.cuda.get_device_name()
        info["sms"] = torch.cuda.get_device_properties(0).multi_processor_count
    log(f"devices/versions: {info}")

    result: dict[str, Any] = {"info": info}
    if args.tune:
        result["tune"] = tune(shapes, device, timer, log, cases, args.quick)
        if args.json:
            with open(args.json, "w") as f:
                json.dump({**result, "log": lines}, f, indent=1)
        return 0

    copy = copy_bandwidth(device, (2 << 30) if device.type == "cuda" else (1 << 20), timer)
    bw = copy.gbps()
    log(f"device copy bandwidth: {bw:.0f} GB/s (read + write)")
    rows = [copy]
    if "moe" in cases:
        tokens = [int(t) for t in args.tokens.split(",")]
        try:
            # the GEMV MoE's grids at one token: gate_up 8 x 768/8, down 2560/32 x 8 splits
            rows += launch_floor(device, timer, (768, 640))
        except Exception:  # noqa: BLE001
            log("launch floor failed:\n" + traceback.format_exc())
        try:
            rows += bench_moe(
                shapes,
                device,
                timer,
                tokens,
                args.sets if device.type == "cuda" else 2,
                with_humming=not args.no_humming and device.type == "cuda",
                with_torch=not args.no_torch,
                log=log,
                l2_hot=args.l2_hot,
            )
        except Exception:  # noqa: BLE001 - keep measuring the other cases
            log("MoE benchmark failed:\n" + traceback.format_exc())
        if device.type == "cuda":
            torch.cuda.empty_cache()
    try:
        rows += bench_fp8(shapes, device, timer, log, cases)
    except Exception:  # noqa: BLE001
        log("FP8 benchmark failed:\n" + traceback.format_exc())
    from solo.kernels.triton_fp8 import kernel_cache_report

    result["kernel_cache"] = kernel_cache_report()
    log(f"kernel cache: {json.dumps(result['kernel_cache'])}")
    print_table(rows, bw, log)
    result["copy_GBps"] = bw
    result["rows"] = [{**asdict(r), "GBps": r.gbps(), "roofline_fraction": r.gbps() / bw} for r in rows]
    if args.json:
        with open(args.json, "w") as f:
            json.dump({**result, "log": lines}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""A/B of one token's MoE router: its own kernel (router_decode.cu) then the persistent MoE kernel,
against the router inside the persistent MoE kernel (moe_decode.cu ROUTER), at Ling-3.0-flash shapes
(512 experts in 8 groups keep 4, top-8, H 2560, I 768), with a per-block trace of the fused one.

    python3 dev/moe_router_ab.py [--rounds 3] [--calls 16] [--score-poll-ns 64,0,200] [--fast-select]
        [--configs 'down_after=0;bias_early=0,down_after=0']

Each side: `--calls` different tokens, router then experts, captured in one CUDA graph (every call
chooses its experts from its own x, so most are not in the L2), median replay / calls; rounds
alternate the sides. The choices are checked: the same experts, the same weights within fp32
rounding, the same routed output (the fused kernel's own routing given to the plain kernel).
`--configs` adds DecodeKernelConfig variants (fields=integers or names, e.g. balance=gate_up; ';' between
variants) that move no result (copy timing, reads moved before the wait, the selection's shortcut): each
checked bit for bit against the product's kernel (experts, weights, output), timed and traced; a probe
(DecodeKernelConfig.probe) leaves out work, so it is timed and traced unchecked (not `copy_only`, which has no gate_up
warps to route with: the kernel with the router inside refuses it).
`--fast-select` and `--bias-early` are
shorthands for the product without those switches ('fast_select=0': the full ranking; 'bias_early=0').
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from solo.bench.kernels import Timer  # noqa: E402
from solo.kernels.cuda_moe import PersistentDecodeMoE  # noqa: E402
from solo.kernels.cuda_moe_plan import DecodeKernelConfig, decode_schedule  # noqa: E402
from solo.kernels.cuda_step import CudaRouter  # noqa: E402
from solo.kernels.fused_router import FusedRouter  # noqa: E402
from solo.testing.moe import random_mxfp4_experts  # noqa: E402

H, I, E, TOPK = 2560, 768, 512, 8
TRACE_ROWS = [  # (slot, what it stamps), moe_decode.cu T_*
    (0, "block start"),
    (13, "previous launch complete (griddepcontrol.wait)"),
    (14, "x normalised"),
    (15, "this block's scores published"),
    (55, "the selection's second run begins (select_twice)"),
    (30, "thread 0's score and bias in hand"),
    (52, "first selection warp with all its scores"),
    (53, "last selection warp with all its scores"),
    (28, "every score seen"),
    (31, "the warps' best written"),
    (27, "thread 0's candidate ranked"),
    (58, "every candidate's place written"),
    (29, "selection done"),
    (9, "producer has the experts"),
    (2, "first gate_up tile landed"),
    (10, "last gate_up tile landed"),
    (3, "last gate_up tile published"),
    (59, "early pairs' activations staged (down warps)"),
    (60, "early pairs' down products handed over"),
    (4, "slot pair 0's activations staged"),
    (5, "slot pair 1's activations staged"),
    (6, "slot pair 2's activations staged"),
    (7, "slot pair 3's activations staged"),
    (11, "down products done"),
    (1, "block end"),
]


def _value(text: str) -> int | str:
    """A --configs field's value: an integer, or a name (DecodeKernelConfig.balance, .order)."""
    text = text.strip()
    return int(text) if text.lstrip("-").isdigit() else text


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--calls", type=int, default=16)
    p.add_argument(
        "--score-poll-ns",
        default="64",
        help="comma-separated back-offs between polls of the exchanged scores, each timed as a variant",
    )
    p.add_argument("--fast-select", action="store_true", help="also the full ranking ('fast_select=0')")
    p.add_argument("--bias-early", action="store_true", help="also the biases read after the wait ('bias_early=0')")
    p.add_argument("--configs", default="", help="DecodeKernelConfig variants, e.g. 'x_early=0;down_after=0'")
    p.add_argument(
        "--per-block",
        action="store_true",
        help="also, per traced call: what the blocks whose last gate_up tile lands late have in common",
    )
    args = p.parse_args()
    specs = args.configs.split(";") + ["fast_select=0"] * args.fast_select + ["bias_early=0"] * args.bias_early
    configs = {
        spec.strip(): {k.strip(): _value(v) for k, v in (kv.split("=") for kv in spec.split(","))}
        for spec in specs
        if spec.strip()
    }
    dev = torch.device("cuda")
    print(f"device {torch.cuda.get_device_name()}, torch {torch.__version__}")
    experts = random_mxfp4_experts(E, H, I, scales=(116, 126))
    moe = PersistentDecodeMoE(experts, swiglu_limit=7.0)
    counters = torch.zeros(4, dtype=torch.int32, device=dev)
    fused = FusedRouter(
        (torch.randn(E, H, device=dev) * 0.02).to(torch.bfloat16),
        torch.randn(E, device=dev) * 0.01,
        (1 + 0.1 * torch.randn(H, device=dev)).to(torch.bfloat16),
        1e-6,
        TOPK,
        8,
        4,
        True,
        2.5,
        counters[0:1],
    )
    separate = CudaRouter(fused, counters[1:2], max_tokens=1)
    xs = [(3 * torch.randn(1, H, device=dev)).to(torch.bfloat16) for _ in range(args.calls)]

    def plain(x):
        xn, ids, wts = separate(x)
        return moe.forward(xn, ids, wts)

    def inside(x):
        return moe.routed_forward(x, fused, counters[2:3])

    same = 0
    for x in xs:
        out, xn, ids, wts = inside(x)
        xn_s, ids_s, wts_s = separate(x)
        if torch.equal(ids, ids_s):
            same += 1
            assert float((wts - wts_s).abs().max()) < 1e-5
        assert torch.equal(out, moe.forward(xn, ids, wts)), "the fused routing's experts differ from the plain kernel's"
    print(f"checks: the same experts in {same} of {len(xs)} calls (others: ties within fp32 rounding of the scores)")

    timer = Timer(dev)
    polls = [int(v) for v in args.score_poll_ns.split(",")]
    variants = {
        f"router inside the MoE kernel{'' if i == 0 else f' [score_poll_ns={v}]'}": DecodeKernelConfig(score_poll_ns=v)
        for i, v in enumerate(polls)
    }
    for spec, fields in configs.items():  # none moves a result: the product's outputs bit for bit
        # (select_twice, a probe of the traced kernel, is checked and timed traced)
        config = DecodeKernelConfig(**{"score_poll_ns": polls[0], "trace": bool(fields.get("select_twice")), **fields})
        if config.probe:  # (a probe leaves out work: wrong results by design, timed and traced only)
            print(f"checks: {spec} is a probe (wrong results by design), timing only")
            variants[f"router inside the MoE kernel [{spec}]"] = config
            continue
        for x in xs:
            moe.set_kernel_config(DecodeKernelConfig(score_poll_ns=polls[0]))
            want = [t.clone() for t in inside(x)]
            moe.set_kernel_config(config)
            assert all(torch.equal(a, b) for a, b in zip(inside(x), want, strict=True)), f"{spec} differs"
        print(f"checks: {spec} equals the product's kernel in {len(xs)} of {len(xs)} calls")
        variants[f"router inside the MoE kernel [{spec}]"] = config
    results: dict[str, list[float]] = {"router kernel + MoE kernel": [], **{name: [] for name in variants}}
    for r in range(args.rounds):
        moe.set_kernel_config(DecodeKernelConfig(score_poll_ns=polls[0]))
        results["router kernel + MoE kernel"].append(timer([lambda x=x: plain(x) for x in xs]))
        for name, config in variants.items():
            moe.set_kernel_config(config)
            results[name].append(timer([lambda x=x: inside(x) for x in xs]))
        print(f"round {r}: " + ", ".join(f"{k} {v[-1]:.2f}" for k, v in results.items()))
    print(f"\none token, us per router + MoE (median of replays / {args.calls}; rounds):")
    for k, v in results.items():
        print(f"  {k:52s} {statistics.median(v):7.2f}   {[round(t, 2) for t in v]}")

    traced = {"": DecodeKernelConfig(trace=True, score_poll_ns=polls[0])}
    for spec, fields in configs.items():
        traced[f" ({spec})"] = DecodeKernelConfig(**{"score_poll_ns": polls[0], **fields, "trace": True})
    for label, config in traced.items():
        moe.set_kernel_config(config)
        inside(xs[0])
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for x in xs:
                inside(x)
        graph.replay()
        torch.cuda.synchronize()
        tr = moe.trace.cpu()
        last = int(tr[1, :, 1].max() > tr[0, :, 1].max())
        cur = tr[last]
        start = cur[:, 0].min()
        rel_t = (cur - start).double() / 1000.0
        print(f"\ntrace of the last fused call{label} (us from the first block's start: min, median, max over blocks)")
        print(f"  previous call's last block ended {(tr[1 - last][:, 1].max() - start) / 1000.0:+.2f} us from it")
        for col, name in TRACE_ROWS:
            c = rel_t[:, col]
            if bool((cur[:, col] == 0).all()):
                continue
            c = c[(cur[:, col] > 0) & (c > -100.0)]  # (slots this build never stamps keep an earlier call's)
            if not c.numel():
                continue
            print(f"  {name:48s}: {c.min():6.2f} {c.median():6.2f} {c.max():6.2f}")
        sel_steps(cur)
        polls = cur[:, 54].double()
        if bool((polls > 0).all()) and bool((polls < 1e6).all()):  # (a count, where the build stamps it)
            name = "score loads of the block's slowest lane"
            print(f"  {name:48s}: {polls.min():6.0f} {polls.median():6.0f} {polls.max():6.0f}")
        if args.per_block:
            for parity in (1 - last, last):
                sched = decode_schedule(moe.blocks, H, I, TOPK, config.order, config.balance, config.early_pairs)
                per_block(tr[parity], sched)
    return 0


SEL_STEPS = [  # moe_decode.cu SEL_CLOCK(k): thread 0's clock64 at the selection's steps
    "warp 0's scores in",
    "groups' two best in warp 0",
    "barrier: every warp's groups",
    "groups ranked",
    "(traced build's barrier)",
    "warp 0's best written",
    "barrier: every warp's best",
    "candidates ranked",
    "barrier: every rank",
    "experts and weights stored",
]


def clock_rate(cur: torch.Tensor) -> torch.Tensor:
    """Each block's clock64 cycles a ns of globaltimer, from its start and end stamps of both (C_START, C_END)."""
    return (cur[:, 57] - cur[:, 56]).double() / (cur[:, 1] - cur[:, 0]).double().clamp_min(1)


def sel_steps(cur: torch.Tensor) -> None:
    """The selection step by step (thread 0's clock64 at each SEL_CLOCK, at each block's own clock rate): median
    and largest time over blocks from the step before."""
    clocks = cur[:, 64 : 64 + len(SEL_STEPS)].double()
    if not bool((clocks > 0).all()):
        return
    rate = clock_rate(cur)
    print("  the selection, thread 0's steps (us from the step before: median, max over blocks; cycles at median)")
    for k in range(1, len(SEL_STEPS)):
        d = clocks[:, k] - clocks[:, k - 1]
        us = d / rate / 1000.0
        print(f"    {SEL_STEPS[k]:32s} {us.median():6.3f} {us.max():6.3f}   {d.median():7.0f}")


def _ranks(v: torch.Tensor) -> torch.Tensor:
    return v.double().argsort().argsort().double()


def per_block(cur: torch.Tensor, sched) -> None:
    """One traced call, block by block: the rank correlation of when a block's last gate_up tile landed with its
    SM, its tiles, when it issued its copies and when its first tile landed; then the latest ten blocks."""
    start = cur[:, 0].min()
    t = (cur - start).double() / 1000.0
    last_gu = t[:, 10]
    n_gu, n_dn = sched.table[:, 0].double(), sched.table[:, 1].double()
    smid = cur[:, 12].double()
    facts = {
        "SM id": smid,
        "gate_up tiles": n_gu,
        "down tiles": n_dn,
        "producer has the experts": t[:, 9],
        "first gate_up tile landed": t[:, 2],
        "block start": t[:, 0],
        "previous launch complete": t[:, 13],
    }
    r_last = _ranks(last_gu)
    print(f"  per block, last gate_up tile landed {last_gu.min():.2f}..{last_gu.max():.2f} us; rank correlation with:")
    for name, v in facts.items():
        rv = _ranks(v)
        corr = float(((r_last - r_last.mean()) * (rv - rv.mean())).sum() / (r_last.std() * rv.std() * (len(rv) - 1)))
        print(f"    {name:28s} {corr:+.2f}")
    order = last_gu.argsort(descending=True)[:10].tolist() + last_gu.argsort()[:3].tolist()
    print("    block  SM  gu dn  issued  first   last  (copy groups landed, issue order)")
    for b in order:
        groups = [float(t[b, 16 + q]) for q in range(int(n_gu[b]) + 4) if cur[b, 16 + q] > 0]
        print(
            f"    {b:5d} {int(smid[b]):3d} {int(n_gu[b]):3d} {int(n_dn[b]):2d} {t[b, 9]:7.2f} {t[b, 2]:6.2f} "
            f"{last_gu[b]:6.2f}  " + " ".join(f"{g:.2f}" for g in groups)
        )
    # the down phase, slot pair by slot pair (warp 0's clock64 stamps, at each block's own clock rate)
    rate = clock_rate(cur)

    def at(b: int, slot: int) -> float:
        return float(t[b, 0] + (cur[b, slot] - cur[b, 56]).double() / rate[b] / 1000.0)

    end = t[:, 11]
    late = end.argsort(descending=True)[:3].tolist() + [int(end.argsort()[len(end) // 2])]
    print("    down phase (us): block, last published anywhere, then per pair: entered / staged / rows there / done")
    for b in late:
        pairs = "  ".join(  # (the pairs the down warps did first, DecodeKernelConfig.early_pairs, have no stamps)
            "/".join(f"{at(b, 32 + 4 * p + k):.2f}" for k in range(4)) + f" ({int(cur[b, 48 + p])} polls)"
            for p in range(4)
            if cur[b, 32 + 4 * p] > cur[b, 56]  # (stamped in this call)
        )
        print(f"    {b:5d} {float(t[:, 3].max()):6.2f}  {pairs}  end {float(end[b]):.2f}")


if __name__ == "__main__":
    sys.exit(main())

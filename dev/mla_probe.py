"""MLA decode attention at Ling-3.0-flash width (lent H200): the three fused kernels of 7 layers in one
CUDA graph, over launch configurations (`AttendLaunch`: splits, positions per step and per split,
pipelining stages, row tiles, operand type, the combine's value rows per program).

    python3 dev/mla_probe.py [--contexts 4096,32768] [--tokens 1,4] [--variants N | --pick 0,5,6 | --changes JSON]
        [--json OUT.json]

32 heads, rank 512, rope 64, v 128; 7 layers with their own latent caches (over the L2 at 32K),
filled with fresh random values up to the context. Each variant's outputs are compared with the
first variant's (the product's configuration) by relative error: the configurations change the
order of fp32 sums (and fp16 against bf16 operands, both exact here), not what is computed. Printed:
us per layer (prep + attend + combine), each kernel's share of it (profiler), the attention's MMA,
registers and shared memory, and the cache bytes each layer reads against the copy bandwidth of the
same run.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict, replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from solo.bench.decode import copy_bandwidth, profile_graph, time_graph  # noqa: E402
from solo.kernels.fused_mla import FusedMLA  # noqa: E402
from solo.kernels.pdl import PLAIN, LaunchPolicy  # noqa: E402

HEADS, NOPE, ROPE, RANK, V, LAYERS = 32, 128, 64, 512, 128, 7
# changes to the product's AttendLaunch for the call's token count (FusedMLA.ONE_TOKEN or .WINDOW); the
# first, none, is the product
VARIANTS: list[dict] = [
    {},
    {"warps": 16},
    {"warps": 16, "stages": 3},
    {"warps": 16, "block_l": 32, "stages": 4},
    {"warps": 16, "combine_warps": 16},
    # the combine cut by latent columns (every partial read once, the head's last program finishing)
    {"combine_rank_parts": 4},
    {"combine_rank_parts": 2},
    {"combine_rank_parts": 4, "combine_warps": 4},
    # one token's 32 heads in two programs of 16 per split (the two read the split's rows together, the
    # second mostly from the L2): half the accumulator, two programs an SM to overlap their chains
    {"rows_per_program": 16},
    {"rows_per_program": 16, "combine_rank_parts": 4},
    # the products transposed (positions on the MMA's M side): one token's heads unpadded for wgmma
    {"transposed": True},
    {"transposed": True, "block_l": 128},
    {"transposed": True, "combine_rank_parts": 4},
]


class Recorder(LaunchPolicy):
    """Plain launches that keep what Triton compiled, to report the attention's MMA and registers."""

    def __init__(self) -> None:
        super().__init__()
        self.compiled: dict[str, object] = {}

    def record(self, family: str, compiled: object) -> None:
        super().record(family, compiled)
        self.compiled[family] = compiled


def describe(compiled: object) -> str:
    ptx = getattr(compiled, "asm", {}).get("ptx", "")
    mma = "wgmma" if "wgmma" in ptx else ("mma.sync" if "mma.sync" in ptx else "no mma")
    regs, spills = getattr(compiled, "n_regs", "?"), getattr(compiled, "n_spills", "?")
    smem = getattr(getattr(compiled, "metadata", None), "shared", "?")
    return f"{mma}, {regs} regs, {spills} spills, {smem} B shared"


def per_kernel_us(graph: torch.cuda.CUDAGraph) -> dict[str, float]:
    """Each MLA kernel's share of the replay's critical path, per layer (from the profiler)."""
    timeline = profile_graph(graph)["timeline"]
    shares: dict[str, float] = {}
    for name, _own, added in timeline:
        key = next((k for k in ("prep", "attend", "combine") if k in name), "other")
        shares[key] = shares.get(key, 0.0) + added / LAYERS
    return shares


def random_layers(dev: torch.device, g: torch.Generator, positions: int) -> list[dict[str, torch.Tensor]]:
    """LAYERS layers' absorbed projections, norm weight and latent caches of `positions` rows, fresh."""
    return [
        dict(
            w_uk=(torch.randn(HEADS, NOPE, RANK, device=dev, generator=g) * 0.05).bfloat16(),
            w_uv=(torch.randn(HEADS, V, RANK, device=dev, generator=g) * 0.05).bfloat16(),
            norm=(1 + 0.1 * torch.randn(RANK, device=dev, generator=g)).bfloat16(),
            latent=torch.randn(positions, RANK, device=dev, generator=g).bfloat16(),
            rope=torch.randn(positions, ROPE, device=dev, generator=g).bfloat16(),
        )
        for _ in range(LAYERS)
    ]


def build_layers(cls: type[FusedMLA], layers: list[dict], launch: LaunchPolicy = PLAIN) -> list[FusedMLA]:
    """One `cls` (FusedMLA or a subclass) per layer, sharing a launch counter."""
    dev = layers[0]["w_uk"].device
    inv_freq = 1.0 / (10000 ** (torch.arange(0, ROPE, 2, device=dev).float() / ROPE))
    counter = torch.zeros(3, dtype=torch.int32, device=dev)
    return [
        cls(
            layer["w_uk"],
            layer["w_uv"],
            layer["norm"],
            inv_freq,
            1.0,
            0.07,
            1e-6,
            ROPE,
            counter,
            kv_offset=HEADS * (NOPE + ROPE),
            gate_offset=HEADS * (NOPE + ROPE) + RANK + ROPE,
            launch=launch,
        )
        for layer in layers
    ]


def time_layers(
    mlas: list[FusedMLA], layers: list[dict], proj: torch.Tensor, positions: torch.Tensor
) -> tuple[float, dict[str, float], torch.Tensor]:
    """Every layer's three kernels in one graph: (seconds per layer, each kernel's share per layer,
    the layers' outputs flattened in fp32)."""
    outs = [torch.empty(proj.shape[0], HEADS * V, dtype=torch.bfloat16, device=proj.device) for _ in mlas]

    def calls() -> None:
        for m, layer, o in zip(mlas, layers, outs, strict=True):
            m(proj, positions, layer["latent"], layer["rope"], o)

    calls()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        calls()
    seconds = time_graph(graph, replays=20, rounds=5) / LAYERS
    shares = per_kernel_us(graph)
    return seconds, shares, torch.cat([o.float().flatten() for o in outs])


def shares_text(shares: dict[str, float]) -> str:
    return "prep/attend/combine " + "/".join(f"{shares.get(k, 0.0):.1f}" for k in ("prep", "attend", "combine")) + " us"


def lab_setup(contexts: str) -> tuple[torch.device, float, torch.Generator, list[int], list[dict], int]:
    """What the MLA lab scripts start from: the GPU, its copy bandwidth (printed), a fresh generator, the
    contexts asked for, 7 random layers with room for the longest and the projection row's width."""
    dev = torch.device("cuda")
    copy_gbs = copy_bandwidth(dev) / 1e9
    print(f"device-to-device copy bandwidth: {copy_gbs:.0f} GB/s ({torch.cuda.get_device_name()})", flush=True)
    g = torch.Generator(device=dev).manual_seed(int(torch.randint(0, 2**31, ())))
    sizes = [int(c) for c in contexts.split(",")]
    return dev, copy_gbs, g, sizes, random_layers(dev, g, max(sizes) + 16), HEADS * (NOPE + ROPE) + RANK + ROPE + HEADS


def cache_of_copy(context: int, seconds: float, copy_gbs: float) -> float:
    """The latent and rope cache of `context` positions read in `seconds`, as a fraction of the copy bandwidth."""
    return context * (RANK + ROPE) * 2 / seconds / 1e9 / copy_gbs


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--contexts", default="4096,32768")
    p.add_argument("--tokens", default="1,4")
    p.add_argument("--json", default=None)
    p.add_argument("--variants", type=int, default=len(VARIANTS), help="run the first N variants only")
    p.add_argument("--pick", default=None, help="run these variants only (indices, e.g. 0,5,6; 0 is the product)")
    p.add_argument(
        "--changes",
        default=None,
        help="run these changes to the product's AttendLaunch instead (JSON list, e.g. '[{}, {\"stages\": 3}]'; "
        "put {} first: the first is the outputs' reference)",
    )
    args = p.parse_args()
    dev, copy_gbs, g, contexts, layers, width = lab_setup(args.contexts)
    rows = []
    for tokens in [int(t) for t in args.tokens.split(",")]:
        proj = torch.randn(tokens, width, device=dev, generator=g).bfloat16()
        for ctx in contexts:
            positions = torch.arange(ctx - tokens, ctx, device=dev)
            reference = None
            if args.changes:
                picked = json.loads(args.changes)
            elif args.pick:
                picked = [VARIANTS[int(i)] for i in args.pick.split(",")]
            else:
                picked = VARIANTS[: args.variants]
            for variant in picked:
                recorder = Recorder()
                mlas = build_layers(FusedMLA, layers, recorder)
                for m in mlas:
                    if tokens == 1:
                        m.ONE_TOKEN = replace(m.ONE_TOKEN, **variant)
                    else:
                        m.WINDOW = replace(m.WINDOW, **variant)
                row = dict(tokens=tokens, context=ctx, config=asdict(mlas[0].config(tokens)))
                try:
                    seconds, shares, got = time_layers(mlas, layers, proj, positions)
                except Exception as exc:  # noqa: BLE001 (a variant the compiler refuses is reported)
                    row["error"] = str(exc).splitlines()[-1][:200] if str(exc) else type(exc).__name__
                    print(f"T={tokens} ctx={ctx} {variant}: FAILED {row['error']}", flush=True)
                    rows.append(row)
                    continue
                if reference is None:
                    reference = got.clone()
                rel = float((got - reference).norm() / reference.norm())
                row.update(us=seconds * 1e6, rel_err=rel, of_copy=cache_of_copy(ctx, seconds, copy_gbs))
                row.update(kernel_us=shares, attend=describe(recorder.compiled.get("mla_attend")))
                rows.append(row)
                print(
                    f"T={tokens} ctx={ctx:6d} {variant or 'product'}: {row['us']:7.2f} us per layer "
                    f"(cache {row['of_copy']:.0%} of copy) rel err {rel:.1e} | {shares_text(shares)} | "
                    f"attend: {row['attend']}",
                    flush=True,
                )
    if args.json:
        Path(args.json).write_text(
            json.dumps({"device": torch.cuda.get_device_name(), "copy_gbs": copy_gbs, "rows": rows}, indent=1)
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())

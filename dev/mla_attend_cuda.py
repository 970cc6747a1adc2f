"""The lab CUDA MLA attention (dev/mla_attend.cu) against the product's Triton attention, inside FusedMLA's
three kernels of 7 full-width layers in one CUDA graph (lent Hopper GPU).

    python3 dev/mla_attend_cuda.py [--contexts 4096,32768] [--tokens 1,4] [--stages 2,4] [--json OUT.json]

The CUDA kernel writes the same partials as `_mla_attend`, so a `FusedMLA` whose `attend` launches it
keeps the product's prep and combine. Printed per token count, context and variant: us per layer, each
kernel's share (profiler), the relative error of the layers' outputs against the product's (the same
sums in another order, and the exponentials of another implementation), the cache bytes against the
copy bandwidth of the same run.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mla_probe import (  # noqa: E402  (dev/, beside this script)
    HEADS,
    RANK,
    ROPE,
    build_layers,
    cache_of_copy,
    lab_setup,
    shares_text,
    time_layers,
)

from solo.kernels.cuda_runtime import CudaKernel  # noqa: E402
from solo.kernels.fused_mla import AttendLaunch, FusedMLA  # noqa: E402

SOURCE = Path(__file__).with_name("mla_attend.cu")
L, CWARPS = 32, 8  # as the kernel defines them


def shared_bytes(stages: int) -> int:
    smem = CWARPS * HEADS * (L + 4) * 4 + HEADS * 4 + 16 * stages + HEADS * (2 * L + 16)  # struct Smem
    ring_offset = -(-smem // 128) * 128
    stage = L * (RANK * 2 + 16) + L * (ROPE * 2 + 16)
    return ring_offset + stages * stage + 128


class CudaAttendMLA(FusedMLA):
    """FusedMLA with its attention on the lab CUDA kernel (prep and combine: the product's)."""

    stages = 4
    _kernels: dict[tuple, CudaKernel] = {}

    def attend(self, config: AttendLaunch, q, positions, latent_cache, rope_cache, part, ml) -> None:
        t, block_m = q.shape[0], part.shape[1]
        defines = dict(
            HEADS=self.heads,
            RANK=self.rank,
            ROPE=self.rope,
            SPLITS=config.splits,
            MIN_CHUNK=config.min_chunk,
            BLOCK_M=block_m,
            NTOK=t,
            STAGES=self.stages,
            PDL=0,
        )
        key = tuple(sorted(defines.items()))
        if key not in self._kernels:
            kernel = CudaKernel(SOURCE, "mla_attend", defines, q.device)
            kernel.set_shared_bytes(shared_bytes(self.stages))
            self._kernels[key] = kernel
        self._kernels[key].launch(
            config.splits * t,
            (CWARPS + 1) * 32,
            [q, positions, latent_cache, rope_cache, part, ml, self.counter[1:2], float(self.scale)],
        )


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--contexts", default="4096,32768")
    p.add_argument("--tokens", default="1,4")
    p.add_argument("--stages", default="2,4")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    dev, copy_gbs, g, contexts, layers, width = lab_setup(args.contexts)
    variants = [("triton (product)", None)] + [(f"cuda {s} stages", int(s)) for s in args.stages.split(",")]
    rows = []
    for tokens in [int(t) for t in args.tokens.split(",")]:
        proj = torch.randn(tokens, width, device=dev, generator=g).bfloat16()
        for ctx in contexts:
            positions = torch.arange(ctx - tokens, ctx, device=dev)
            reference = None
            for name, stages in variants:
                cls = FusedMLA if stages is None else type("Cuda", (CudaAttendMLA,), {"stages": stages})
                row = dict(tokens=tokens, context=ctx, variant=name)
                try:
                    seconds, shares, got = time_layers(build_layers(cls, layers), layers, proj, positions)
                except Exception as exc:  # noqa: BLE001 (a variant that fails is reported)
                    row["error"] = str(exc).splitlines()[-1][:300] if str(exc) else type(exc).__name__
                    print(f"T={tokens} ctx={ctx} {name}: FAILED {row['error']}", flush=True)
                    rows.append(row)
                    continue
                finite = bool(torch.isfinite(got).all())
                if reference is None:
                    reference = got.clone()
                rel = float((got - reference).norm() / reference.norm())
                row.update(us=seconds * 1e6, rel_err=rel, finite=finite, kernel_us=shares)
                row["of_copy"] = cache_of_copy(ctx, seconds, copy_gbs)
                rows.append(row)
                print(
                    f"T={tokens} ctx={ctx:6d} {name:18s}: {row['us']:7.2f} us per layer (cache {row['of_copy']:.0%} "
                    f"of copy) rel err {rel:.1e}{'' if finite else ' NOT FINITE'} | {shares_text(shares)}",
                    flush=True,
                )
    if args.json:
        Path(args.json).write_text(json.dumps({"device": torch.cuda.get_device_name(), "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""How often the persistent MoE kernel's normalised x (its router's input, moe_decode.cu ROUTER) differs from the
reference RMSNorm's by a bf16 step, over many fresh draws: the router-inside GPU test allows two values of 2,560.

    python3 dev/norm_rounding_probe.py [--draws 200] [--experts 512,256]

Per draw: the values that differ (each by how many bf16 steps of the reference's value), and for comparison the same
norm computed by torch on the GPU (another summation order of the same fp32 squares) against the CPU's. A kernel
that reads x as the reference does differs like torch's own GPU norm does; many more differing values would mean it
computes 1 / rms otherwise. Then the offsets of 1 / rms (fp32 ulps from the reference's) at which the reference's
rounding gives each output exactly (solo.testing.rounding.rms_offset, what the GPU tests assert; None: none within
16 ulps).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from solo.kernels.cuda_moe import PersistentDecodeMoE  # noqa: E402
from solo.kernels.fused_router import FusedRouter  # noqa: E402
from solo.model.layers import RMSNorm  # noqa: E402
from solo.testing.moe import random_mxfp4_experts  # noqa: E402
from solo.testing.rounding import rms_offset, steps_apart  # noqa: E402

H, I = 2560, 768


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--draws", type=int, default=200)
    p.add_argument("--experts", default="512,256")
    args = p.parse_args()
    print(f"device {torch.cuda.get_device_name()}, torch {torch.__version__}")
    for e in (int(v) for v in args.experts.split(",")):
        groups, keep = (8, 4) if e == 512 else (4, 2)
        experts = random_mxfp4_experts(e, H, I, scales=(116, 126))
        moe = PersistentDecodeMoE(experts, swiglu_limit=7.0)
        count = torch.zeros(1, dtype=torch.int32, device="cuda")
        kernel, gpu, offsets = [], [], {}
        for _ in range(args.draws):
            norm = RMSNorm(H, 1e-6)
            norm.weight.data = (1 + 0.1 * torch.randn(H)).to(torch.bfloat16)
            x = (3 * torch.randn(1, H)).to(torch.bfloat16)
            want = norm(x)
            router = FusedRouter(
                (torch.randn(e, H, device="cuda") * 0.02).to(torch.bfloat16),
                torch.randn(e, device="cuda") * 0.01,
                norm.weight.data.cuda(),
                1e-6, 8, groups, keep, True, 2.5, torch.zeros(1, dtype=torch.int32, device="cuda"),
            )  # fmt: skip
            _, xn, _, _ = moe.routed_forward(x.cuda(), router, count)
            kernel.append(steps_apart(xn.cpu(), want))
            off = rms_offset(xn.cpu().reshape(x.shape), x, norm.weight.data, 1e-6)[0]
            offsets[off] = offsets.get(off, 0) + 1
            gpu.append(steps_apart(norm.cuda()(x.cuda()).cpu(), want))
        for name, got in (("kernel", kernel), ("torch on the GPU", gpu)):
            counts = sorted(c for c, _ in got)
            worst = max(s for _, s in got)
            over = sum(c > 2 for c in counts)
            print(
                f"{e} experts, {name:16s}: values differing per draw median {counts[len(counts) // 2]}, "
                f"max {counts[-1]}, draws with more than 2: {over} of {len(counts)}; largest diff {worst:.2f} steps"
            )
            print(f"  counts: {counts[-12:]} (largest 12)")
        print(f"{e} experts, the kernel's 1 / rms offsets (ulps: draws): {dict(sorted(offsets.items(), key=str))}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

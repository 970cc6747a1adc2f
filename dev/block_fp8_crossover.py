"""Where the block-FP8 GEMV beats cuBLAS on a BF16 copy: a grid of layer shapes, same run (H200).

    python3 dev/block_fp8_crossover.py [--tokens 1,4]

Each op is captured over enough distinct weight copies that L2 cannot hold them (solo.bench.kernels
Timer and fp8_weights). Prints microseconds for both and their ratio per (N, K, T).
"""

from __future__ import annotations

import argparse
import math

import torch
import torch.nn.functional as F

from solo.bench.kernels import Timer, fp8_weights
from solo.kernels.triton_fp8 import fp8_block_linear, warmup_fp8_linear


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", default="1,4")
    args = ap.parse_args()
    dev = torch.device("cuda")
    timer = Timer(dev)
    print(f"{'N':>6} {'K':>6} {'T':>3} {'fp8 us':>8} {'bf16 us':>8} {'bf16/fp8':>8}")
    for n in (256, 576, 1024, 2048, 4096, 8192):
        for k in (256, 768, 1536, 2560, 4096):
            warmup_fp8_linear("block", n, k, dev)
            sets = min(48, max(2, math.ceil(4 * 60e6 / (n * k))))  # small layers: L2 may hold them
            ws = fp8_weights(n, k, dev, sets, block=True)
            wbs = [w[0].to(torch.bfloat16) for w in ws]
            for t in (int(v) for v in args.tokens.split(",")):
                xs = [torch.randn((t, k), device=dev).to(torch.bfloat16) for _ in ws]
                fp8 = timer([lambda w=w, x=x: fp8_block_linear(x, w[0], w[1]) for w, x in zip(ws, xs, strict=True)])
                bf16 = timer([lambda w=w, x=x: F.linear(x, w) for w, x in zip(wbs, xs, strict=True)])
                print(f"{n:>6} {k:>6} {t:>3} {fp8:>8.2f} {bf16:>8.2f} {bf16 / fp8:>8.2f}")
            del ws, wbs


if __name__ == "__main__":
    main()

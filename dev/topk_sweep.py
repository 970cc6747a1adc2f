"""The sampling top-k kernel's chunking, timed (GPU): logits a program (`chunk`) and chunks merged first (`group`).

    python3 dev/topk_sweep.py [--rows 1,4] [--k 29] [--vocab 157184] [--chunks 1024,2048,4096,8192]
        [--groups 0,4,8,16]

For each (rows, chunk, group): the results checked against a stable descending sort on fresh logits with ties
(and again after the graph's replays: the counters reset), then the median microseconds a call in a CUDA graph of
32 calls on distinct logits (solo.bench.kernels.Timer), beside torch.topk and the product's chunking
(solo.kernels.topk.CHUNK, GROUP) in the same run. A sampled NEXTN round runs one call of 4 rows (the
verification window) and one of 1 row a draft step.
"""

from __future__ import annotations

import argparse

import torch

from solo.bench.kernels import Timer
from solo.kernels import topk


def fresh_logits(rows: int, vocab: int, k: int, device: torch.device) -> torch.Tensor:
    """Random logits with ties inside the top k, within a chunk and across chunks."""
    x = torch.randn(rows, vocab, device=device) * 2
    top = x.topk(k).values
    for r in range(rows):
        x[r, torch.randint(0, vocab, (6,), device=device)] = top[r, k // 2]
    return x


def check(rows: int, vocab: int, k: int, chunk: int, group: int, device: torch.device) -> None:
    x = fresh_logits(rows, vocab, k, device)
    values, columns = topk._launch(x, k, chunk, group)
    want_v, want_c = torch.sort(x, dim=-1, descending=True, stable=True)
    if not (torch.equal(values, want_v[:, :k]) and torch.equal(columns, want_c[:, :k])):
        raise SystemExit(f"rows {rows} chunk {chunk} group {group}: not the stable sort's top {k}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="1,4")
    ap.add_argument("--k", type=int, default=29)
    ap.add_argument("--vocab", type=int, default=157184)
    ap.add_argument("--chunks", default="1024,2048,4096,8192")
    ap.add_argument("--groups", default="0,4,8,16")
    args = ap.parse_args()
    device = torch.device("cuda")
    print(
        f"device {torch.cuda.get_device_name(device)}, torch {torch.__version__}; product chunk {topk.CHUNK}, "
        f"group {topk.GROUP}; k {args.k}, vocab {args.vocab}"
    )
    timer = Timer(device)
    for rows in (int(v) for v in args.rows.split(",")):
        xs = [fresh_logits(rows, args.vocab, args.k, device) for _ in range(32)]
        base = timer([lambda x=x: x.topk(args.k) for x in xs])
        print(f"rows {rows}: torch.topk {base:.2f} us")
        results = []
        for chunk in (int(v) for v in args.chunks.split(",")):
            chunks = -(-args.vocab // chunk)
            for group in (int(v) for v in args.groups.split(",")):
                if group and group >= chunks:
                    continue
                check(rows, args.vocab, args.k, chunk, group, device)
                us = timer([lambda x=x, c=chunk, g=group: topk._launch(x, args.k, c, g) for x in xs])
                check(rows, args.vocab, args.k, chunk, group, device)
                results.append((us, chunk, group))
                mark = "  (product)" if (chunk, group) == (topk.CHUNK, topk.GROUP) else ""
                print(f"  chunk {chunk:>5} group {group:>2}: {us:7.2f} us, {base / us:5.2f}x torch.topk{mark}")
        us, chunk, group = min(results)
        print(f"rows {rows}: fastest chunk {chunk} group {group} at {us:.2f} us")


if __name__ == "__main__":
    main()

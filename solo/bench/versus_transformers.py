"""Greedy decode speed of solo vs transformers' BailingHybridForCausalLM, side by side in one run.

    python -m solo.bench.versus_transformers [--preset a] [--prompt-tokens 32] [--new-tokens 64]

Both run the same tiny random checkpoint (written by transformers itself), on the same prompt, in
fp32 on the CPU, greedy; the generated ids are checked equal before any number is reported.
Decode tok/s excludes the first token (prefill): (new - 1) / (total - ttft), each the median of
`--repeats` runs.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import torch

from solo.engine.engine import Engine, GenerationParams
from solo.testing.tiny import write_tiny_checkpoint


def time_transformers(model, prompt: list[int], new_tokens: int) -> tuple[list[int], float, float]:
    first: list[float] = []

    class FirstToken:
        def put(self, value):
            if len(first) == 0 and value.shape[-1] == 1:
                first.append(time.perf_counter())

        def end(self):
            pass

    start = time.perf_counter()
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt]),
            max_new_tokens=new_tokens,
            eos_token_id=None,  # plain greedy to the length, like solo's ignore_eos (min_new_tokens masks EOS)
            do_sample=False,
            streamer=FirstToken(),
        )
    end = time.perf_counter()
    ttft = (first[0] if first else end) - start
    return out[0, len(prompt) :].tolist(), ttft, end - start


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="a", choices=("a", "b", "c"))
    ap.add_argument("--prompt-tokens", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)

    with tempfile.TemporaryDirectory() as tmp:
        ref = write_tiny_checkpoint(tmp, preset=args.preset, seed=0)
        engine = Engine.from_pretrained(tmp, lm_head="fp32")
        prompt = torch.randint(6, 262, (args.prompt_tokens,), generator=torch.Generator().manual_seed(0)).tolist()
        params = GenerationParams(max_tokens=args.new_tokens, ignore_eos=True)
        rows = {"solo": [], "transformers": []}
        for _ in range(args.repeats):
            result = engine.generate(prompt, params)
            s = result.stats
            rows["solo"].append((s.ttft_s, s.total_s))
            ids, ttft, total = time_transformers(ref, prompt, args.new_tokens)
            rows["transformers"].append((ttft, total))
            if ids != result.token_ids:
                raise SystemExit("generated ids differ between solo and transformers; not reporting speed")

    print(
        f"preset {args.preset}, {args.prompt_tokens} prompt tokens, {args.new_tokens} new tokens, greedy, fp32, "
        f"CPU threads {torch.get_num_threads()}, median of {args.repeats}; ids identical"
    )
    print(f"{'engine':<14}{'TTFT ms':>10}{'decode tok/s':>14}")
    rates = {}
    for name, runs in rows.items():
        ttft = statistics.median(r[0] for r in runs)
        rate = statistics.median((args.new_tokens - 1) / (r[1] - r[0]) for r in runs)
        rates[name] = rate
        print(f"{name:<14}{ttft * 1e3:>10.1f}{rate:>14.1f}")
    print(f"solo / transformers decode speed: {rates['solo'] / rates['transformers']:.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

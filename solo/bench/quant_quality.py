"""Quantization quality: top-1 next-token agreement and mean KL against a full-precision reference.

    python -m solo.bench.quant_quality --reference BF16_DIR [--quantized FP4_DIR] [--prompts N]

Compares, position by position over a fixed prompt set, the reference (BF16 checkpoint computed in
fp32 with an fp32 LM head) with (1) the same checkpoint with the online FP8 LM head and
(2) the quantized checkpoint (MXFP4 experts + block FP8) with each LM head mode.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from solo.bench import gsm8k
from solo.fastpath import load_accelerated
from solo.model.cache import HybridCache
from solo.tokenizer import Tokenizer


def position_logits(model, ids: list[int]) -> torch.Tensor:
    cache = HybridCache(model.config, len(ids), model.device, model.dtype)
    with torch.inference_mode():
        positions = torch.arange(len(ids), device=model.device)
        return model.logits(model(torch.tensor(ids, device=model.device), positions, cache))


def compare(reference: list[torch.Tensor], candidate: list[torch.Tensor]) -> dict[str, float]:
    ref, cand = torch.cat(reference), torch.cat(candidate)
    agree = (ref.argmax(-1) == cand.argmax(-1)).double().mean()
    logp, logq = torch.log_softmax(ref.double(), -1), torch.log_softmax(cand.double(), -1)
    kl = (logp.exp() * (logp - logq)).sum(-1).mean()
    return {"top1_agreement": float(agree), "mean_kl": float(kl), "positions": ref.shape[0]}


def default_prompts(directory: Path, count: int, seed: int = 0) -> list[list[int]]:
    """GSM8K 5-shot prompts (in-distribution text for a model that has a real vocabulary), else
    random token ids (tiny random test models, whose byte vocabulary has no words)."""
    tok = Tokenizer.from_dir(directory)
    if tok.vocab_size > 1000:  # a real vocabulary: real text, never silently random ids
        try:
            test, train = gsm8k.load_split("test")[:count], gsm8k.load_split("train")
        except ValueError as e:
            raise FileNotFoundError(f"GSM8K not found: {e}") from None
        prompts = gsm8k.build_prompts(test, train)
        return [tok.encode(p)[-384:] for p in prompts]
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(6, tok.vocab_size, (48,), generator=gen).tolist() for _ in range(count)]


def greedy_continuations(reference_dir: Path, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    """Each prompt followed by the reference model's own greedy continuation (decode positions)."""
    from solo.engine.engine import Engine, GenerationParams

    engine = Engine.from_pretrained(reference_dir, lm_head="fp32")
    params = GenerationParams(max_tokens=new_tokens, ignore_eos=True)
    return [p + engine.generate(p, params).token_ids for p in prompts]


def evaluate(
    reference_dir: Path, quantized_dir: Path | None, prompts: list[list[int]], new_tokens: int = 0
) -> dict[str, dict]:
    """Agreement at every position of the prompts, or, with `new_tokens`, only at the positions
    that predict the reference model's own greedy continuation (what decoding actually reads)."""
    sequences = greedy_continuations(reference_dir, prompts, new_tokens) if new_tokens else prompts
    starts = [len(p) - 1 if new_tokens else 0 for p in prompts]

    def run(path: Path, head: str) -> list[torch.Tensor]:
        model = load_accelerated(path, lm_head=head)
        return [
            position_logits(model, seq)[start : -1 if new_tokens else None]
            for seq, start in zip(sequences, starts, strict=True)
        ]

    reference = run(reference_dir, "fp32")
    report = {
        "bf16 checkpoint, fp8 head": compare(reference, run(reference_dir, "fp8")),
        "bf16 checkpoint, bf16 head": compare(reference, run(reference_dir, "bf16")),
    }
    if quantized_dir is not None:
        for head in ("fp32", "bf16", "fp8"):
            report[f"fp4 checkpoint, {head} head"] = compare(reference, run(quantized_dir, head))
    return report


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reference", required=True, type=Path)
    ap.add_argument("--quantized", type=Path)
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument(
        "--new-tokens",
        type=int,
        default=0,
        help="compare only at the positions of the reference's greedy continuation of this length",
    )
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    prompts = default_prompts(args.reference, args.prompts)
    report = evaluate(args.reference, args.quantized, prompts, args.new_tokens)
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    print(f"{'configuration':<30}{'top-1 agreement':>17}{'mean KL':>12}{'positions':>11}")
    for name, r in report.items():
        print(f"{name:<30}{r['top1_agreement'] * 100:>16.2f}%{r['mean_kl']:>12.2e}{r['positions']:>11}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

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

from solo.checkpoint.loader import LoadOptions, load_model
from solo.model.cache import HybridCache
from solo.tokenizer import Tokenizer


def position_logits(model, ids: list[int]) -> torch.Tensor:
    cache = HybridCache(model.config, len(ids), model.device, model.dtype)
    with torch.inference_mode():
        return model.logits(model(torch.tensor(ids), torch.arange(len(ids)), cache))


def compare(reference: list[torch.Tensor], candidate: list[torch.Tensor]) -> dict[str, float]:
    ref, cand = torch.cat(reference), torch.cat(candidate)
    agree = (ref.argmax(-1) == cand.argmax(-1)).double().mean()
    logp, logq = torch.log_softmax(ref.double(), -1), torch.log_softmax(cand.double(), -1)
    kl = (logp.exp() * (logp - logq)).sum(-1).mean()
    return {"top1_agreement": float(agree), "mean_kl": float(kl), "positions": ref.shape[0]}


def default_prompts(directory: Path, count: int, seed: int = 0) -> list[list[int]]:
    """GSM8K-like prompts if the tokenizer knows words, else random token ids (tiny test models)."""
    tok = Tokenizer.from_dir(directory)
    gen = torch.Generator().manual_seed(seed)
    texts = [
        "Question: Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. "
        "How many clips did Natalia sell altogether in April and May?\nAnswer:",
        "Question: Weng earns $12 an hour for babysitting. Yesterday, she just did 50 minutes of babysitting. "
        "How much did she earn?\nAnswer:",
    ]
    prompts = [tok.encode(t) for t in texts][:count]
    while len(prompts) < count:
        prompts.append(torch.randint(6, tok.vocab_size, (48,), generator=gen).tolist())
    return prompts


def evaluate(reference_dir: Path, quantized_dir: Path | None, prompts: list[list[int]]) -> dict[str, dict]:
    def run(path: Path, head: str) -> list[torch.Tensor]:
        model = load_model(path, LoadOptions(lm_head=head))
        return [position_logits(model, p) for p in prompts]

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
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    report = evaluate(args.reference, args.quantized, default_prompts(args.reference, args.prompts))
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    print(f"{'configuration':<30}{'top-1 agreement':>17}{'mean KL':>12}{'positions':>11}")
    for name, r in report.items():
        print(f"{name:<30}{r['top1_agreement'] * 100:>16.2f}%{r['mean_kl']:>12.2e}{r['positions']:>11}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

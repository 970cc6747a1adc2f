"""`solo bench`: the stack measured honestly, baseline and optimized side by side in one run.

Workloads:
  gsm8k      GSM8K test questions in the lm-eval 5-shot format, stop at "Question:", graded
             (strict and flexible match); accuracy A/B by a paired McNemar test.
  synthetic  random prompt tokens, fixed output length, eos ignored (the seed's synthetic shape).
  repeat     one random digit repeated --input-len times, fixed output length, eos ignored: the
             most predictable continuation there is, so an upper bound for acceptance (like the
             seed's synthetic run, whose greedy output settled into repetition: 3.90).

Each configuration runs the same requests; the table gives TTFT, TPOT, decode tok/s, accept
length and per-position acceptance, and the ratio of decode speeds.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from solo.bench import gsm8k
from solo.bench.metrics import RequestRecord, summarize
from solo.engine.decoder import PlainDecoder
from solo.engine.engine import Engine, GenerationParams
from solo.engine.sampling import SamplingParams

_ROOT = Path(__file__).resolve().parents[2]
# ../shared/data/gsm8k beside the checkout, else a copy in the checkout's git-ignored .data/gsm8k
_GSM8K_PLACES = (_ROOT.parent / "shared" / "data" / "gsm8k", _ROOT / ".data" / "gsm8k")
DEFAULT_GSM8K = next((d for d in _GSM8K_PLACES if (d / "test.jsonl").is_file()), _GSM8K_PLACES[0])


@dataclass
class Request:
    prompt: str | list[int]
    params: GenerationParams
    target: str | None = None  # GSM8K answer


def gsm8k_requests(data_dir: Path, count: int, sampling: SamplingParams, max_tokens: int) -> list[Request]:
    test = gsm8k.load_gsm8k(data_dir / "test.jsonl")[:count]
    train = gsm8k.load_gsm8k(data_dir / "train.jsonl")
    prompts = gsm8k.build_prompts(test, train)
    params = GenerationParams(max_tokens=max_tokens, sampling=sampling, stop=gsm8k.STOP_SEQUENCES)
    return [Request(p, params, ex.target) for p, ex in zip(prompts, test, strict=True)]


def synthetic_requests(
    vocab: int, count: int, input_len: int, output_len: int, sampling: SamplingParams, seed: int = 0
) -> list[Request]:
    gen = torch.Generator().manual_seed(seed)
    params = GenerationParams(max_tokens=output_len, sampling=sampling, ignore_eos=True)
    return [Request(torch.randint(10, vocab, (input_len,), generator=gen).tolist(), params) for _ in range(count)]


def repeat_requests(count: int, length: int, output_len: int, sampling: SamplingParams, seed: int = 0) -> list[Request]:
    gen = torch.Generator().manual_seed(seed)
    params = GenerationParams(max_tokens=output_len, sampling=sampling, ignore_eos=True)
    digits = torch.randint(0, 10, (count,), generator=gen).tolist()
    return [Request(str(d) * length, params) for d in digits]


def run(engine: Engine, requests: list[Request]) -> tuple[list[RequestRecord], list[bool], float]:
    records, correct = [], []
    start = time.perf_counter()
    for req in requests:
        times: list[float] = []
        generation = engine.stream(req.prompt, req.params)
        for event in generation:
            if not times or event.elapsed_s != times[-1]:
                times.append(event.elapsed_s)
        result = generation.result
        assert result is not None
        s = result.stats
        itl = [b - a for a, b in zip(times, times[1:], strict=False)]
        per_pos = list(s.accepted_per_position or [])
        records.append(
            RequestRecord(
                prompt_tokens=s.prompt_tokens,
                output_tokens=s.completion_tokens,
                ttft_s=s.ttft_s,
                latency_s=s.total_s,
                itl_s=itl,
                drafted_tokens=s.drafted_tokens or 0,
                accepted_tokens=s.accepted_tokens or 0,
                verify_rounds=s.verify_rounds or 0,
                accepted_per_position=per_pos,
                finish_reason=result.finish_reason,
            )
        )
        if req.target is not None:
            correct.append(gsm8k.grade(result.text, req.target).strict)
    return records, correct, time.perf_counter() - start


def compare_configs(engines: dict[str, Engine], requests: list[Request], warmup: int = 1) -> dict[str, Any]:
    report: dict[str, Any] = {"configs": {}}
    correctness = {}
    for name, engine in engines.items():
        for req in requests[:warmup]:  # first-call costs (allocation, compilation) stay out of the numbers
            engine.generate(req.prompt, req.params)
        records, correct, wall = run(engine, requests)
        summary = summarize(records, wall)
        if correct:
            summary["accuracy_strict"] = gsm8k.accuracy(correct)
            correctness[name] = correct
        summary["engine"] = engine.describe()
        report["configs"][name] = summary
    names = list(engines)
    if len(names) == 2:
        a, b = (report["configs"][n] for n in names)
        if a["decode_throughput"]:
            report["decode_speedup"] = b["decode_throughput"] / a["decode_throughput"]
        if len(correctness) == 2:
            n01, n10, p = gsm8k.mcnemar(correctness[names[0]], correctness[names[1]])
            report["mcnemar"] = {"only_first_correct": n01, "only_second_correct": n10, "p_value": p}
    return report


def print_table(report: dict[str, Any], out=sys.stdout) -> None:
    header = (
        f"{'config':<12}{'reqs':>5}{'acc%':>7}{'TTFT ms':>9}{'TPOT ms':>9}{'dec tok/s':>10}{'accept':>8}  per-position"
    )
    print(header, file=out)
    for name, s in report["configs"].items():
        acc = f"{100 * s['accuracy_strict']:.1f}" if "accuracy_strict" in s else "-"
        accept = f"{s['accept_length']:.2f}" if s.get("accept_length") else "-"
        per = " ".join(f"{p:.2f}" for p in s.get("per_position_acceptance") or [])
        print(
            f"{name:<12}{s['completed']:>5}{acc:>7}{s['mean_ttft_ms']:>9.1f}{s['mean_tpot_ms']:>9.2f}"
            f"{s['decode_throughput']:>10.1f}{accept:>8}  {per}",
            file=out,
        )
    if "decode_speedup" in report:
        print(f"decode speed ratio (second / first): {report['decode_speedup']:.3f}x", file=out)
    if "mcnemar" in report:
        m = report["mcnemar"]
        print(
            f"accuracy McNemar: {m['only_first_correct']} vs {m['only_second_correct']} discordant, "
            f"p = {m['p_value']:.3f}",
            file=out,
        )


def main(args: argparse.Namespace, engine: Engine) -> int:
    sampling = SamplingParams(args.temperature, args.top_k, args.top_p, args.seed)
    if args.workload == "gsm8k":
        data = Path(args.data) if args.data else DEFAULT_GSM8K
        if not (data / "test.jsonl").is_file():
            raise ValueError(f"{data}/test.jsonl not found: pass --data DIR holding GSM8K test.jsonl and train.jsonl.")
        requests = gsm8k_requests(data, args.num_prompts, sampling, args.output_len)
    elif args.workload == "repeat":
        requests = repeat_requests(args.num_prompts, args.input_len, args.output_len, sampling, args.seed or 0)
    else:
        vocab = engine.model.config.vocab_size
        requests = synthetic_requests(
            vocab, args.num_prompts, args.input_len, args.output_len, sampling, args.seed or 0
        )
    engines = {}
    if args.baseline and not isinstance(engine.decoder, PlainDecoder):
        baseline = Engine(engine.model, engine.tokenizer, PlainDecoder(engine.model))
        if engine.graphs_max_len is not None:  # the same step machinery as the optimized run
            baseline.enable_cuda_graphs(engine.graphs_max_len)
        engines["baseline"] = baseline
    engines["mtp" if not isinstance(engine.decoder, PlainDecoder) else "plain"] = engine
    report = compare_configs(engines, requests)
    report["workload"] = {
        "name": args.workload,
        "requests": len(requests),
        "model": str(args.model),
        "sampling": vars(sampling),
    }
    print_table(report)
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2, default=str))
    return 0


WORKLOADS = {
    "gsm8k": "GSM8K test questions, lm-eval 5-shot, graded",
    "synthetic": "random prompt tokens, fixed output length, eos ignored",
    "repeat": "one digit repeated, fixed output length: an upper bound for acceptance",
}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--num-prompts", type=int, default=20)
    p.add_argument("--input-len", type=int, default=256, help="synthetic: prompt tokens; repeat: characters")
    p.add_argument("--output-len", type=int, default=128, help="max new tokens")
    p.add_argument("--data", default=None, help="GSM8K folder with test.jsonl and train.jsonl")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--baseline", action="store_true", help="also run plain decoding on the same requests")
    p.add_argument("--json", default=None, help="write the full report to this file")

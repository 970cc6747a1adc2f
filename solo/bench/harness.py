"""`solo bench WORKLOAD`: one client, one protocol, against the in-process engine or any OpenAI-compatible server.

Targets: the engine loaded from ``--model`` (with ``--baseline`` also plain decoding on the same
requests, one run after the other, or request by request with ``--interleave``, so the A/B is side by
side), or ``--url http://HOST:PORT/v1``.
Workloads: solo.bench.workloads. Metrics: solo.bench.metrics (vLLM / SGLang names). Output, in
``--out DIR``: ``report.json`` (stamped with commit, versions, device, model and every flag),
``report.md`` (the seed's Table-4 layout), PNG plots, and ``requests.jsonl``, the per-request log
that ``--resume`` continues from. Requests run one at a time (batch size 1).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from solo.bench import gsm8k, promcounters, report, workloads
from solo.bench.metrics import RequestRecord
from solo.bench.targets import EngineTarget, OpenAITarget, Outcome, Request, Target
from solo.engine.sampling import SamplingParams

LOG_NAME = "requests.jsonl"
LOG_VERSION = 1


class ResumeMismatch(ValueError):
    """The per-request log belongs to another run."""


# --------------------------------------------------------------------------- per-request log
class RunLog:
    """``requests.jsonl``: a header naming the run, then one line per finished request, flushed at once."""

    def __init__(self, path: Path, signature: dict[str, Any], resume: bool) -> None:
        self.path = path
        self.done: dict[tuple[str, int], dict[str, Any]] = {}
        if resume and path.is_file():
            lines = [json.loads(x) for x in path.read_text(encoding="utf-8").splitlines() if x.strip()]
            if not lines or lines[0].get("kind") != "header":
                raise ResumeMismatch(
                    f"{path} has no header line: it is not a solo bench log; remove it or drop --resume."
                )
            if lines[0].get("signature") != signature:
                raise ResumeMismatch(
                    f"{path} was written by a different run (workload, requests, sampling or targets differ): "
                    f"resume with the same command line, or use another --out."
                )
            for line in lines[1:]:
                if line.get("kind") == "request":
                    self.done[(line["config"], line["index"])] = line
            self.file = path.open("a", encoding="utf-8")
        else:
            if path.is_file() and not resume:
                raise ValueError(f"{path} exists: pass --resume to continue that run, or choose another --out.")
            path.parent.mkdir(parents=True, exist_ok=True)
            self.file = path.open("w", encoding="utf-8")
            self._write({"kind": "header", "version": LOG_VERSION, "signature": signature})

    def _write(self, obj: dict[str, Any]) -> None:
        self.file.write(json.dumps(obj) + "\n")
        self.file.flush()

    def add(self, config: str, index: int, entry: dict[str, Any]) -> None:
        line = {"kind": "request", "config": config, "index": index, **entry}
        self.done[(config, index)] = line
        self._write(line)

    def close(self) -> None:
        self.file.close()


def entry_of(outcome: Outcome, request: Request) -> dict[str, Any]:
    """The log line of one finished request."""
    entry: dict[str, Any] = {"record": asdict(outcome.record), "text": outcome.text}
    if outcome.tokens_estimated:
        entry["tokens_estimated"] = True
    if outcome.extra:
        entry["extra"] = outcome.extra
    if request.target is not None:
        entry["target"] = request.target
        if not outcome.record.failed:
            g = gsm8k.grade(outcome.text, request.target)
            entry["correct_strict"], entry["correct_flexible"] = g.strict, g.flexible
        else:
            entry["correct_strict"] = entry["correct_flexible"] = False
    return entry


def record_of(entry: dict[str, Any]) -> RequestRecord:
    return RequestRecord(**entry["record"])


# --------------------------------------------------------------------------- running
class Progress:
    """A progress bar with running output tok/s and accept length (tqdm on stderr)."""

    def __init__(self, name: str, total: int, initial: int, enabled: bool) -> None:
        from tqdm import tqdm

        self.bar = tqdm(total=total, initial=initial, desc=name, unit="req", disable=not enabled, file=sys.stderr)
        self.tokens = 0
        self.busy_s = 0.0
        self.rounds = self.accepted = self.failed = 0

    def update(self, record: RequestRecord) -> None:
        self.tokens += record.output_tokens
        self.busy_s += record.latency_s
        self.rounds += record.verify_rounds
        self.accepted += record.accepted_tokens
        self.failed += record.failed
        post = {"tok/s": f"{self.tokens / self.busy_s:.1f}" if self.busy_s > 0 else "-"}
        if self.rounds:
            post["accept"] = f"{1 + self.accepted / self.rounds:.2f}"
        if self.failed:
            post["failed"] = str(self.failed)
        self.bar.set_postfix(post, refresh=False)
        self.bar.update(1)

    def close(self) -> None:
        self.bar.close()


class TargetRun:
    """One configuration's share of a run: its warm-up, its requests not yet in the log, its progress bar
    and the server counters read before and after."""

    def __init__(self, target: Target, requests: Sequence[Request], log: RunLog, warmup: int, progress: bool):
        self.target, self.requests, self.log = target, requests, log
        todo = [i for i in range(len(requests)) if (target.name, i) not in log.done]
        self.metrics_before = _read_metrics(target) if todo else None
        if todo:
            for req in requests[:warmup]:  # first-call costs (allocation, compilation) stay out of the numbers
                target.run(req)
        self.bar = Progress(target.name, len(requests), len(requests) - len(todo), progress)

    def run(self, i: int) -> None:
        """Serve request ``i`` unless the log already has it."""
        if (self.target.name, i) in self.log.done:
            return
        start = time.perf_counter()
        outcome = self.target.run(self.requests[i])
        entry = entry_of(outcome, self.requests[i])
        entry["wall_s"] = time.perf_counter() - start
        self.log.add(self.target.name, i, entry)
        self.bar.update(outcome.record)

    def finish(self) -> dict[str, Any]:
        """The config's measurements: entries in request order, the target, and acceptance counters read
        from the server when it reports none per request."""
        self.bar.close()
        name = self.target.name
        entries = [self.log.done[(name, i)] for i in range(len(self.requests))]
        result: dict[str, Any] = {"entries": entries, "target": self.target.describe()}
        if self.metrics_before is not None:
            after = _read_metrics(self.target)
            if after is not None:
                delta = promcounters.spec_delta(self.metrics_before, after)
                if delta is not None and delta.verify_rounds > 0:
                    result["server_counters"] = asdict(delta) | {"accept_length": delta.accept_length}
                gauges = promcounters.gauges(after)
                if gauges:
                    result["server_gauges"] = gauges
        return result


def run_target(
    target: Target,
    requests: Sequence[Request],
    log: RunLog,
    warmup: int = 1,
    progress: bool = True,
) -> dict[str, Any]:
    """Serve every request not yet in the log on one target; returns its measurements."""
    run = TargetRun(target, requests, log, warmup, progress)
    for i in range(len(requests)):
        run.run(i)
    return run.finish()


def run_interleaved(
    targets: Sequence[Target], requests: Sequence[Request], log: RunLog, warmup: int = 1, progress: bool = True
) -> dict[str, dict[str, Any]]:
    """Request 0 on every target, then request 1 on every target, ...: on a machine whose speed drifts
    (shared cores, clocks, other jobs) both sides of an A/B see the same conditions, so their ratio
    stays honest even when the absolute numbers move."""
    runs = [TargetRun(t, requests, log, warmup, progress) for t in targets]
    for i in range(len(requests)):
        for run in runs:
            run.run(i)
    return {run.target.name: run.finish() for run in runs}


def _read_metrics(target: Target) -> dict[str, float] | None:
    if not isinstance(target, OpenAITarget):
        return None
    response = target.get("/metrics")
    return promcounters.parse_metrics(response.text) if response is not None else None


# --------------------------------------------------------------------------- the command
WORKLOADS = {
    "gsm8k": "GSM8K test questions, lm-eval 5-shot, graded (all 1,319 by default)",
    "synthetic": "random prompt ids, fixed input and output lengths, eos ignored",
    "repeat": "one digit repeated, fixed output length: an upper bound for acceptance",
    "jsonl": "your own prompts: one JSON object per line, optional sampling per line",
}


def sampling_of(args: argparse.Namespace) -> SamplingParams:
    """Sampling from the flags, a --preset filling what was not given."""
    preset = workloads.PRESETS.get(args.preset or "", {})
    temperature = args.temperature if args.temperature is not None else preset.get("temperature", 0.0)
    top_k = args.top_k if args.top_k is not None else int(preset.get("top_k", 0))
    top_p = args.top_p if args.top_p is not None else preset.get("top_p", 1.0)
    return SamplingParams(temperature, top_k, top_p, args.seed)


def build_requests(args: argparse.Namespace, vocab: int | None) -> list[Request]:
    sampling = sampling_of(args)
    seed = args.seed or 0
    if args.workload == "gsm8k":
        return workloads.gsm8k_requests(args.num_prompts, sampling, args.output_len or 256, args.data)
    if args.workload == "jsonl":
        return workloads.jsonl_requests(args.file, args.num_prompts, sampling, args.output_len or 128)
    count, output_len = args.num_prompts or 20, args.output_len or 128
    if args.workload == "repeat":
        return workloads.repeat_requests(count, args.input_len, output_len, sampling, seed)
    vocab = args.vocab_size or vocab
    if vocab is None:
        raise ValueError("synthetic against --url needs --vocab-size N (the server's vocabulary) to draw prompt ids.")
    return workloads.synthetic_requests(vocab, count, args.input_len, output_len, sampling, seed)


def default_out(workload: str) -> Path:
    return Path("bench_runs") / f"{workload}-{time.strftime('%Y%m%d-%H%M%S')}"


def run_bench(args: argparse.Namespace, targets: list[Target], vocab: int | None = None) -> dict[str, Any]:
    """Run the workload against each target in turn and write the outputs; returns the report."""
    requests = build_requests(args, vocab)
    out = Path(args.out) if args.out else default_out(args.workload)
    signature = {
        "workload": args.workload,
        "requests": len(requests),
        "prompts": report.fingerprint([r.prompt for r in requests]),
        "params": report.fingerprint([asdict(r.params) for r in requests]),
        "targets": [t.name for t in targets],
    }
    if getattr(args, "report_only", False):
        return report_from_log(args, targets, requests, out, signature)
    log = RunLog(out / LOG_NAME, signature, args.resume)
    if log.done:
        print(f"solo bench: resuming {out / LOG_NAME}: {len(log.done)} requests already done", file=sys.stderr)
    start = time.time()
    try:
        if getattr(args, "interleave", False) and len(targets) > 1:
            results = run_interleaved(targets, requests, log, args.warmup, not args.no_progress)
        else:
            results = {t.name: run_target(t, requests, log, args.warmup, not args.no_progress) for t in targets}
    finally:
        log.close()
    rep = report.build(results, workload_of(args, requests), report.stamp(args), started=start)
    report.write_outputs(rep, out, plots=not args.no_plots)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(rep, indent=2, default=str))
    print(report.markdown(rep))
    print(f"\nsolo bench: wrote {out}/report.json, report.md, plots and {LOG_NAME}", file=sys.stderr)
    return rep


def workload_of(args: argparse.Namespace, requests: Sequence[Request]) -> dict[str, Any]:
    return {
        "name": args.workload,
        "requests": len(requests),
        "sampling": asdict(requests[0].params.sampling),
        "max_tokens": requests[0].params.max_tokens,
        "stop": list(requests[0].params.stop),
        "ignore_eos": requests[0].params.ignore_eos,
    }


def report_from_log(
    args: argparse.Namespace, targets: list[Target], requests: Sequence[Request], out: Path, signature: dict[str, Any]
) -> dict[str, Any]:
    """``--report-only``: the report of the run logged in ``out`` (same command line), serving nothing. An
    interrupted run reports the requests done on every configuration, so an A/B stays paired."""
    path = out / LOG_NAME
    if not path.is_file():
        raise ValueError(f"--report-only: {path} not found; give the --out of an earlier run.")
    log = RunLog(path, signature, resume=True)
    log.close()
    done = [i for i in range(len(requests)) if all((t.name, i) in log.done for t in targets)]
    if not done:
        raise ValueError(f"--report-only: {path} holds no request done on every configuration yet.")
    results = {t.name: {"entries": [log.done[(t.name, i)] for i in done], "target": t.describe()} for t in targets}
    workload = workload_of(args, requests) | {"requests": len(done), "of_requests": len(requests)}
    rep = report.build(results, workload, report.stamp(args))
    report.write_outputs(rep, out, plots=not args.no_plots)
    print(report.markdown(rep))
    print(f"\nsolo bench: wrote {out}/report.json, report.md and plots from {LOG_NAME}", file=sys.stderr)
    return rep


def engine_targets(engine: Any, baseline: bool) -> list[Target]:
    """The configured engine, preceded by plain decoding on the same model with --baseline."""
    from solo.engine.decoder import PlainDecoder
    from solo.engine.engine import Engine

    plain = isinstance(engine.decoder, PlainDecoder)
    targets: list[Target] = []
    if baseline and not plain:
        other = Engine(engine.model, engine.tokenizer, PlainDecoder(engine.model))
        if engine.graphs_max_len is not None:  # the same step machinery as the optimized run
            other.enable_cuda_graphs(engine.graphs_max_len)
        targets.append(EngineTarget(other, "baseline"))
    elif baseline:
        raise ValueError(
            "--baseline compares plain decoding with speculative decoding: add --speculative-algorithm NEXTN."
        )
    targets.append(EngineTarget(engine, "optimized" if targets else ("plain" if plain else "speculative")))
    return targets


def url_target(args: argparse.Namespace) -> OpenAITarget:
    if args.baseline:
        raise ValueError(
            "--baseline runs plain decoding in-process; against --url run each server separately and "
            "compare the reports: solo bench compare A/report.json B/report.json."
        )
    if not args.url.startswith(("http://", "https://")):
        raise ValueError(f"--url {args.url}: give the API root, e.g. http://127.0.0.1:8000/v1.")
    return OpenAITarget(args.url, "server", args.api_key, args.model_name, args.request_timeout)


def add_arguments(p: argparse.ArgumentParser, workload: str | None = None) -> None:
    """The options of `solo bench WORKLOAD` besides the model options."""
    if workload == "jsonl":
        p.add_argument("file", help="one JSON object per line: prompt, optional max_tokens/temperature/.../answer")
    p.add_argument("--url", default=None, help="an OpenAI-compatible server's API root, e.g. http://HOST:PORT/v1")
    p.add_argument("--api-key", default=None, help="bearer token for --url")
    p.add_argument("--model-name", default=None, help="the 'model' field sent to --url (default: none)")
    p.add_argument("--request-timeout", type=float, default=600.0, help="seconds one request may take (--url)")
    p.add_argument(
        "--num-prompts", type=int, default=None, help="requests (default: all 1,319 GSM8K questions; 20 otherwise)"
    )
    p.add_argument("--input-len", type=int, default=256, help="synthetic: prompt tokens; repeat: characters")
    p.add_argument("--output-len", type=int, default=None, help="max new tokens (default: 256 for gsm8k, else 128)")
    p.add_argument("--vocab-size", type=int, default=None, help="synthetic with --url: the server's vocabulary")
    p.add_argument("--data", default=None, help="GSM8K folder with test.jsonl and train.jsonl")
    p.add_argument(
        "--preset",
        choices=sorted(workloads.PRESETS),
        default=None,
        help="sampling preset; seed-table4: temperature 0.6, top-p 0.95, top-k 29 (the seed's GSM8K run)",
    )
    p.add_argument("--temperature", type=float, default=None, help="default 0 (greedy)")
    p.add_argument("--top-k", type=int, default=None)
    p.add_argument("--top-p", type=float, default=None)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--baseline", action="store_true", help="also run plain decoding on the same requests (engine)")
    p.add_argument(
        "--interleave",
        action="store_true",
        help="with --baseline: run each request on both configurations in turn (fair on a machine whose speed drifts)",
    )
    p.add_argument("--warmup", type=int, default=1, help="unmeasured requests before each configuration")
    p.add_argument("--out", default=None, help="output folder (default: bench_runs/WORKLOAD-TIME)")
    p.add_argument("--resume", action="store_true", help="continue the run whose requests.jsonl is in --out")
    p.add_argument(
        "--report-only",
        action="store_true",
        help="write the report of the run logged in --out (same command line) without serving a request; "
        "an interrupted run reports the requests done on every configuration",
    )
    p.add_argument("--json", default=None, help="also write the report to this file")
    p.add_argument("--no-plots", action="store_true", help="skip the PNG plots")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


def add_compare_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("a", help="baseline report.json (optionally REPORT:CONFIG, default its first configuration)")
    p.add_argument("b", help="optimized report.json (optionally REPORT:CONFIG, default its last configuration)")
    p.add_argument("--out", default=None, help="write the comparison's report.json and report.md here")


def main_compare(args: argparse.Namespace) -> int:
    rep = report.compare_files(args.a, args.b)
    if args.out:
        report.write_outputs(rep, Path(args.out), plots=True)
    print(report.markdown(rep))
    return 0

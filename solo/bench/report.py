"""The report of a `solo bench` run: JSON stamped with what produced it, and the seed's Table-4 layout.

``build`` turns each configuration's per-request log entries into a summary (solo.bench.metrics),
accuracy (strict and flexible), the failures by reason, where the accept length came from, and the
per-request series the plots and ``compare`` need. With two configurations the report has a
``comparison`` (first = baseline, second = optimized): decode speed-up and the paired McNemar tests.
``markdown`` renders one table whose columns are baseline, optimized and difference, as the seed's
Table 4; ``compare_files`` builds the same report from two saved ones (e.g. two servers).
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.metadata
import json
import platform
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

from solo.bench import gsm8k
from solo.bench.metrics import RequestRecord, summarize

REPORT_VERSION = 1
PACKAGES = ("solo", "torch", "triton", "transformers", "numpy", "tokenizers", "httpx", "matplotlib")


def fingerprint(obj: Any) -> str:
    """A short hash of a JSON-able object (prompts, parameters), to recognise the same run on resume."""
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()[:16]


def _git(*cmd: str) -> str | None:
    root = Path(__file__).resolve().parents[2]
    try:
        out = subprocess.run(["git", "-C", str(root), *cmd], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def _device() -> dict[str, Any]:
    info: dict[str, Any] = {"platform": platform.platform(), "machine": platform.machine(), "cpu": platform.processor()}
    try:
        import os

        info["cpu_count"] = os.cpu_count()
        import torch

        if torch.cuda.is_available():
            info["gpu"] = torch.cuda.get_device_name(0)
            info["cuda"] = torch.version.cuda
    except ImportError:
        pass
    return info


def stamp(args: argparse.Namespace | None) -> dict[str, Any]:
    """Commit, package versions, device, model and every flag of the run."""
    versions = {"python": sys.version.split()[0]}
    for name in PACKAGES:
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            versions[name] = None
    status = _git("status", "--porcelain", "--untracked-files=no")
    flags = {k: v for k, v in vars(args).items() if not k.startswith("_") and k != "func"} if args else {}
    if flags.get("api_key"):
        flags["api_key"] = "***"
    return {
        "commit": _git("rev-parse", "HEAD"),
        "dirty": bool(status) if status is not None else None,
        "versions": versions,
        "device": _device(),
        "model": flags.get("model") if not flags.get("url") else flags.get("model_name"),
        "flags": flags,
        "argv": sys.argv[1:],
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }


# --------------------------------------------------------------------------- building
def summarize_config(result: dict[str, Any]) -> dict[str, Any]:
    """One configuration's summary from its log entries (and server counters, if any)."""
    entries = result["entries"]
    records = [RequestRecord(**e["record"]) for e in entries]
    wall = sum(e.get("wall_s", e["record"]["latency_s"]) for e in entries)
    s = summarize(records, wall)
    s["target"] = result.get("target", {})
    traffic = s["target"].get("bytes_per_token_at_1k")
    # achieved bandwidth: a decode step's bytes (at 1K positions) x decode tok/s (None: unknown, a server)
    s["decode_gb_per_s"] = traffic * s["decode_throughput"] / 1e9 if traffic and s["decode_throughput"] else None
    s["errors"] = dict(Counter(r.error or "unknown error" for r in records if r.failed))
    s["tokens_estimated"] = sum(1 for e in entries if e.get("tokens_estimated"))
    graded = [e for e in entries if "correct_strict" in e]
    if graded:
        s["accuracy_strict"] = gsm8k.accuracy([e["correct_strict"] for e in graded])
        s["accuracy_flexible"] = gsm8k.accuracy([e["correct_flexible"] for e in graded])
    ok = [(e, r) for e, r in zip(entries, records, strict=True) if not r.failed]
    if s["spec_verify_rounds"]:
        is_server = s["target"].get("kind") == "openai"
        s["accept_length_source"] = "usage.solo_stats" if is_server else "engine"
    elif result.get("server_counters"):
        c = result["server_counters"]
        s.update(
            spec_verify_rounds=c["verify_rounds"],
            spec_drafted_tokens=c["drafted_tokens"],
            spec_accepted_tokens=c["accepted_tokens"],
            accept_length=c["accept_length"],
            acceptance_rate=c["accepted_tokens"] / c["drafted_tokens"] if c["drafted_tokens"] else None,
            per_position_acceptance=[n / c["verify_rounds"] for n in c["accepted_per_position"]],
            accept_length_source=c["source"],
        )
    else:
        s["accept_length_source"] = "unknown" if s["target"].get("kind") == "openai" else "none (plain decoding)"
    if result.get("server_gauges"):
        s["server_reported"] = result["server_gauges"]
    s["per_request"] = {
        "ttft_s": [r.ttft_s for _, r in ok],
        "e2el_s": [r.latency_s for _, r in ok],
        "tpot_s": [r.tpot_s for _, r in ok],
        "output_tokens": [r.output_tokens for _, r in ok],
        "accept_length": [r.accept_length for _, r in ok],
        "index": [i for i, (e, r) in enumerate(zip(entries, records, strict=True)) if not r.failed],
        "correct_strict": [e.get("correct_strict") for e in graded],
        "correct_flexible": [e.get("correct_flexible") for e in graded],
    }
    return s


def comparison(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    """Baseline ``a`` against optimized ``b``: decode speed-up and the paired McNemar tests."""
    out: dict[str, Any] = {}
    if a["decode_throughput"]:
        out["decode_speedup"] = b["decode_throughput"] / a["decode_throughput"]
    for kind in ("strict", "flexible"):
        ca, cb = a["per_request"][f"correct_{kind}"], b["per_request"][f"correct_{kind}"]
        if ca and len(ca) == len(cb):
            only_a, only_b, p = gsm8k.mcnemar(ca, cb)
            out[f"mcnemar_{kind}"] = {"only_baseline_correct": only_a, "only_optimized_correct": only_b, "p_value": p}
    return out


def build(
    results: dict[str, dict[str, Any]], workload: dict[str, Any], stamp_: dict[str, Any], started: float | None = None
) -> dict[str, Any]:
    """The report of a run: configurations in run order, and their comparison when there are two."""
    configs = {name: summarize_config(r) for name, r in results.items()}
    rep: dict[str, Any] = {"version": REPORT_VERSION, "workload": workload, "stamp": stamp_, "configs": configs}
    if started is not None:
        rep["elapsed_s"] = time.time() - started
    if len(configs) == 2:
        a, b = configs.values()
        rep["comparison"] = comparison(a, b)
    return rep


def load(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    if path.is_dir():
        path = path / "report.json"
    try:
        rep = json.loads(path.read_text())
    except FileNotFoundError:
        raise ValueError(f"{path}: no such report (give a report.json written by solo bench).") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not JSON ({e.msg}); give a report.json written by solo bench.") from None
    if not isinstance(rep, dict) or "configs" not in rep or rep.get("version") != REPORT_VERSION:
        raise ValueError(f"{path}: not a solo bench report (version {REPORT_VERSION}); rerun it with this solo.")
    return rep


def _pick(spec: str, last: bool) -> tuple[dict[str, Any], str]:
    path, _, name = spec.rpartition(":") if ":" in Path(spec).name else (spec, "", "")
    rep = load(path)
    names = list(rep["configs"])
    name = name or (names[-1] if last else names[0])
    if name not in rep["configs"]:
        raise ValueError(f"{path} has no configuration {name!r}; it has {names}.")
    return rep, name


def compare_files(spec_a: str, spec_b: str) -> dict[str, Any]:
    """The Table-4 report of two saved runs (``REPORT[:CONFIG]``), baseline first."""
    rep_a, name_a = _pick(spec_a, last=False)
    rep_b, name_b = _pick(spec_b, last=True)
    a, b = rep_a["configs"][name_a], rep_b["configs"][name_b]
    wa, wb = rep_a["workload"], rep_b["workload"]
    if wa.get("requests") != wb.get("requests") or wa.get("name") != wb.get("name"):
        raise ValueError(
            f"the runs measured different workloads ({wa.get('name')} x {wa.get('requests')} vs "
            f"{wb.get('name')} x {wb.get('requests')}): compare runs of the same requests."
        )
    la = a.get("label", name_a)
    lb = b.get("label", name_b)
    if la == lb:
        la, lb = f"{la} (A)", f"{lb} (B)"
    configs = {la: a, lb: b}
    return {
        "version": REPORT_VERSION,
        "workload": wa,
        "stamp": {"compared": [spec_a, spec_b], "a": rep_a["stamp"], "b": rep_b["stamp"]},
        "configs": configs,
        "comparison": comparison(a, b),
    }


# --------------------------------------------------------------------------- rendering
def _f(v: Any, fmt: str) -> str:
    return "-" if v is None else format(v, fmt)


def _diff(a: Any, b: Any, fmt: str) -> str:
    if a is None or b is None:
        return "-"
    d = b - a
    rel = f" ({100 * d / a:+.1f}%)" if a else ""
    return f"{d:+{fmt}}{rel}"


ROWS: tuple[tuple[str, str, float, str], ...] = (
    # label, summary key, scale, format
    ("Decode tok/s (1000 / mean TPOT)", "decode_throughput", 1.0, ".2f"),
    ("Output tok/s (tokens / wall time)", "output_throughput", 1.0, ".2f"),
    ("Decode GB/s (bytes per step x decode tok/s)", "decode_gb_per_s", 1.0, ".2f"),
    ("TPOT mean (ms)", "mean_tpot_ms", 1.0, ".2f"),
    ("TPOT median (ms)", "median_tpot_ms", 1.0, ".2f"),
    ("ITL mean (ms)", "mean_itl_ms", 1.0, ".2f"),
    ("ITL P95 (ms)", "p95_itl_ms", 1.0, ".2f"),
    ("E2E latency mean (s)", "mean_e2el_ms", 1e-3, ".3f"),
    ("E2E latency median (s)", "median_e2el_ms", 1e-3, ".3f"),
    ("E2E latency P95 (s)", "p95_e2el_ms", 1e-3, ".3f"),
    ("E2E latency P99 (s)", "p99_e2el_ms", 1e-3, ".3f"),
    ("TTFT mean (s)", "mean_ttft_ms", 1e-3, ".3f"),
    ("TTFT median (s)", "median_ttft_ms", 1e-3, ".3f"),
    ("TTFT P99 (s)", "p99_ttft_ms", 1e-3, ".3f"),
    ("Accept length", "accept_length", 1.0, ".2f"),
)


def _value(s: dict[str, Any], key: str, scale: float) -> float | None:
    v = s.get(key)
    if v is None or (s.get("completed", 0) == 0 and key != "accept_length"):
        return None
    return v * scale


def markdown(rep: dict[str, Any]) -> str:
    """The seed's Table-4 layout: one row per metric, a column per configuration, and the difference."""
    names = list(rep["configs"])
    cfgs = [rep["configs"][n] for n in names]
    pair = len(cfgs) == 2
    w = rep["workload"]
    s0 = w.get("sampling", {})
    count = f"{w.get('requests')} requests"
    if w.get("of_requests", w.get("requests")) != w.get("requests"):
        count = f"{w.get('requests')} of {w.get('of_requests')} requests (interrupted: those done by every config)"
    title = (
        f"{w.get('name')}: {count}, max {w.get('max_tokens')} tokens, temperature "
        f"{s0.get('temperature')}, top-p {s0.get('top_p')}, top-k {s0.get('top_k')}"
    )
    head = ["Metric", *names] + (["Difference"] if pair else [])
    lines = [f"**{title}**", "", "| " + " | ".join(head) + " |", "|---" + "|---:" * (len(head) - 1) + "|"]

    def row(label: str, values: list[str], diff: str = "") -> None:
        lines.append("| " + " | ".join([label, *values] + ([diff] if pair else [])) + " |")

    row(
        "Requests completed / failed / truncated",
        [f"{s['completed']} / {s['failed']} / {s['truncated']}" for s in cfgs],
        "",
    )
    for label, key, scale, fmt in ROWS:
        vals = [_value(s, key, scale) for s in cfgs]
        row(label, [_f(v, fmt) for v in vals], _diff(vals[0], vals[1], fmt) if pair else "")
    row("Accept length from", [str(s.get("accept_length_source", "-")) for s in cfgs], "")
    row(
        "Per-position acceptance",
        [" / ".join(f"{p:.2f}" for p in s.get("per_position_acceptance") or []) or "-" for s in cfgs],
        "",
    )
    comp = rep.get("comparison", {})
    for kind in ("strict", "flexible"):
        key = f"accuracy_{kind}"
        if all(key in s for s in cfgs):
            vals = [100 * s[key] for s in cfgs]
            diff = ""
            if pair:
                m = comp.get(f"mcnemar_{kind}")
                diff = f"{vals[1] - vals[0]:+.2f} pp" + (f" (McNemar p = {m['p_value']:.3g})" if m else "")
            row(f"Accuracy, {kind} (%)", [f"{v:.2f}" for v in vals], diff)
    if pair and "decode_speedup" in comp:
        lines.append("")
        lines.append(f"Decode speed-up ({names[1]} / {names[0]}): **{comp['decode_speedup']:.3f}x**")
    for name, s in zip(names, cfgs, strict=True):
        if s.get("errors"):
            reasons = "; ".join(f"{n} x {why}" for why, n in s["errors"].items())
            lines.append(f"\n{name}: {s['failed']} failed requests: {reasons}")
        if s.get("tokens_estimated"):
            lines.append(
                f"\n{name}: the server reported no token counts for {s['tokens_estimated']} requests; "
                "counted one token per streamed chunk"
            )
    return "\n".join(lines)


def write_outputs(rep: dict[str, Any], out: Path, plots: bool = True) -> list[Path]:
    """report.json, report.md and (with ``plots``) the PNGs into ``out``; returns what was written."""
    out.mkdir(parents=True, exist_ok=True)
    written = [out / "report.json", out / "report.md"]
    (out / "report.json").write_text(json.dumps(rep, indent=2, default=str))
    (out / "report.md").write_text(markdown(rep) + "\n")
    if plots:
        from solo.bench import plots as plotting

        written += plotting.write_all(rep, out)
    return written

"""The benchmark harness: same requests for each configuration, metrics and grading in the report."""

from __future__ import annotations

import json
import subprocess
import sys


def test_bench_repeat_side_by_side_json(tiny_checkpoints, tmp_path):
    path = tiny_checkpoints["a"][0]
    out = tmp_path / "report.json"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "solo.cli",
            "bench",
            "repeat",
            "--model",
            str(path),
            "--num-prompts",
            "2",
            "--input-len",
            "24",
            "--output-len",
            "12",
            "--speculative-algorithm",
            "NEXTN",
            "--allow-fallback",
            "--baseline",
            "--json",
            str(out),
        ],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stderr
    report = json.loads(out.read_text())
    base, mtp = report["configs"]["baseline"], report["configs"]["mtp"]
    assert base["completed"] == mtp["completed"] == 2
    assert base["total_output_tokens"] == mtp["total_output_tokens"] == 24
    assert base["accept_length"] is None and 1.0 <= mtp["accept_length"] <= 4.0
    assert report["decode_speedup"] > 0 and "decode speed ratio" in proc.stdout


def test_bench_gsm8k_grades_answers(tiny_checkpoints, tmp_path):
    path = tiny_checkpoints["a"][0]
    out = tmp_path / "report.json"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "solo.cli",
            "bench",
            "gsm8k",
            "--model",
            str(path),
            "--num-prompts",
            "2",
            "--output-len",
            "8",
            "--json",
            str(out),
        ],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stderr
    report = json.loads(out.read_text())
    assert report["configs"]["plain"]["accuracy_strict"] == 0.0  # a random model answers nothing
    assert report["workload"]["requests"] == 2

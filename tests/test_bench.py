"""`solo bench` end to end: the same requests for each configuration, the report's files and stamp,
and the same GSM8K questions through `--url` against a `solo serve` giving the same answers."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from solo.assets import bundled_model
from solo.bench.plots import PLOTS

ROOT = Path(__file__).resolve().parents[1]
BUNDLED = bundled_model()

# GSM8K-shaped examples (question, worked answer ending in #### N), written by the tests themselves
TRAIN = [
    ("Tom has 3 bags with 4 apples in each bag. How many apples does Tom have?", "3 * 4 = <<3*4=12>>12\n#### 12"),
    (
        "A shop sold 15 pens in the morning and 9 in the afternoon. How many pens did it sell?",
        "15 + 9 = <<15+9=24>>24\n#### 24",
    ),
    ("Sara had 20 dollars and spent 7. How many dollars does she have left?", "20 - 7 = <<20-7=13>>13\n#### 13"),
    ("A box holds 6 eggs. How many eggs are in 5 boxes?", "6 * 5 = <<6*5=30>>30\n#### 30"),
    ("Ben reads 10 pages a day. How many pages does he read in 7 days?", "10 * 7 = <<10*7=70>>70\n#### 70"),
    ("There are 40 students and 8 are absent. How many are present?", "40 - 8 = <<40-8=32>>32\n#### 32"),
]
TEST = [
    ("Anna has 5 boxes with 3 toys in each box. How many toys does Anna have?", "5 * 3 = <<5*3=15>>15\n#### 15"),
    ("A farmer had 18 cows and sold 6. How many cows are left?", "18 - 6 = <<18-6=12>>12\n#### 12"),
]


def write_gsm8k(folder: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    for name, rows in (("train", TRAIN), ("test", TEST)):
        lines = [json.dumps({"question": q, "answer": a}) for q, a in rows]
        (folder / f"{name}.jsonl").write_text("\n".join(lines) + "\n")
    return folder


def solo(*args: str, timeout: float = 900) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run(
        [sys.executable, "-m", "solo.cli", *args], capture_output=True, text=True, timeout=timeout, env=env
    )


def test_bench_repeat_side_by_side_writes_every_output(tiny_checkpoints, tmp_path):
    path = tiny_checkpoints["a"][0]
    out = tmp_path / "run"
    proc = solo(
        "bench", "repeat", "--model", str(path), "--num-prompts", "2", "--input-len", "24", "--output-len", "12",
        "--speculative-algorithm", "NEXTN", "--allow-fallback", "--baseline", "--out", str(out), "--json",
        str(tmp_path / "copy.json"),
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    report = json.loads((out / "report.json").read_text())
    assert json.loads((tmp_path / "copy.json").read_text()) == report
    base, opt = report["configs"]["baseline"], report["configs"]["optimized"]
    assert base["completed"] == opt["completed"] == 2
    assert base["total_output_tokens"] == opt["total_output_tokens"] == 24 and base["truncated"] == 2
    assert base["accept_length"] is None and 1.0 <= opt["accept_length"] <= 4.0
    assert opt["accept_length_source"] == "engine" and len(opt["per_position_acceptance"]) == 3
    assert report["comparison"]["decode_speedup"] > 0
    stamp = report["stamp"]
    assert stamp["versions"]["torch"] and stamp["device"]["cpu_count"] and stamp["flags"]["baseline"] is True
    assert stamp["flags"]["speculative_algorithm"] == "NEXTN" and stamp["model"] == str(path)
    assert len(stamp["commit"] or "") == 40 or stamp["commit"] is None
    for name in PLOTS:
        assert (out / name).read_bytes().startswith(b"\x89PNG")
    log = (out / "requests.jsonl").read_text().splitlines()
    assert json.loads(log[0])["kind"] == "header" and len(log) == 1 + 4
    md = (out / "report.md").read_text()
    assert "| Metric | baseline | optimized | Difference |" in md and md.strip() in proc.stdout
    # a finished run resumed does nothing more and reports the same requests
    again = solo(
        "bench", "repeat", "--model", str(path), "--num-prompts", "2", "--input-len", "24", "--output-len", "12",
        "--speculative-algorithm", "NEXTN", "--allow-fallback", "--baseline", "--out", str(out), "--resume",
        "--no-plots",
    )  # fmt: skip
    assert again.returncode == 0, again.stderr
    assert "4 requests already done" in again.stderr
    assert json.loads((out / "report.json").read_text())["configs"]["optimized"]["per_request"] == opt["per_request"]


def test_bench_usage_errors(tiny_checkpoints, tmp_path):
    path = tiny_checkpoints["a"][0]
    proc = solo("bench", "repeat", "--model", str(path), "--baseline", "--out", str(tmp_path / "x"))
    assert proc.returncode == 2 and "add --speculative-algorithm NEXTN" in proc.stderr
    proc = solo("bench", "gsm8k", "--url", "http://127.0.0.1:9/v1", "--baseline")
    assert proc.returncode == 1 and "solo bench compare" in proc.stderr
    proc = solo("bench", "gsm8k", "--model", str(path), "--data", str(tmp_path / "none"), "--no-progress")
    assert proc.returncode == 1 and "test.jsonl not found: pass --data DIR" in proc.stderr
    proc = solo("bench", "synthetic", "--url", "http://127.0.0.1:9/v1", "--out", str(tmp_path / "s"))
    assert proc.returncode == 1 and "needs --vocab-size" in proc.stderr


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
@pytest.mark.skipif(not (BUNDLED / "config.json").is_file(), reason="bundled model not in this checkout")
def test_gsm8k_in_process_and_through_solo_serve_agree(tmp_path):
    pytest.importorskip("uvicorn")
    data = write_gsm8k(tmp_path / "gsm8k")
    port = free_port()
    spec = ("--speculative-algorithm", "NEXTN", "--lm-head", "fp8")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    server = subprocess.Popen(
        [sys.executable, "-m", "solo.cli", "serve", "--model", str(BUNDLED), "--port", str(port), *spec],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        common = ("--data", str(data), "--output-len", "48", "--warmup", "0", "--no-progress")
        local = solo(
            "bench", "gsm8k", "--model", str(BUNDLED), *spec, "--baseline", "--out", str(tmp_path / "a"), *common
        )
        assert local.returncode == 0, local.stderr
        assert "| Metric | baseline | optimized | Difference |" in local.stdout and "McNemar" in local.stdout
        deadline = time.monotonic() + 600
        while True:
            assert server.poll() is None, server.stderr.read()
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "solo serve did not come up"
            time.sleep(1)
        remote = solo("bench", "gsm8k", "--url", f"http://127.0.0.1:{port}/v1", "--out", str(tmp_path / "b"), *common)
        assert remote.returncode == 0, remote.stderr
    finally:
        server.terminate()
        server.wait(30)
    a = tmp_path / "a"
    for name in ("report.json", "report.md", *PLOTS):
        assert (a / name).is_file(), name
    log_a = [json.loads(x) for x in (a / "requests.jsonl").read_text().splitlines()[1:]]
    log_b = [json.loads(x) for x in (tmp_path / "b" / "requests.jsonl").read_text().splitlines()[1:]]
    local_opt = [e for e in log_a if e["config"] == "optimized"]
    local_base = [e for e in log_a if e["config"] == "baseline"]
    assert len(local_opt) == len(log_b) == 2
    # greedy, fp32 on the CPU: the same text, tokens and acceptance in-process and over the wire
    assert [e["text"] for e in local_opt] == [e["text"] for e in log_b] == [e["text"] for e in local_base]
    for x, y in zip(local_opt, log_b, strict=True):
        rx, ry = x["record"], y["record"]
        assert (rx["output_tokens"], rx["verify_rounds"], rx["accepted_tokens"]) == (
            ry["output_tokens"],
            ry["verify_rounds"],
            ry["accepted_tokens"],
        )
        assert rx["accepted_per_position"] == ry["accepted_per_position"]
        assert x["correct_strict"] == y["correct_strict"]
    rep_a = json.loads((a / "report.json").read_text())
    rep_b = json.loads((tmp_path / "b" / "report.json").read_text())
    opt, srv = rep_a["configs"]["optimized"], rep_b["configs"]["server"]
    assert srv["accept_length"] == opt["accept_length"] and srv["accept_length_source"] == "usage.solo_stats"
    assert opt["accept_length"] > 1.2 and srv["failed"] == 0 and srv["tokens_estimated"] == 0
    # the two saved runs compared give the same accuracy test as the single A/B run's
    cmp = solo("bench", "compare", f"{a}/report.json:baseline", str(tmp_path / "b"))
    assert cmp.returncode == 0, cmp.stderr
    assert "| Metric | baseline | server | Difference |" in cmp.stdout


def test_decode_traffic_counts_every_byte_once_with_the_routers_apart(tiny_checkpoints):
    """The step's bytes: routers apart from the dense weights (each router's weight and bias once), the KDA
    layers' q|k|v|f|g|b apart too (a fused KDA front's bytes), the MLA cache growing by one latent + rope row per
    MLA layer and position, the total their sum."""
    import torch

    from solo.checkpoint.loader import load_model
    from solo.engine.traffic import KDA_INPUT_PROJECTIONS, decode_traffic
    from solo.model.kda import KimiDeltaAttention
    from solo.model.moe import Router

    model = load_model(tiny_checkpoints["a"][0])
    c = model.config
    trunk = model.model.layers[: c.num_hidden_layers]  # the NEXTN layer is the draft's, not the step's
    routers = [m for m in trunk.modules() if isinstance(m, Router)]
    assert routers
    context = int(torch.randint(8, 200, ()))
    traffic = decode_traffic(model, context)
    assert traffic.routers == sum(p.nbytes for m in routers for p in m.parameters(recurse=False))
    kda = [m for m in trunk.modules() if isinstance(m, KimiDeltaAttention)]
    assert kda
    inputs = sum(p.nbytes for m in kda for n in KDA_INPUT_PROJECTIONS for p in getattr(m, n).parameters())
    assert traffic.kda_inputs == inputs
    assert traffic.dense_weights + traffic.kda_inputs + traffic.routers <= sum(p.nbytes for p in trunk.parameters())
    assert traffic.dense_weights > sum(p.nbytes for m in kda for p in m.dense.parameters())  # o_proj stays dense
    fields = traffic.to_dict()
    assert fields["total"] == sum(v for k, v in fields.items() if k != "total")
    row = (c.kv_lora_rank + c.qk_rope_head_dim) * model.dtype.itemsize * len(c.mla_layers)
    assert decode_traffic(model, context + 1).mla_cache - traffic.mla_cache == row

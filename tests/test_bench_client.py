"""The OpenAI-compatible client of `solo bench`: metric arithmetic against a fake server with fixed
chunk times, failures (HTTP errors, error events, malformed streams, timeouts, unreachable servers)
counted with their reason while the run goes on, Prometheus counters, --resume and compare."""

from __future__ import annotations

import argparse
import json
import socket
import threading
import time
from pathlib import Path

import httpx
import pytest

from solo.bench import harness, promcounters, report
from solo.bench.metrics import RequestRecord, summarize
from solo.bench.targets import OpenAITarget, Outcome, Request, completion_body, parse_stream
from solo.engine.request import GenerationParams
from solo.engine.sampling import SamplingParams


class FakeClock:
    """A clock the fake server moves: each chunk arrives exactly at its scheduled time."""

    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def sse(obj: object) -> bytes:
    return f"data: {json.dumps(obj)}\n\n".encode()


def text_chunk(text: str, finish: str | None = None, usage: dict | None = None) -> bytes:
    body: dict = {"object": "text_completion", "choices": [{"index": 0, "text": text, "finish_reason": finish}]}
    if usage is not None:
        body["usage"] = usage
    return sse(body)


class TimedStream(httpx.SyncByteStream):
    """Yields (offset, bytes) pieces, setting the fake clock to the request's send time plus each
    piece's offset before it is read."""

    def __init__(self, clock: FakeClock, pieces: list[tuple[float, bytes]]) -> None:
        self.clock, self.pieces, self.base = clock, pieces, clock.t

    def __iter__(self):
        for offset, data in self.pieces:
            self.clock.t = self.base + offset
            yield data


def fake_server(clock: FakeClock, scripts: list) -> httpx.MockTransport:
    """Each POST gets the next script: a list of (offset from sending, bytes) pieces, or (status, json body)."""
    calls = iter(scripts)
    seen: list[dict] = []

    def handler(request: httpx.Request) -> httpx.Response:
        if request.method == "GET":
            return httpx.Response(404)
        seen.append(json.loads(request.content))
        script = next(calls)
        if isinstance(script, tuple):
            return httpx.Response(script[0], json=script[1])
        return httpx.Response(200, headers={"content-type": "text/event-stream"}, stream=TimedStream(clock, script))

    transport = httpx.MockTransport(handler)
    transport.seen = seen  # type: ignore[attr-defined]
    return transport


def request(max_tokens: int = 8) -> Request:
    sampling = SamplingParams(temperature=0.6, top_k=29, top_p=0.95, seed=3)
    return Request("Question: 1+1?\nAnswer:", GenerationParams(max_tokens, sampling, ("Question:",)), "2")


USAGE = {"prompt_tokens": 7, "completion_tokens": 6, "total_tokens": 13}
# text chunks 0.25, 0.30, 0.50, 0.80 s after sending (the last carries two tokens), then usage
CHUNKS = [
    (0.25, text_chunk("The")),
    (0.30, text_chunk(" answer")),
    (0.50, text_chunk(" is")),
    (0.80, text_chunk(" #### 2")),
    (0.90, text_chunk("", "stop", USAGE)),
    (1.00, b"data: [DONE]\n\n"),
]


def target_for(clock: FakeClock, scripts: list, **kw) -> tuple[OpenAITarget, httpx.MockTransport]:
    transport = fake_server(clock, scripts)
    clock.t = 10.0  # the first request is sent at 10.0
    return OpenAITarget("http://fake/v1", clock=clock, transport=transport, **kw), transport


def test_wire_metrics_are_exact():
    clock = FakeClock()
    target, transport = target_for(clock, [CHUNKS], model_name="m")
    out = target.run(request())
    r = out.record
    assert out.text == "The answer is #### 2" and not out.tokens_estimated
    assert r.prompt_tokens == 7 and r.output_tokens == 6 and r.finish_reason == "stop"
    assert r.ttft_s == pytest.approx(0.25, abs=1e-12)
    assert r.latency_s == pytest.approx(0.80, abs=1e-12)  # the last text chunk, not [DONE]
    assert r.itl_s == pytest.approx([0.05, 0.20, 0.30], abs=1e-12)
    assert r.tpot_s == pytest.approx((0.80 - 0.25) / 5, abs=1e-12)
    assert r.accept_length is None  # this server reports no acceptance
    body = transport.seen[0]
    assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
    assert (body["temperature"], body["top_p"], body["top_k"], body["seed"]) == (0.6, 0.95, 29, 3)
    assert body["stop"] == ["Question:"] and body["max_tokens"] == 8 and body["model"] == "m"


def test_percentiles_over_fake_runs_are_exact():
    clock = FakeClock()
    # three requests whose TTFTs are 0.1, 0.2, 0.4 s and E2E 1.1, 1.2, 2.4 s; 11 tokens each
    scripts = []
    for ttft, e2e in ((0.1, 1.1), (0.2, 1.2), (0.4, 2.4)):
        usage = {"prompt_tokens": 3, "completion_tokens": 11}
        scripts.append([(ttft, text_chunk("a")), (e2e, text_chunk("b", "length", usage)), (e2e, b"")])
    target, _ = target_for(clock, scripts)
    records = []
    for _ in scripts:
        records.append(target.run(request()).record)
    s = summarize(records, wall_time_s=5.0)
    assert s["completed"] == 3 and s["truncated"] == 3 and s["failed"] == 0
    assert s["mean_ttft_ms"] == pytest.approx(700 / 3)
    assert s["median_ttft_ms"] == pytest.approx(200.0)
    assert s["p95_ttft_ms"] == pytest.approx(200 + 0.9 * 200)  # rank 1.9 between 200 and 400
    assert s["p99_e2el_ms"] == pytest.approx(1200 + 0.98 * 1200)
    assert s["mean_tpot_ms"] == pytest.approx((100 + 100 + 200) / 3)  # (e2e - ttft) / 10
    assert s["output_throughput"] == pytest.approx(33 / 5.0)
    assert s["mean_itl_ms"] == pytest.approx((1000 + 1000 + 2000) / 3)


def test_solo_stats_give_accept_length_and_chat_deltas_are_read():
    clock = FakeClock()
    stats = {"verify_rounds": 4, "drafted_tokens": 12, "accepted_tokens": 6, "accepted_per_position": [3, 2, 1]}
    usage = {"prompt_tokens": 5, "completion_tokens": 10, "solo_stats": stats}
    chunks = [
        (0.1, sse({"choices": [{"index": 0, "delta": {"role": "assistant"}, "finish_reason": None}]})),
        (0.2, sse({"choices": [{"index": 0, "delta": {"content": "x"}, "finish_reason": None}]})),
        (0.4, sse({"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}], "usage": usage})),
        (0.5, b"data: [DONE]\n\n"),
    ]
    target, _ = target_for(clock, [chunks])
    out = target.run(request())
    assert out.text == "x" and out.record.ttft_s == pytest.approx(0.2)
    assert out.record.accept_length == pytest.approx(1 + 6 / 4)
    assert out.record.accepted_per_position == [3, 2, 1]


@pytest.mark.parametrize(
    ("pieces", "reason"),
    [
        ([(0.1, text_chunk("a")), (0.2, b"data: {not json\n\n")], "malformed stream: data is not JSON"),
        ([(0.1, b"hello there\n\n")], "not server-sent data"),
        ([(0.1, text_chunk("a")), (0.2, sse({"error": {"message": "CUDA out of memory"}}))], "CUDA out of memory"),
        ([(0.1, text_chunk("a"))], "ended without a finish reason"),
        ([(0.1, sse([1, 2]))], "not a JSON object"),
    ],
)
def test_malformed_streams_fail_with_their_reason(pieces, reason):
    clock = FakeClock()
    target, _ = target_for(clock, [pieces])
    out = target.run(request())
    assert out.record.failed and reason in out.record.error


def test_no_usage_counts_chunks_and_says_so():
    out = parse_stream([(1.5, text_chunk("a").decode()), (2.0, text_chunk("b", "stop").decode())], sent_at=1.0)
    assert out.tokens_estimated and out.record.output_tokens == 2 and out.record.latency_s == pytest.approx(1.0)


def args_for(tmp_path: Path, **kw) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    harness.add_arguments(p, kw.pop("workload", "jsonl"))
    ns = p.parse_args(kw.pop("argv", []))
    ns.workload = "jsonl" if hasattr(ns, "file") else "repeat"
    ns.out = str(tmp_path / "run")
    ns.no_progress = True
    ns.no_plots = kw.pop("no_plots", True)
    ns.warmup = 0
    for k, v in kw.items():
        setattr(ns, k, v)
    return ns


def write_prompts(tmp_path: Path, n: int) -> Path:
    f = tmp_path / "prompts.jsonl"
    f.write_text(
        "".join(json.dumps({"prompt": f"Question: {i}+1?\nAnswer:", "answer": str(i + 1)}) + "\n" for i in range(n))
    )
    return f


def test_server_errors_mid_run_are_counted_and_the_run_goes_on(tmp_path):
    clock = FakeClock()
    good = [
        (0.2, text_chunk(" #### 1")),
        (0.3, text_chunk("", "stop", {"completion_tokens": 3})),
        (0.4, b"data: [DONE]\n\n"),
    ]
    scripts = [good, (500, {"error": {"message": "engine crashed"}}), (503, {"detail": "overloaded"}), good]
    target, _ = target_for(clock, scripts)
    args = args_for(tmp_path, argv=[str(write_prompts(tmp_path, 4))])
    rep = harness.run_bench(args, [target])
    s = rep["configs"]["server"]
    assert (s["completed"], s["failed"]) == (2, 2)
    assert s["errors"] == {"HTTP 500: engine crashed": 1, "HTTP 503: {'detail': 'overloaded'}": 1}
    # question 0 (answer 1) right, question 3 (answer 4) wrong; a failed request counts as wrong
    assert s["accuracy_strict"] == 0.25
    assert s["accept_length"] is None and s["accept_length_source"] == "unknown"
    md = (tmp_path / "run" / "report.md").read_text()
    assert "2 failed requests" in md and "HTTP 500: engine crashed" in md


def test_unreachable_url_fails_every_request_with_the_reason(tmp_path):
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    target = OpenAITarget(f"http://127.0.0.1:{port}/v1", timeout_s=5)
    args = args_for(tmp_path, argv=[str(write_prompts(tmp_path, 2))])
    rep = harness.run_bench(args, [target])
    s = rep["configs"]["server"]
    assert s["failed"] == 2 and s["completed"] == 0
    (reason,) = s["errors"]
    assert f"cannot connect to http://127.0.0.1:{port}/v1" in reason and "Is the server running?" in reason


def test_a_stalled_server_times_out(tmp_path):
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(4)
    port = srv.getsockname()[1]
    stop = threading.Event()

    def serve() -> None:  # accepts, sends headers and one chunk, then stalls
        srv.settimeout(0.2)
        conns = []
        while not stop.is_set():
            try:
                conn, _ = srv.accept()
            except OSError:
                continue
            conn.recv(65536)
            conn.sendall(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n")
            data = text_chunk("a")
            conn.sendall(f"{len(data):x}\r\n".encode() + data + b"\r\n")
            conns.append(conn)
        for c in conns:
            c.close()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        target = OpenAITarget(f"http://127.0.0.1:{port}/v1", timeout_s=0.5)
        start = time.perf_counter()
        out = target.run(request())
        assert time.perf_counter() - start < 5
        assert out.record.failed and out.record.error.startswith("timeout (ReadTimeout)")
    finally:
        stop.set()
        thread.join(5)
        srv.close()


METRICS_BEFORE = """# HELP vllm:spec_decode_num_drafts_total drafts
vllm:spec_decode_num_drafts_total{model_name="m"} 10
vllm:spec_decode_num_draft_tokens_total{model_name="m"} 30
vllm:spec_decode_num_accepted_tokens_total{model_name="m"} 12
vllm:spec_decode_num_accepted_tokens_per_pos_total{model_name="m",position="0"} 7
vllm:spec_decode_num_accepted_tokens_per_pos_total{model_name="m",position="1"} 5
sglang:spec_accept_length 2.5
"""


def test_prometheus_counters_give_a_runs_accept_length():
    before = promcounters.parse_metrics(METRICS_BEFORE)
    after = promcounters.parse_metrics(
        METRICS_BEFORE.replace("} 10", "} 30")
        .replace("} 30\nvllm:spec_decode_num_accepted_tokens_total", "} 90\nvllm:spec_decode_num_accepted_tokens_total")
        .replace("} 12", "} 52")
        .replace('"0"} 7', '"0"} 27')
        .replace('"1"} 5', '"1"} 25')
    )
    delta = promcounters.spec_delta(before, after)
    assert delta is not None and delta.source == "prometheus:vllm"
    assert (delta.verify_rounds, delta.drafted_tokens, delta.accepted_tokens) == (20, 60, 40)
    assert delta.accepted_per_position == [20, 20]
    assert delta.accept_length == pytest.approx(3.0)
    assert promcounters.gauges(after) == {"sglang:spec_accept_length": 2.5}
    assert promcounters.spec_delta(before, {"other_total": 1.0}) is None


class Flaky:
    """A target that answers from a list and raises KeyboardInterrupt at one request (an interrupted run)."""

    name = "server"

    def __init__(self, interrupt_at: int | None) -> None:
        self.interrupt_at, self.calls = interrupt_at, 0

    def describe(self) -> dict:
        return {"kind": "fake"}

    def run(self, req: Request) -> Outcome:
        if self.calls == self.interrupt_at:
            raise KeyboardInterrupt
        self.calls += 1
        out = parse_stream([(0.5, text_chunk(" #### 2", "stop", {"completion_tokens": 4}).decode())], 0.0)
        return out


def test_resume_continues_an_interrupted_run(tmp_path):
    prompts = str(write_prompts(tmp_path, 5))
    with pytest.raises(KeyboardInterrupt):
        harness.run_bench(args_for(tmp_path, argv=[prompts]), [Flaky(interrupt_at=3)])
    log = (tmp_path / "run" / harness.LOG_NAME).read_text().splitlines()
    assert len(log) == 1 + 3  # header and three requests
    with pytest.raises(ValueError, match="pass --resume"):
        harness.run_bench(args_for(tmp_path, argv=[prompts]), [Flaky(None)])
    again = Flaky(None)
    rep = harness.run_bench(args_for(tmp_path, argv=[prompts, "--resume"]), [again])
    assert again.calls == 2 and rep["configs"]["server"]["completed"] == 5
    assert rep["configs"]["server"]["accuracy_strict"] == pytest.approx(1 / 5)  # only question 1 has answer 2
    (tmp_path / "p2").mkdir()
    with pytest.raises(harness.ResumeMismatch, match="different run"):
        harness.run_bench(args_for(tmp_path, argv=[str(write_prompts(tmp_path / "p2", 4)), "--resume"]), [Flaky(None)])


def test_jsonl_lines_are_checked(tmp_path):
    from solo.bench.workloads import jsonl_requests

    f = tmp_path / "p.jsonl"
    sampling = SamplingParams()
    f.write_text('{"prompt": "a", "temperature": 0.7, "max_tokens": 5, "stop": "Q:"}\n\n{"prompt": [5, 6]}\n')
    reqs = jsonl_requests(f, None, sampling, 9)
    assert (
        reqs[0].params.sampling.temperature == 0.7 and reqs[0].params.max_tokens == 5 and reqs[0].params.stop == ("Q:",)
    )
    assert reqs[1].prompt == [5, 6] and reqs[1].params.max_tokens == 9
    for bad, msg in (
        ('{"text": "a"}', "must be an object with a 'prompt'"),
        ('{"prompt": "a", "temp": 1}', "unknown fields"),
        ("{oops", "not JSON"),
        ('{"prompt": "a", "top_p": 0}', "top_p must be in"),
    ):
        f.write_text(bad + "\n")
        with pytest.raises(ValueError, match=msg):
            jsonl_requests(f, None, sampling, 9)


def fake_result(name: str, correct: list[bool], tpot: float) -> dict:
    entries = []
    for i, ok in enumerate(correct):
        out = 11
        rec = {
            "prompt_tokens": 5,
            "output_tokens": out,
            "ttft_s": 0.1 * (i + 1),
            "latency_s": 0.1 * (i + 1) + tpot * (out - 1),
            "itl_s": [tpot] * (out - 1),
            "drafted_tokens": 0,
            "accepted_tokens": 0,
            "verify_rounds": 0,
            "accepted_per_position": [],
            "finish_reason": "stop",
            "error": "",
        }
        if name == "optimized":
            rec.update(
                drafted_tokens=12, accepted_tokens=6 + i, verify_rounds=4, accepted_per_position=[3, 2 + i % 2, 1]
            )
        entries.append(
            {"record": rec, "text": "", "correct_strict": ok, "correct_flexible": ok, "wall_s": rec["latency_s"]}
        )
    return {"entries": entries, "target": {"kind": "engine"}}


def test_compare_of_two_saved_reports_reproduces_the_ab_table(tmp_path):
    base_ok = [True, True, False, True, False, True]
    opt_ok = [True, False, False, True, True, True]
    workload = {
        "name": "gsm8k",
        "requests": 6,
        "sampling": {"temperature": 0.6, "top_p": 0.95, "top_k": 29},
        "max_tokens": 11,
    }
    ab = report.build(
        {"baseline": fake_result("baseline", base_ok, 0.03), "optimized": fake_result("optimized", opt_ok, 0.02)},
        workload,
        {"commit": "x"},
    )
    assert ab["comparison"]["decode_speedup"] == pytest.approx(1.5)
    m = ab["comparison"]["mcnemar_strict"]
    assert (m["only_baseline_correct"], m["only_optimized_correct"], m["p_value"]) == (1, 1, 1.0)
    a = report.build({"baseline": fake_result("baseline", base_ok, 0.03)}, workload, {"commit": "a"})
    b = report.build({"optimized": fake_result("optimized", opt_ok, 0.02)}, workload, {"commit": "b"})
    for name, rep in (("ab", ab), ("a", a), ("b", b)):
        report.write_outputs(rep, tmp_path / name, plots=False)
    joined = report.compare_files(str(tmp_path / "a" / "report.json"), str(tmp_path / "b"))
    assert report.markdown(joined) == report.markdown(ab)
    assert (
        report.compare_files(str(tmp_path / "ab" / "report.json") + ":baseline", str(tmp_path / "ab"))["comparison"]
        == ab["comparison"]
    )
    table = report.markdown(ab)
    assert "| Decode tok/s (1000 / mean TPOT) | 33.33 | 50.00 | +16.67 (+50.0%) |" in table
    assert "| Accuracy, strict (%) | 66.67 | 66.67 | +0.00 pp (McNemar p = 1) |" in table
    with pytest.raises(ValueError, match="no configuration 'nope'"):
        report.compare_files(str(tmp_path / "a" / "report.json") + ":nope", str(tmp_path / "b"))
    with pytest.raises(ValueError, match="not a solo bench report"):
        (tmp_path / "junk.json").write_text("{}")
        report.compare_files(str(tmp_path / "junk.json"), str(tmp_path / "b"))


def test_plots_are_written(tmp_path):
    pytest.importorskip("matplotlib")
    workload = {"name": "gsm8k", "requests": 3}
    rep = report.build(
        {
            "baseline": fake_result("baseline", [True] * 3, 0.03),
            "optimized": fake_result("optimized", [True] * 3, 0.02),
        },
        workload,
        {},
    )
    written = report.write_outputs(rep, tmp_path)
    from solo.bench.plots import PLOTS

    for name in PLOTS:
        data = (tmp_path / name).read_bytes()
        assert data.startswith(b"\x89PNG") and len(data) > 5000, name
    assert {p.name for p in written} >= set(PLOTS)


def test_completion_body_omits_what_is_default():
    body = completion_body(Request([1, 2], GenerationParams(4, SamplingParams(), (), True)), None)
    assert body == {
        "prompt": [1, 2],
        "max_tokens": 4,
        "temperature": 0.0,
        "top_p": 1.0,
        "stream": True,
        "stream_options": {"include_usage": True},
        "ignore_eos": True,
    }


class _OrderTarget:
    """A target that records the order in which requests reach it (shared list across targets)."""

    def __init__(self, name: str, calls: list[tuple[str, str]]) -> None:
        self.name, self.calls = name, calls

    def run(self, request: Request) -> Outcome:
        self.calls.append((self.name, str(request.prompt)))
        return Outcome(RequestRecord(prompt_tokens=1, output_tokens=2, ttft_s=0.01, latency_s=0.02), " #### 1")

    def describe(self) -> dict:
        return {"kind": "fake", "name": self.name}


@pytest.mark.parametrize("interleave", [False, True])
def test_interleave_alternates_the_configurations_request_by_request(tmp_path, interleave):
    calls: list[tuple[str, str]] = []
    targets = [_OrderTarget("baseline", calls), _OrderTarget("optimized", calls)]
    prompts = write_prompts(tmp_path, 3)
    args = args_for(tmp_path, argv=[str(prompts), *(["--interleave"] if interleave else [])])
    rep = harness.run_bench(args, targets)
    order = [name for name, _ in calls]
    if interleave:
        assert order == ["baseline", "optimized"] * 3
    else:
        assert order == ["baseline"] * 3 + ["optimized"] * 3
    assert list(rep["configs"]) == ["baseline", "optimized"]
    assert all(c["completed"] == 3 and c["accuracy_strict"] == pytest.approx(1 / 3) for c in rep["configs"].values())
    assert "comparison" in rep


def test_report_only_reports_an_interrupted_ab_on_the_requests_both_sides_finished(tmp_path):
    calls: list[tuple[str, str]] = []
    targets = [_OrderTarget("baseline", calls), _OrderTarget("optimized", calls)]
    argv = [str(write_prompts(tmp_path, 3)), "--interleave"]
    harness.run_bench(args_for(tmp_path, argv=argv), targets)
    log = tmp_path / "run" / harness.LOG_NAME
    lines = log.read_text().splitlines()
    log.write_text("\n".join(lines[:4]) + "\n")  # header, baseline 0, optimized 0, baseline 1: cut there
    calls.clear()
    rep = harness.run_bench(args_for(tmp_path, argv=[*argv, "--report-only"]), targets)
    assert calls == []  # nothing served
    assert rep["workload"]["requests"] == 1 and rep["workload"]["of_requests"] == 3
    assert all(c["completed"] == 1 for c in rep["configs"].values())
    assert "1 of 3 requests (interrupted" in (tmp_path / "run" / "report.md").read_text()
    (tmp_path / "run" / harness.LOG_NAME).unlink()
    with pytest.raises(ValueError, match="--report-only: .* not found"):
        harness.run_bench(args_for(tmp_path, argv=[*argv, "--report-only"]), targets)

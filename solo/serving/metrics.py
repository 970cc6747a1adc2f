"""The server's Prometheus metrics (`/metrics`, text format with HELP and TYPE), in a registry of its
own per app: HTTP responses by endpoint and status, queue length and wait, TTFT, TPOT and end-to-end
histograms, prompt and generated tokens, finish reasons, cancellations, and, read from the engine
at each scrape, speculative acceptance and the watchdog.

Counter names that `solo bench` reads (solo.bench.promcounters) are part of the interface:
``solo_spec_verify_rounds_total``, ``solo_spec_draft_tokens_total``, ``solo_spec_accepted_tokens_total``
and ``solo_spec_accepted_per_position_total{position}``.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from solo.engine.engine import Engine, GenerationResult

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)
TOKEN_TIME_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56)
ENDPOINTS = (
    "/v1/completions",
    "/v1/chat/completions",
    "/v1/models",
    "/health",
    "/metrics",
    "/tokenize",
    "/detokenize",
    "/tokenizer_info",
)


class ServerMetrics:
    def __init__(self, engine: Engine) -> None:
        self.registry = r = CollectorRegistry(auto_describe=True)
        self.responses = Counter(
            "solo_http_responses", "HTTP responses by endpoint and status code", ["endpoint", "status"], registry=r
        )
        self.requests = Counter(
            "solo_requests", "Generation requests the engine finished, by finish reason", ["finish_reason"], registry=r
        )
        self.cancelled = Counter(
            "solo_requests_cancelled", "Requests cancelled (client gone, timeout, shutdown)", ["reason"], registry=r
        )
        self.queue_length = Gauge("solo_queue_length", "Requests waiting for the engine", registry=r)
        self.running = Gauge("solo_requests_running", "Requests in the engine (0 or 1: batch size 1)", registry=r)
        self.queue_wait = Histogram(
            "solo_queue_wait_seconds", "Time from arrival to the engine", registry=r, buckets=LATENCY_BUCKETS
        )
        self.ttft = Histogram(
            "solo_time_to_first_token_seconds",
            "Time from arrival to the first generated token (queue wait included)",
            registry=r,
            buckets=LATENCY_BUCKETS,
        )
        self.tpot = Histogram(
            "solo_time_per_output_token_seconds",
            "Mean time per generated token after the first, per request",
            registry=r,
            buckets=TOKEN_TIME_BUCKETS,
        )
        self.e2e = Histogram(
            "solo_e2e_request_latency_seconds",
            "Time from arrival to the last token of a completed request",
            registry=r,
            buckets=LATENCY_BUCKETS,
        )
        self.prompt_tokens = Counter("solo_prompt_tokens", "Prompt tokens prefilled", registry=r)
        self.generated_tokens = Counter("solo_generated_tokens", "Tokens generated", registry=r)
        r.register(EngineCollector(engine))

    def record_result(self, result: GenerationResult) -> None:
        s = result.stats
        self.requests.labels(finish_reason=result.finish_reason).inc()
        self.prompt_tokens.inc(s.prompt_tokens)
        self.generated_tokens.inc(s.completion_tokens)
        if s.tpot_s is not None:
            self.tpot.observe(s.tpot_s)

    def response(self, path: str, status: int) -> None:
        self.responses.labels(endpoint=path if path in ENDPOINTS else "other", status=str(status)).inc()

    def text(self) -> bytes:
        return generate_latest(self.registry)


class EngineCollector(Collector):
    """Acceptance and watchdog figures, read from the engine at each scrape."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    def describe(self) -> list:
        return []  # names depend on the decoder; collected at scrape time

    def collect(self) -> Iterator:
        engine = self.engine
        yield GaugeMetricFamily(
            "solo_engine_speculative",
            "1 when the engine decodes speculatively (NEXTN)",
            value=1.0 if engine.watchdog is not None else 0.0,
        )
        if engine.watchdog is None:
            return
        totals, watchdog = engine.acceptance, engine.watchdog
        yield CounterMetricFamily("solo_spec_verify_rounds", "Verification rounds", value=totals.rounds)
        yield CounterMetricFamily("solo_spec_draft_tokens", "Drafted tokens verified", value=totals.drafted)
        yield CounterMetricFamily("solo_spec_accepted_tokens", "Drafted tokens accepted", value=totals.accepted)
        per_pos = CounterMetricFamily(
            "solo_spec_accepted_per_position", "Rounds in which draft position k was accepted", labels=["position"]
        )
        for i, n in enumerate(totals.accepted_at):
            per_pos.add_metric([str(i)], n)
        yield per_pos
        rate = GaugeMetricFamily(
            "solo_spec_position_acceptance", "Fraction of rounds accepting draft position k", labels=["position"]
        )
        for i, x in enumerate(totals.per_position()):
            rate.add_metric([str(i)], x)
        yield rate
        yield GaugeMetricFamily(
            "solo_spec_accept_length", "Tokens per verification round since start", value=totals.accept_length or 0.0
        )
        yield GaugeMetricFamily(
            "solo_spec_rolling_accept_length",
            "Tokens per round over the watchdog's recent window",
            value=watchdog.rolling_accept_length or 0.0,
        )
        yield CounterMetricFamily(
            "solo_spec_low_acceptance_warnings", "Watchdog warnings: low acceptance", value=watchdog.warnings
        )

"""What `solo bench` measures: the in-process engine, or any OpenAI-compatible server over HTTP.

Both targets turn one `Request` into one `RequestRecord` (solo.bench.metrics) plus the completion
text. A target never raises for a failed request: an unreachable server, an HTTP error, a timeout,
an error event or a malformed stream become a record with ``finish_reason="error"`` and the reason
in ``error``, so a run goes on and the report counts the failures.

The HTTP client streams ``POST {url}/completions`` with ``stream: true`` and times every server-sent
event as it arrives (``clock``, time.perf_counter by default): TTFT is the arrival of the first chunk
with text, ITL the gaps between chunks with text, E2E latency the arrival of the last chunk with
text (the end of generation; the ``[DONE]`` line is not waited for in the timing). Output tokens
come from ``usage.completion_tokens`` when the server reports it (solo, vLLM and SGLang do on the
last chunk, with ``stream_options.include_usage``), else one per text chunk (``tokens_estimated``).
Speculative-decoding counts come from ``usage.solo_stats`` when present (solo's server); otherwise
the run reads the server's Prometheus counters before and after (solo.bench.promcounters).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol

from solo.bench.metrics import FINISH_ERROR, FINISH_LENGTH, FINISH_STOP, RequestRecord
from solo.engine.request import GenerationParams


@dataclass
class Request:
    """One benchmark request: the prompt (text or token ids), generation parameters, and for GSM8K the answer."""

    prompt: str | list[int]
    params: GenerationParams
    target: str | None = None


@dataclass
class Outcome:
    """What one request produced: its measurements and its text."""

    record: RequestRecord
    text: str = ""
    tokens_estimated: bool = False
    extra: dict[str, Any] = field(default_factory=dict)


class Target(Protocol):
    """Something that serves requests one at a time."""

    name: str

    def run(self, request: Request) -> Outcome:
        """Serve one request; never raises for a failed request (the outcome says why)."""
        ...

    def describe(self) -> dict[str, Any]:
        """What is being measured (engine description, or server URL and model)."""
        ...


def failed(reason: str, prompt_tokens: int = 0, elapsed_s: float = 0.0) -> Outcome:
    """A failed request's outcome."""
    record = RequestRecord(prompt_tokens, 0, 0.0, elapsed_s, finish_reason=FINISH_ERROR, error=reason)
    return Outcome(record)


# --------------------------------------------------------------------------- in-process engine
class EngineTarget:
    """The in-process engine: timings from the engine's own stream events."""

    def __init__(self, engine: Any, name: str) -> None:
        self.engine = engine
        self.name = name

    def describe(self) -> dict[str, Any]:
        return {"kind": "engine", **self.engine.describe()}

    def run(self, request: Request) -> Outcome:
        times: list[float] = []
        try:
            generation = self.engine.stream(request.prompt, request.params)
            for event in generation:
                if event.text and (not times or event.elapsed_s != times[-1]):
                    times.append(event.elapsed_s)
        except (ValueError, RuntimeError) as e:  # a prompt the engine rejects, a busy engine
            return failed(f"engine: {e}")
        result = generation.result
        assert result is not None
        s = result.stats
        record = RequestRecord(
            prompt_tokens=s.prompt_tokens,
            output_tokens=s.completion_tokens,
            ttft_s=s.ttft_s,
            latency_s=s.total_s,
            itl_s=[b - a for a, b in zip(times, times[1:], strict=False)],
            drafted_tokens=s.drafted_tokens or 0,
            accepted_tokens=s.accepted_tokens or 0,
            verify_rounds=s.verify_rounds or 0,
            accepted_per_position=list(s.accepted_per_position or []),
            finish_reason=result.finish_reason if result.finish_reason in (FINISH_STOP, FINISH_LENGTH) else "error",
            error="" if result.finish_reason in (FINISH_STOP, FINISH_LENGTH) else f"finish {result.finish_reason}",
        )
        return Outcome(record, result.text)


# --------------------------------------------------------------------------- OpenAI-compatible server
class StreamError(Exception):
    """A stream that cannot be read as OpenAI server-sent events."""


def completion_body(request: Request, model_name: str | None) -> dict[str, Any]:
    """The JSON body of a streaming /v1/completions request."""
    p = request.params
    body: dict[str, Any] = {
        "prompt": request.prompt,
        "max_tokens": p.max_tokens,
        "temperature": p.sampling.temperature,
        "top_p": p.sampling.top_p,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if model_name:
        body["model"] = model_name
    if p.sampling.top_k:
        body["top_k"] = p.sampling.top_k
    if p.sampling.seed is not None:
        body["seed"] = p.sampling.seed
    if p.stop:
        body["stop"] = list(p.stop)
    if p.ignore_eos:
        body["ignore_eos"] = True
    return body


def _chunk_text(choice: dict[str, Any]) -> str:
    if "text" in choice:
        return choice.get("text") or ""
    delta = choice.get("delta") or {}
    return delta.get("content") or ""


def parse_stream(lines: Iterable[tuple[float, str]], sent_at: float, prompt_tokens: int = 0) -> Outcome:
    """Turn timed SSE lines (arrival time, line) of one streamed completion into an outcome.

    Raises StreamError for an error event, an unparseable data line, or a stream that ends without
    ``[DONE]`` or a finish reason.
    """
    text_times: list[float] = []
    pieces: list[str] = []
    usage: dict[str, Any] | None = None
    finish: str | None = None
    done = False
    for arrived, raw in lines:
        line = raw.strip()
        if not line or line.startswith(":") or line.startswith(("event:", "id:", "retry:")):
            continue
        if not line.startswith("data:"):
            raise StreamError(f"malformed stream: a line that is not server-sent data: {line[:80]!r}")
        data = line[5:].strip()
        if data == "[DONE]":
            done = True
            break
        try:
            chunk = json.loads(data)
        except json.JSONDecodeError as e:
            raise StreamError(f"malformed stream: data is not JSON ({e.msg}): {data[:80]!r}") from None
        if not isinstance(chunk, dict):
            raise StreamError(f"malformed stream: data is not a JSON object: {data[:80]!r}")
        if "error" in chunk:
            err = chunk["error"]
            message = err.get("message", err) if isinstance(err, dict) else err
            raise StreamError(f"server error mid-stream: {message}")
        if isinstance(chunk.get("usage"), dict):
            usage = chunk["usage"]
        for choice in chunk.get("choices") or []:
            piece = _chunk_text(choice)
            if piece:
                pieces.append(piece)
                text_times.append(arrived)
            if choice.get("finish_reason"):
                finish = choice["finish_reason"]
    if not done and finish is None:
        raise StreamError("malformed stream: it ended without a finish reason or [DONE]")
    usage = usage or {}
    estimated = not isinstance(usage.get("completion_tokens"), int)
    out_tokens = len(text_times) if estimated else usage["completion_tokens"]
    end = text_times[-1] if text_times else sent_at
    stats = usage.get("solo_stats") if isinstance(usage.get("solo_stats"), dict) else {}
    record = RequestRecord(
        prompt_tokens=usage.get("prompt_tokens") if isinstance(usage.get("prompt_tokens"), int) else prompt_tokens,
        output_tokens=out_tokens,
        ttft_s=(text_times[0] if text_times else end) - sent_at,
        latency_s=end - sent_at,
        itl_s=[b - a for a, b in zip(text_times, text_times[1:], strict=False)],
        drafted_tokens=stats.get("drafted_tokens") or 0,
        accepted_tokens=stats.get("accepted_tokens") or 0,
        verify_rounds=stats.get("verify_rounds") or 0,
        accepted_per_position=list(stats.get("accepted_per_position") or []),
        finish_reason=FINISH_LENGTH if finish == FINISH_LENGTH else FINISH_STOP,
    )
    extra = {"spec_source": "usage.solo_stats"} if stats.get("verify_rounds") is not None else {}
    return Outcome(record, "".join(pieces), estimated, extra)


class OpenAITarget:
    """Any OpenAI-compatible server: streamed /v1/completions, timed on the wire."""

    def __init__(
        self,
        url: str,
        name: str = "server",
        api_key: str | None = None,
        model_name: str | None = None,
        timeout_s: float = 600.0,
        clock: Callable[[], float] = time.perf_counter,
        transport: Any = None,
    ) -> None:
        import httpx

        self.url = url.rstrip("/")
        self.name = name
        self.model_name = model_name
        self.clock = clock
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.client = httpx.Client(
            headers=headers, timeout=httpx.Timeout(timeout_s, connect=min(timeout_s, 10.0)), transport=transport
        )

    def describe(self) -> dict[str, Any]:
        return {"kind": "openai", "url": self.url, "model_name": self.model_name}

    def close(self) -> None:
        self.client.close()

    def get(self, path: str) -> Any:
        """GET ``path`` below the server root (``/metrics``, ``/health``), or None when it fails."""
        import httpx

        root = self.url.removesuffix("/v1")
        try:
            response = self.client.get(root + path)
        except httpx.HTTPError:
            return None
        return response if response.status_code == 200 else None

    def _timed_lines(self, response: Any) -> Iterator[tuple[float, str]]:
        for line in response.iter_lines():
            yield self.clock(), line

    def run(self, request: Request) -> Outcome:
        import httpx

        body = completion_body(request, self.model_name)
        sent_at = self.clock()
        try:
            with self.client.stream("POST", self.url + "/completions", json=body) as response:
                if response.status_code != 200:
                    response.read()
                    return failed(f"HTTP {response.status_code}: {_error_message(response)}", 0, self.clock() - sent_at)
                return parse_stream(self._timed_lines(response), sent_at)
        except StreamError as e:
            return failed(str(e), 0, self.clock() - sent_at)
        except httpx.TimeoutException as e:
            return failed(
                f"timeout ({type(e).__name__}) after {self.clock() - sent_at:.1f} s", 0, self.clock() - sent_at
            )
        except httpx.ConnectError as e:
            return failed(f"cannot connect to {self.url}: {e}. Is the server running?", 0, self.clock() - sent_at)
        except httpx.HTTPError as e:
            return failed(f"{type(e).__name__}: {e}", 0, self.clock() - sent_at)


def _error_message(response: Any) -> str:
    try:
        body = response.json()
    except ValueError:
        return response.text[:200]
    err = body.get("error") if isinstance(body, dict) else None
    if isinstance(err, dict):
        return str(err.get("message", err))[:200]
    return str(body)[:200]

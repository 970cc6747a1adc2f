"""Latency and throughput metrics, named as the vLLM / SGLang serving benchmarks name them.

Per request (``RequestRecord``):

* TTFT: time from sending the request to the first output token, ``ttft_s``.
* E2E latency (``e2el``): time from sending the request to the last output token, ``latency_s``.
* TPOT: ``(latency_s - ttft_s) / (output_tokens - 1)``; requests with ``output_tokens <= 1`` have
  no TPOT and are left out of the TPOT statistics (as vLLM does).
* ITL: the gaps between successive output chunks, ``itl_s``; a chunk may carry several tokens
  under speculative decoding. All requests' gaps are pooled.

Aggregates (``summarize``), over requests that did not fail (``finish_reason != "error"``);
truncated requests (``finish_reason == "length"``) are counted as completed and also as truncated:

* ``mean_/median_/std_/pNN_`` of ``ttft_ms``, ``tpot_ms``, ``itl_ms``, ``e2el_ms``; percentiles
  use linear interpolation between order statistics (numpy's default); std is the population
  standard deviation; an empty population gives 0.0.
* ``output_throughput`` (tok/s) = total output tokens / wall time; ``request_throughput``,
  ``total_token_throughput`` likewise. ``decode_throughput`` = 1000 / ``mean_tpot_ms`` (the
  per-stream decode speed; 0.0 without TPOT samples).
* Speculative decoding. A verification round is one target-model forward that checks the drafted
  tokens; it always yields one token of its own plus the accepted draft tokens. Accept length is
  tokens produced per verification round: ``1 + accepted / rounds``, token-weighted over all
  requests (sum of accepted over sum of rounds); None when no request ran a round.
  ``acceptance_rate`` = accepted / drafted. ``per_position_acceptance[k]`` = the fraction of rounds
  in which draft position k (0-based) was accepted.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

FINISH_STOP = "stop"
FINISH_LENGTH = "length"
FINISH_ERROR = "error"

DEFAULT_PERCENTILES: tuple[float, ...] = (95.0, 99.0)


@dataclass
class RequestRecord:
    """What one request measured; times in seconds from when the request was sent."""

    prompt_tokens: int
    output_tokens: int
    ttft_s: float
    latency_s: float
    itl_s: list[float] = field(default_factory=list)
    drafted_tokens: int = 0
    """Draft tokens proposed over all verification rounds."""
    accepted_tokens: int = 0
    """Draft tokens the target model accepted (the round's own token not included)."""
    verify_rounds: int = 0
    """Target-model verification forwards (0 without speculative decoding)."""
    accepted_per_position: list[int] = field(default_factory=list)
    """``accepted_per_position[k]``: rounds in which draft position k was accepted."""
    finish_reason: str = FINISH_STOP
    """``"stop"`` (eos or stop string), ``"length"`` (hit max tokens) or ``"error"``."""
    error: str = ""

    @property
    def failed(self) -> bool:
        """Whether the request errored."""
        return self.finish_reason == FINISH_ERROR

    @property
    def truncated(self) -> bool:
        """Whether the request stopped at its token limit."""
        return self.finish_reason == FINISH_LENGTH

    @property
    def tpot_s(self) -> float | None:
        """Time per output token after the first, or None for one token or fewer."""
        if self.output_tokens <= 1:
            return None
        return (self.latency_s - self.ttft_s) / (self.output_tokens - 1)

    @property
    def accept_length(self) -> float | None:
        """Tokens produced per verification round, ``1 + accepted / rounds``; None without rounds."""
        if self.verify_rounds <= 0:
            return None
        return 1.0 + self.accepted_tokens / self.verify_rounds


def percentile(values: Sequence[float], p: float) -> float:
    """The ``p``-th percentile (0..100) with linear interpolation; 0.0 for no values."""
    if not values:
        return 0.0
    if not 0.0 <= p <= 100.0:
        raise ValueError(f"percentile must be in [0, 100], got {p}")
    ordered = sorted(values)
    rank = (len(ordered) - 1) * p / 100.0
    lo = math.floor(rank)
    hi = math.ceil(rank)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (rank - lo)


def _mean(values: Sequence[float]) -> float:
    return math.fsum(values) / len(values) if values else 0.0


def _std(values: Sequence[float]) -> float:
    if not values:
        return 0.0
    m = _mean(values)
    return math.sqrt(math.fsum((v - m) ** 2 for v in values) / len(values))


def _pname(p: float) -> str:
    return f"p{int(p)}" if float(p).is_integer() else f"p{p}"


def describe(name: str, values_ms: Sequence[float], percentiles: Sequence[float]) -> dict[str, float]:
    """``mean_/median_/std_/pNN_{name}`` of ``values_ms``."""
    out = {
        f"mean_{name}": _mean(values_ms),
        f"median_{name}": percentile(values_ms, 50.0),
        f"std_{name}": _std(values_ms),
    }
    for p in percentiles:
        out[f"{_pname(p)}_{name}"] = percentile(values_ms, p)
    return out


def summarize(
    records: Sequence[RequestRecord],
    wall_time_s: float,
    percentiles: Sequence[float] = DEFAULT_PERCENTILES,
) -> dict[str, Any]:
    """Aggregate metrics of a benchmark run (see the module docstring for every definition)."""
    ok = [r for r in records if not r.failed]
    total_in = sum(r.prompt_tokens for r in ok)
    total_out = sum(r.output_tokens for r in ok)

    def rate(amount: float) -> float:
        return amount / wall_time_s if wall_time_s > 0 else 0.0

    ttft_ms = [r.ttft_s * 1000.0 for r in ok]
    tpot_ms = [t * 1000.0 for r in ok if (t := r.tpot_s) is not None]
    itl_ms = [x * 1000.0 for r in ok for x in r.itl_s]
    e2el_ms = [r.latency_s * 1000.0 for r in ok]

    summary: dict[str, Any] = {
        "completed": len(ok),
        "failed": len(records) - len(ok),
        "truncated": sum(1 for r in ok if r.truncated),
        "duration_s": wall_time_s,
        "total_input_tokens": total_in,
        "total_output_tokens": total_out,
        "request_throughput": rate(len(ok)),
        "output_throughput": rate(total_out),
        "total_token_throughput": rate(total_in + total_out),
    }
    summary.update(describe("ttft_ms", ttft_ms, percentiles))
    summary.update(describe("tpot_ms", tpot_ms, percentiles))
    summary.update(describe("itl_ms", itl_ms, percentiles))
    summary.update(describe("e2el_ms", e2el_ms, percentiles))
    mean_tpot = summary["mean_tpot_ms"]
    summary["decode_throughput"] = 1000.0 / mean_tpot if mean_tpot > 0 else 0.0

    rounds = sum(r.verify_rounds for r in ok)
    accepted = sum(r.accepted_tokens for r in ok)
    drafted = sum(r.drafted_tokens for r in ok)
    width = max((len(r.accepted_per_position) for r in ok), default=0)
    per_pos = [sum(r.accepted_per_position[k] for r in ok if k < len(r.accepted_per_position)) for k in range(width)]
    summary["spec_verify_rounds"] = rounds
    summary["spec_drafted_tokens"] = drafted
    summary["spec_accepted_tokens"] = accepted
    summary["accept_length"] = 1.0 + accepted / rounds if rounds > 0 else None
    summary["acceptance_rate"] = accepted / drafted if drafted > 0 else None
    summary["per_position_acceptance"] = [n / rounds for n in per_pos] if rounds > 0 else []
    return summary

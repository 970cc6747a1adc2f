"""Speculative-decoding counters from a server's Prometheus ``/metrics``, read before and after a run.

A server that does not report acceptance per request (anything but solo) may still count it in its
metrics. The difference of the counters over a run gives that run's accept length. Known names:

* solo: ``solo_spec_verify_rounds_total``, ``solo_spec_draft_tokens_total``,
  ``solo_spec_accepted_tokens_total``, ``solo_spec_accepted_per_position_total{position}``.
* vLLM (docs, "Speculative decoding" metrics): ``vllm:spec_decode_num_drafts_total``,
  ``vllm:spec_decode_num_draft_tokens_total``, ``vllm:spec_decode_num_accepted_tokens_total``,
  ``vllm:spec_decode_num_accepted_tokens_per_pos_total{position}``.
* SGLang exports a gauge, ``sglang:spec_accept_length``, not counters: a gauge cannot be differenced
  over a run, so it is recorded as the server's own figure (``server_reported_accept_length``) and
  the accept length stays unknown unless counters exist.

Anything else: unknown, never guessed.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Any

_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+(\S+)")
_POSITION = re.compile(r'position="(\d+)"')

# (rounds, drafted, accepted, accepted-per-position) counter names, per server family
FAMILIES: dict[str, tuple[str, str, str, str]] = {
    "solo": (
        "solo_spec_verify_rounds_total",
        "solo_spec_draft_tokens_total",
        "solo_spec_accepted_tokens_total",
        "solo_spec_accepted_per_position_total",
    ),
    "vllm": (
        "vllm:spec_decode_num_drafts_total",
        "vllm:spec_decode_num_draft_tokens_total",
        "vllm:spec_decode_num_accepted_tokens_total",
        "vllm:spec_decode_num_accepted_tokens_per_pos_total",
    ),
}
GAUGES = ("sglang:spec_accept_length",)


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text exposition -> {name or name{labels}: value}; labelled samples of one name are
    also summed under the bare name (several engines, several model labels)."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        m = _SAMPLE.match(line.strip())
        if not m:
            continue
        name, labels, value = m.group(1), m.group(2) or "", m.group(3)
        try:
            v = float(value)
        except ValueError:
            continue
        if math.isnan(v):
            continue
        if labels:
            pos = _POSITION.search(labels)
            if pos:
                key = f"{name}[{pos.group(1)}]"
                out[key] = out.get(key, 0.0) + v
                continue
        out[name] = out.get(name, 0.0) + v
    return out


@dataclass
class SpecCounters:
    """Acceptance over a run, from the difference of two metrics readings."""

    source: str
    verify_rounds: int
    drafted_tokens: int
    accepted_tokens: int
    accepted_per_position: list[int] = field(default_factory=list)

    @property
    def accept_length(self) -> float | None:
        return 1.0 + self.accepted_tokens / self.verify_rounds if self.verify_rounds > 0 else None


def spec_delta(before: dict[str, float], after: dict[str, float]) -> SpecCounters | None:
    """The counters that grew between two readings, or None when no known family is present."""
    for family, (rounds_n, drafted_n, accepted_n, per_pos_n) in FAMILIES.items():
        if rounds_n not in after or accepted_n not in after:
            continue

        def delta(name: str) -> int:
            return int(round(after.get(name, 0.0) - before.get(name, 0.0)))

        width = 0
        while f"{per_pos_n}[{width}]" in after:
            width += 1
        per_pos = [delta(f"{per_pos_n}[{k}]") for k in range(width)]
        return SpecCounters(f"prometheus:{family}", delta(rounds_n), delta(drafted_n), delta(accepted_n), per_pos)
    return None


def gauges(after: dict[str, float]) -> dict[str, Any]:
    """Server-reported acceptance gauges (not differenced; for the record)."""
    return {name: after[name] for name in GAUGES if name in after}

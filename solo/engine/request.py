"""What a caller asks for and what comes back: generation parameters, streamed events, results, stats."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from solo.engine.sampling import SamplingParams


@dataclass
class GenerationParams:
    max_tokens: int = 128
    sampling: SamplingParams = field(default_factory=SamplingParams)
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")


@dataclass
class GenerationStats:
    prompt_tokens: int = 0
    completion_tokens: int = 0
    ttft_s: float = 0.0
    total_s: float = 0.0
    tpot_s: float | None = None
    decode_tok_per_s: float | None = None
    # bytes the decode step reads per token (weights, states, cache) x decode tok/s; None if unknown
    decode_gb_per_s: float | None = None
    # speculative decoding (None when it is off)
    verify_rounds: int | None = None
    drafted_tokens: int | None = None
    accepted_tokens: int | None = None
    accept_length: float | None = None
    per_position_acceptance: list[float] | None = None
    accepted_per_position: list[int] | None = None  # rounds in which draft position k was accepted

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class StreamEvent:
    """One generated token: its id, the text it completes (may be empty while UTF-8 or a possible
    stop string is held back), and the time since the request started."""

    token_id: int
    text: str
    elapsed_s: float


@dataclass
class GenerationResult:
    text: str
    token_ids: list[int]
    finish_reason: str  # "stop" (eos or stop string), "length", or "cancelled" (closed by the caller)
    stats: GenerationStats

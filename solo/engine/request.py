"""What a caller asks for and what comes back: generation parameters, streamed events, results, stats."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from solo.engine.sampling import LOGPROB_TOP, SamplingParams


@dataclass
class GenerationParams:
    max_tokens: int = 128
    sampling: SamplingParams = field(default_factory=SamplingParams)
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    # None: no log-probabilities; N: each event carries its token's and the N most likely (0..20)
    logprobs: int | None = None

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if self.logprobs is not None and not 0 <= self.logprobs <= LOGPROB_TOP:
            raise ValueError(f"logprobs must be in [0, {LOGPROB_TOP}], got {self.logprobs}")


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
    # tensor parallelism (None in one process): this rank's collectives during the request and their time
    tensor_parallel: dict[str, Any] | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class StreamEvent:
    """One generated token: its id, the text it completes (may be empty while UTF-8 or a possible
    stop string is held back), and the time since the request started. With `logprobs` asked for:
    the token's log-probability and the most likely alternatives [(id, log-probability)].
    A `flush` event adds no token: it releases text held back until the end (`token_id` repeats
    the last token's)."""

    token_id: int
    text: str
    elapsed_s: float
    logprob: float | None = None
    top_logprobs: list[tuple[int, float]] | None = None
    flush: bool = False


@dataclass
class PromptLogprob:
    """A prompt token scored in context: its log-probability given the tokens before it (the model's
    distribution at temperature 1) and the most likely alternatives [(id, log-probability)]."""

    token_id: int
    logprob: float | None  # None for the first token (nothing precedes it)
    top_logprobs: list[tuple[int, float]] | None


@dataclass
class GenerationResult:
    text: str
    token_ids: list[int]
    finish_reason: str  # "stop" (eos or stop string), "length", or "cancelled" (closed by the caller)
    stats: GenerationStats

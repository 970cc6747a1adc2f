"""The decoder seam: how the engine asks for tokens, one *round* at a time.

A round is what one pass of the decoder produces: plain decoding emits one token per round, the
speculative decoder a verified run of drafts plus one token of its own. The engine owns everything
around rounds (stop conditions, text, timing, statistics, acceptance counts), so a decoder only
decodes.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Protocol

import torch

from solo.engine.graphs import EagerStep, GraphCapture, GraphedStep
from solo.engine.sampling import (
    LogitAdjuster,
    SamplingParams,
    argmax_last,
    logprob_distribution,
    make_generator,
    pack_logprobs,
    probabilities,
    sample,
    sample_from,
    unpack_logprobs,
)
from solo.model.cache import HybridCache
from solo.model.ling import LingForCausalLM


@dataclass(frozen=True)
class Round:
    """Tokens emitted by one round; for a verification round, how many drafts it checked and kept."""

    tokens: list[int]
    drafted: int = 0  # 0: not a verification round (the prefill's token, plain decoding)
    accepted: int = 0  # the leading run of drafts the target kept (positions 0..accepted-1)
    # when asked for: per token, (its log-probability, [(id, log-probability)] of the most likely)
    logprobs: list[tuple[float, list[tuple[int, float]]]] | None = None


class Decoder(Protocol):
    """What the engine needs from a decoder."""

    speculative: bool  # True: rounds verify drafts (acceptance is counted)
    num_draft_positions: int  # drafts per verification round (0 for plain decoding)

    @property
    def window(self) -> int:
        """Cache positions a round may write past the last emitted token."""
        ...

    def rounds(
        self, prompt_ids: torch.Tensor, cache: HybridCache, params: SamplingParams, logprobs: bool = False
    ) -> Iterator[Round]:
        """Prefill the prompt, then yield rounds until the caller stops asking; with `logprobs`, each
        round carries its tokens' log-probabilities under the target's sampling distribution."""
        ...

    def capture_graphs(self, cache: HybridCache, graphs: GraphCapture) -> None:
        """Record the decoder's steps as CUDA graphs over the pinned cache."""
        ...

    def graph_report(self) -> dict | None:
        """None when steps run eagerly; else what was captured and how often it replayed."""
        ...


class TokenReader:
    """Reads a round's token ids back to the host without stalling the GPU: the copy is queued into a
    pinned buffer, the decoder queues its next step, and only then waits for the copy (which the
    stream reaches before that step). On a CPU the copy is simply done."""

    def __init__(self, device: torch.device, size: int, dtype: torch.dtype = torch.long) -> None:
        self.cuda = device.type == "cuda"
        self.host = torch.empty(size, dtype=dtype, pin_memory=self.cuda)
        self.event = torch.cuda.Event() if self.cuda else None

    def start(self, ids: torch.Tensor) -> None:
        self.host.copy_(ids.reshape(-1), non_blocking=self.cuda)
        if self.event is not None:
            self.event.record()

    def read(self) -> list:
        if self.event is not None:
            self.event.synchronize()
        return self.host.tolist()


class LogprobReader(TokenReader):
    """Packed log-probabilities (solo.engine.sampling.pack_logprobs) of `rows` tokens, read back like
    token ids; `read_rows` unpacks them."""

    def __init__(self, device: torch.device, rows: int, width: int) -> None:
        super().__init__(device, rows * width, torch.float32)
        self.rows, self.width = rows, width

    def read_rows(self) -> list[tuple[float, list[tuple[int, float]]]]:
        flat = self.read()
        return [unpack_logprobs(flat[i * self.width : (i + 1) * self.width]) for i in range(self.rows)]


def pick_token(
    logits: torch.Tensor,
    params: SamplingParams,
    generator: torch.Generator | None,
    adjuster: LogitAdjuster | None,
    logprobs: bool,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Sample the next token from one row of logits [1, V]: adjusted (penalties, bias) when
    `adjuster` is given, which then counts the token. Returns (token [1], packed log-probabilities
    [1, W] or None)."""
    if adjuster is not None:
        logits = adjuster.apply(logits)
    packed = None
    if not logprobs:
        token = sample(logits, params, generator)
    elif params.greedy:
        token = argmax_last(logits)
        packed = pack_logprobs(logprob_distribution(logits, None, params), token)
    else:
        probs = probabilities(logits, params)
        token = sample_from(probs, generator)
        packed = pack_logprobs(logprob_distribution(logits, probs, params), token)
    if adjuster is not None:
        adjuster.observe(token)
    return token, packed


class PlainDecoder:
    """One token per model step."""

    speculative = False
    num_draft_positions = 0

    def __init__(self, model: LingForCausalLM) -> None:
        self.model = model
        self.step: EagerStep = EagerStep(model)
        self.adjuster = LogitAdjuster(model.config.vocab_size, model.device)

    @property
    def window(self) -> int:
        return 2  # the step in flight writes one position past the last token read

    def capture_graphs(self, cache: HybridCache, graphs: GraphCapture) -> None:
        step = GraphedStep(self.model, graphs)
        step.capture(1, cache)
        self.step = step

    def graph_report(self) -> dict | None:
        if not isinstance(self.step, GraphedStep):
            return None
        return {"captured": "decode step", "sizes": self.step.captured_sizes, "replays": self.step.replays}

    def rounds(
        self, prompt_ids: torch.Tensor, cache: HybridCache, params: SamplingParams, logprobs: bool = False
    ) -> Iterator[Round]:
        model, device = self.model, self.model.device
        generator = make_generator(params, device)
        adjuster = self.adjuster if params.adjusted else None
        if adjuster is not None:
            adjuster.start(params)
        hidden = model.prefill(prompt_ids, cache)
        token, packed = pick_token(model.logits(hidden[-1:]), params, generator, adjuster, logprobs)
        position = torch.tensor([prompt_ids.numel()], device=device)
        reader = TokenReader(device, 1)
        lp_reader = LogprobReader(device, 1, packed.shape[-1]) if packed is not None else None
        while True:
            # the next step is queued before this token is read back: the GPU never waits for the host
            reader.start(token)
            if lp_reader is not None:
                lp_reader.start(packed)
            _, logits = self.step(token, position, cache)
            next_token, next_packed = pick_token(logits, params, generator, adjuster, logprobs)
            position += 1
            tokens = reader.read()
            yield Round(tokens, logprobs=lp_reader.read_rows() if lp_reader is not None else None)
            token, packed = next_token, next_packed

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
from solo.engine.sampling import SamplingParams, make_generator, sample
from solo.model.cache import HybridCache
from solo.model.ling import LingForCausalLM


@dataclass(frozen=True)
class Round:
    """Tokens emitted by one round; for a verification round, how many drafts it checked and kept."""

    tokens: list[int]
    drafted: int = 0  # 0: not a verification round (the prefill's token, plain decoding)
    accepted: int = 0  # the leading run of drafts the target kept (positions 0..accepted-1)


class Decoder(Protocol):
    """What the engine needs from a decoder."""

    speculative: bool  # True: rounds verify drafts (acceptance is counted)
    num_draft_positions: int  # drafts per verification round (0 for plain decoding)

    @property
    def window(self) -> int:
        """Cache positions a round may write past the last emitted token."""
        ...

    def rounds(self, prompt_ids: torch.Tensor, cache: HybridCache, params: SamplingParams) -> Iterator[Round]:
        """Prefill the prompt, then yield rounds until the caller stops asking."""
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

    def __init__(self, device: torch.device, size: int) -> None:
        self.cuda = device.type == "cuda"
        self.host = torch.empty(size, dtype=torch.long, pin_memory=self.cuda)
        self.event = torch.cuda.Event() if self.cuda else None

    def start(self, ids: torch.Tensor) -> None:
        self.host.copy_(ids.reshape(-1), non_blocking=self.cuda)
        if self.event is not None:
            self.event.record()

    def read(self) -> list[int]:
        if self.event is not None:
            self.event.synchronize()
        return self.host.tolist()


class PlainDecoder:
    """One token per model step."""

    speculative = False
    num_draft_positions = 0

    def __init__(self, model: LingForCausalLM) -> None:
        self.model = model
        self.step: EagerStep = EagerStep(model)

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

    def rounds(self, prompt_ids: torch.Tensor, cache: HybridCache, params: SamplingParams) -> Iterator[Round]:
        model, device = self.model, self.model.device
        generator = make_generator(params, device)
        hidden = model.prefill(prompt_ids, cache)
        token = sample(model.logits(hidden[-1:]), params, generator)
        position = torch.tensor([prompt_ids.numel()], device=device)
        reader = TokenReader(device, 1)
        while True:
            # the next step is queued before this token is read back: the GPU never waits for the host
            reader.start(token)
            _, logits = self.step(token, position, cache)
            next_token = sample(logits, params, generator)
            position += 1
            yield Round(reader.read())
            token = next_token

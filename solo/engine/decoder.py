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


class PlainDecoder:
    """One token per model step."""

    speculative = False
    num_draft_positions = 0

    def __init__(self, model: LingForCausalLM) -> None:
        self.model = model
        self.step: EagerStep = EagerStep(model)

    @property
    def window(self) -> int:
        return 1

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
        while True:
            yield Round([int(token.item())])
            _, logits = self.step(token, position, cache)
            token = sample(logits, params, generator)
            position += 1

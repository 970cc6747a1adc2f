"""Sampling: greedy, temperature, top-k, top-p, seeded. Shapes are static and there is no host
synchronisation, so sampling can live inside a captured decode step.

Sampling uses the exponential race: argmax(p / E) with E ~ Exp(1) i.i.d. picks index i with
probability p_i, without a cumulative-sum search.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0: greedy
    top_k: int = 0  # 0: off
    top_p: float = 1.0  # 1: off
    seed: int | None = None

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 disables it), got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def probabilities(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The distribution sampling draws from: softmax(logits / T) restricted to the top-k tokens and
    to the smallest set whose mass reaches top_p (always keeping the most likely token), renormalised.
    Greedy is the one-hot of the argmax. logits [..., V] -> probs [..., V] fp32."""
    logits = logits.float()
    if params.greedy:
        return torch.zeros_like(logits).scatter_(-1, logits.argmax(-1, keepdim=True), 1.0)
    logits = logits / params.temperature
    if 0 < params.top_k < logits.shape[-1]:
        kth = logits.topk(params.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if params.top_p < 1.0:
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        mass_before = sorted_probs.cumsum(-1) - sorted_probs
        drop_sorted = mass_before >= params.top_p
        drop = torch.zeros_like(drop_sorted).scatter_(-1, order, drop_sorted)
        probs = probs.masked_fill(drop, 0.0)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def sample_from(probs: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """One draw from each row of probs [..., V] -> ids [...] (int64)."""
    noise = torch.empty_like(probs).exponential_(generator=generator)
    return (probs / noise).argmax(-1)


def sample(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> torch.Tensor:
    if params.greedy:
        return logits.argmax(-1)
    return sample_from(probabilities(logits, params), generator)


def make_generator(params: SamplingParams, device: torch.device | str) -> torch.Generator | None:
    if params.greedy:
        return None
    gen = torch.Generator(device=device)
    if params.seed is not None:
        gen.manual_seed(params.seed)
    else:
        gen.seed()
    return gen

"""Lossless verification of a draft chain (speculative sampling).

For draft tokens d_1..d_S drawn from draft distributions q_1..q_S, and target distributions
p_1..p_{S+1} computed in one verification pass: d_i is accepted with probability
min(1, p_i(d_i) / q_i(d_i)), left to right, until the first rejection; at the first rejected
position a replacement is drawn from normalise(max(0, p - q)); if every draft is accepted, a bonus
token is drawn from p_{S+1}. The emitted tokens then follow the target distribution exactly.
Greedy decoding is the special case of one-hot p and q: accept while the draft equals the target's
argmax, then emit the target's argmax.

Everything is batched and shape-static (no host synchronisation), so it can run inside a graph;
the batch dimension is used by the statistical tests.

Acceptance is *counted* here too, once: `AcceptanceCounter` (per request and per process, filled by
the engine from each round) is what the stats, the watchdog, the server's /metrics and the bench read.
"""

from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass, field

import torch

from solo.engine.sampling import sample_from

log = logging.getLogger("solo.speculative")


def accept_drafts(
    target_probs: torch.Tensor,
    draft_probs: torch.Tensor,
    drafts: torch.Tensor,
    generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """target_probs [B, S+1, V], draft_probs [B, S, V], drafts [B, S] ->
    (accepted count [B] in 0..S, next token [B]: the replacement or bonus token)."""
    batch, steps = drafts.shape
    p_draft = target_probs[:, :steps].gather(-1, drafts[..., None])[..., 0]
    q_draft = draft_probs.gather(-1, drafts[..., None])[..., 0]
    uniform = torch.rand(p_draft.shape, generator=generator, device=drafts.device, dtype=p_draft.dtype)
    accepted_each = uniform * q_draft < p_draft  # u < p/q without dividing by q
    accepted = accepted_each.long().cumprod(-1).sum(-1)  # leading run of acceptances
    # residual distributions per position; position S (all accepted) has q = 0: the bonus from p
    q_padded = torch.cat([draft_probs, torch.zeros_like(draft_probs[:, :1])], dim=1)
    residual = (target_probs - q_padded).clamp(min=0)
    mass = residual.sum(-1, keepdim=True)
    residual = torch.where(mass > 0, residual / mass.clamp(min=1e-30), target_probs)
    chosen = residual.gather(1, accepted[:, None, None].expand(-1, 1, residual.shape[-1]))[:, 0]
    return accepted, sample_from(chosen, generator)


def accept_greedy(target_logits: torch.Tensor, drafts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy acceptance: target_logits [S+1, V], drafts [S] (each the draft's argmax) -> (accepted
    count [1], next token [1]). The drafts that equal the target's argmax at their position, as a
    leading run, then the target's argmax after them: exactly what `accept_drafts` gives on the one-hot
    distributions of greedy decoding (p_draft is 1 or 0, q_draft is 1; the residual is the target's
    one-hot), without a distribution over the vocabulary."""
    if target_logits.is_cuda:  # one launch instead of torch's argmax and seven small kernels
        from solo.kernels.greedy import greedy_accept

        return greedy_accept(target_logits.contiguous(), drafts)
    target = target_logits.argmax(-1)
    steps = drafts.shape[0]
    accepted = (target[:steps] == drafts).long().cumprod(-1).sum(-1, keepdim=True)
    return accepted, target.gather(0, accepted)


@dataclass
class AcceptanceCounter:
    """Verification rounds, drafted and accepted tokens, and per draft position the rounds that kept it.

    The accepted drafts of a round are always a leading run (positions 0..a-1), so one count per
    round determines the per-position counts."""

    positions: int = 0
    rounds: int = 0
    drafted: int = 0
    accepted: int = 0
    accepted_at: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.accepted_at:
            self.accepted_at = [0] * self.positions

    def record(self, drafted: int, accepted: int) -> None:
        if not 0 <= accepted <= drafted <= self.positions:
            raise ValueError(f"a round accepted {accepted} of {drafted} drafts ({self.positions} positions)")
        self.rounds += 1
        self.drafted += drafted
        self.accepted += accepted
        for i in range(accepted):
            self.accepted_at[i] += 1

    @property
    def accept_length(self) -> float | None:
        """Tokens per verification round: 1 + accepted / rounds (None before the first round)."""
        return 1 + self.accepted / self.rounds if self.rounds else None

    @property
    def acceptance_rate(self) -> float | None:
        return self.accepted / self.drafted if self.drafted else None

    def per_position(self) -> list[float]:
        """Fraction of rounds in which draft position k was accepted."""
        return [n / self.rounds for n in self.accepted_at] if self.rounds else []

    def copy(self) -> AcceptanceCounter:
        return AcceptanceCounter(self.positions, self.rounds, self.drafted, self.accepted, list(self.accepted_at))

    def since(self, earlier: AcceptanceCounter) -> AcceptanceCounter:
        """What was counted after the snapshot `earlier` (a `copy()` of this counter)."""
        return AcceptanceCounter(
            self.positions,
            self.rounds - earlier.rounds,
            self.drafted - earlier.drafted,
            self.accepted - earlier.accepted,
            [a - b for a, b in zip(self.accepted_at, earlier.accepted_at, strict=True)],
        )


class AcceptanceWatchdog:
    """Warns when the rolling accept length stays below a floor: speculation is not paying off."""

    def __init__(self, window: int = 64, floor: float = 1.1) -> None:
        self.lengths: deque[int] = deque(maxlen=window)
        self.floor = floor
        self.warnings = 0

    def observe(self, tokens_this_round: int) -> None:
        self.lengths.append(tokens_this_round)
        if len(self.lengths) == self.lengths.maxlen:
            mean = sum(self.lengths) / len(self.lengths)
            if mean < self.floor:
                self.warnings += 1
                log.warning(
                    "speculative decoding: accept length %.2f over the last %d rounds is below %.2f; "
                    "drafts are almost never accepted, so speculation costs more than it saves "
                    "(check the NEXTN weights and that the draft uses the target's LM head module).",
                    mean,
                    len(self.lengths),
                    self.floor,
                )
                self.lengths.clear()

    def reset(self) -> None:
        self.lengths.clear()

    @property
    def rolling_accept_length(self) -> float | None:
        return sum(self.lengths) / len(self.lengths) if self.lengths else None

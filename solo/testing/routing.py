"""How close a run came to a tie. Two computations of the same model that differ only in rounding
(chunking, kernels, a split over processes, transformers' order of operations) may route a token to
different experts when its router scores sit within that rounding of each other, or pick a different
greedy token when its top two logits do. Such a flip is a tie-break, not an error of either, so
comparisons on fresh random inputs record the margins of the run and draw again when one is too
small: the issues' "where the reference's margin allows"."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TypeVar

import torch
import torch.nn.functional as F
from torch import nn

ROUTING_MARGIN = 1e-5  # fp32 paths differ by ~1e-6 in router scores; a flip was seen at 2.4e-7
T = TypeVar("T")
R = TypeVar("R")


def routing_margin(router: nn.Module, x: torch.Tensor) -> float:
    """The smallest gap, over the tokens of x [T, hidden], between what `router` (solo.model.moe.Router)
    keeps and what it drops: groups ranked by their top-2 biased sum, then experts among the kept
    groups. Infinite when the router keeps everything."""
    scores = torch.sigmoid(F.linear(x.float(), router.weight.float()))
    biased = scores + router.expert_bias.float()
    margins = []
    if router.n_group > 1 and router.topk_group < router.n_group:
        grouped = biased.view(-1, router.n_group, router.num_experts // router.n_group)
        group_scores = grouped.topk(2, dim=-1).values.sum(-1)
        ranked_groups = group_scores.sort(-1, descending=True).values
        margins.append(ranked_groups[:, router.topk_group - 1] - ranked_groups[:, router.topk_group])
        kept = group_scores.topk(router.topk_group, dim=-1).indices
        mask = torch.zeros(grouped.shape[:2], dtype=torch.bool, device=x.device).scatter_(1, kept, True)
        biased = grouped.masked_fill(~mask[..., None], float("-inf")).flatten(1)
    if router.top_k < biased.shape[-1]:
        ranked = biased.sort(-1, descending=True).values
        margins.append(ranked[:, router.top_k - 1] - ranked[:, router.top_k])
    return float(torch.cat(margins).min()) if margins else float("inf")


def logit_margin(logits: torch.Tensor) -> float:
    """The smallest gap between the two best logits over the rows of `logits` [..., vocab]."""
    top = logits.float().topk(2, dim=-1).values
    return float((top[..., 0] - top[..., 1]).min())


@dataclass
class TieRecord:
    """The smallest routing and greedy-logit margins seen while recording (inf until one ran)."""

    routing: float = float("inf")
    logits: float = float("inf")

    def clear(self, routing: float, logits: float | None) -> bool:
        return self.routing > routing and (logits is None or self.logits > logits)


@contextmanager
def recorded_ties() -> Iterator[TieRecord]:
    """Within the block, every solo Router that runs and every `LingForCausalLM.logits` call (the
    head, target and draft) adds its margin to the record: a test's engines and models need no wiring.
    Test-only: patches the two classes for the duration of the block."""
    from solo.model.ling import LingForCausalLM
    from solo.model.moe import Router

    record = TieRecord()
    route, head = Router.forward, LingForCausalLM.logits

    def routed(self, x):
        record.routing = min(record.routing, routing_margin(self, x))
        return route(self, x)

    def scored(self, hidden):
        out = head(self, hidden)
        record.logits = min(record.logits, logit_margin(out))
        return out

    Router.forward, LingForCausalLM.logits = routed, scored
    try:
        yield record
    finally:
        Router.forward, LingForCausalLM.logits = route, head


def clear_of_ties(
    draw: Callable[[], T],
    run: Callable[[T], R],
    *,
    routing: float = ROUTING_MARGIN,
    logits: float | None = None,
    attempts: int = 8,
) -> tuple[T, R]:
    """(inputs, run(inputs)) for the first fresh `draw()` whose run kept every routing margin above
    `routing` (and, if given, every top-2 logit gap above `logits`). A margin that small is common
    (about one 150-token prompt in seven on the tiny models), so a few draws are expected; failing
    `attempts` in a row says the margins themselves are wrong."""
    for _ in range(attempts):
        inputs = draw()
        with recorded_ties() as record:
            result = run(inputs)
        if record.clear(routing, logits):
            return inputs, result
    raise AssertionError(
        f"{attempts} fresh draws all came within a tie (last: routing margin {record.routing:.2e} <= {routing:.0e}"
        f" or top-2 logit gap {record.logits:.2e} <= {logits})"
    )

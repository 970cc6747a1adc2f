"""solo.testing.routing: the margins that let comparisons on fresh inputs tell a tie-break from an error."""

from __future__ import annotations

import itertools
from types import SimpleNamespace

import pytest
import torch

from solo.model.ling import LingForCausalLM
from solo.model.moe import Router
from solo.testing.routing import clear_of_ties, logit_margin, recorded_ties, routing_margin


def _router(experts: int = 16, groups: int = 4, keep_groups: int = 2, top_k: int = 3, hidden: int = 24) -> Router:
    config = SimpleNamespace(  # what a Router reads of a LingConfig
        hidden_size=hidden,
        num_experts=experts,
        num_experts_per_tok=top_k,
        n_group=groups,
        topk_group=keep_groups,
        norm_topk_prob=True,
        routed_scaling_factor=2.5,
    )
    router = Router(config)
    router.weight.data = torch.randn(experts, hidden)
    router.expert_bias.data = torch.randn(experts) * 0.1
    return router


def brute_force_margin(router: Router, x: torch.Tensor) -> float:
    """The same definition by enumeration: per token, the gap between the kept and the dropped group
    scores, then between the kept and dropped experts of the kept groups."""
    biased = torch.sigmoid(x.float() @ router.weight.float().t()) + router.expert_bias.float()
    per_group = router.num_experts // router.n_group
    gaps = []
    for row in biased:
        groups = [sorted(part.tolist(), reverse=True) for part in row.split(per_group)]
        ranked = sorted(((g[0] + g[1], i) for i, g in enumerate(groups)), reverse=True)
        gaps.append(ranked[router.topk_group - 1][0] - ranked[router.topk_group][0])
        kept = [i for _, i in ranked[: router.topk_group]]
        experts = sorted(itertools.chain.from_iterable(groups[i] for i in kept), reverse=True)
        gaps.append(experts[router.top_k - 1] - experts[router.top_k])
    return min(gaps)


def test_routing_margin_equals_its_definition():
    router = _router()
    x = torch.randn(7, 24)
    assert routing_margin(router, x) == pytest.approx(brute_force_margin(router, x), abs=1e-6)
    # the smallest over the tokens (up to the rounding of a 3-row against a 7-row product)
    assert routing_margin(router, x[:3]) >= routing_margin(router, x) - 1e-6


def test_a_duplicated_expert_is_a_tie_and_the_router_is_recorded():
    router = _router(groups=1, keep_groups=1, top_k=1)
    x = torch.randn(5, 24)
    best = int((torch.sigmoid(x @ router.weight.t()) + router.expert_bias).argmax(-1)[0])
    router.weight.data[(best + 1) % 16] = router.weight.data[best]  # the winner of token 0 has a twin
    router.expert_bias.data[(best + 1) % 16] = router.expert_bias.data[best]
    with recorded_ties() as record:
        router(x)
    assert record.routing == 0.0 and record.logits == float("inf")
    assert Router.forward.__qualname__ == "Router.forward"  # the class is restored after the block


def test_clear_of_ties_draws_again_and_gives_up_naming_the_margin():
    router = _router(groups=1, keep_groups=1, top_k=1)
    tied = _router(groups=1, keep_groups=1, top_k=1)
    tied.weight.data[1] = tied.weight.data[0]
    tied.weight.data[0] *= 3  # both experts far ahead of the rest, and level with each other
    tied.weight.data[1] *= 3
    tied.expert_bias.data[:2] = 5.0
    draws = iter([torch.randn(4, 24), torch.randn(4, 24)])
    runs = iter([tied, router])
    inputs, (weights, ids) = clear_of_ties(lambda: next(draws), lambda x: next(runs)(x))
    assert inputs.shape == (4, 24) and ids.shape == (4, 1)
    with pytest.raises(AssertionError, match="routing margin 0.00e"):
        clear_of_ties(lambda: torch.randn(4, 24), tied, attempts=3)


def test_logit_margins_are_recorded_from_the_model_head():
    logits = torch.tensor([[1.0, 3.0, 2.5], [0.0, -1.0, 0.2]])
    assert logit_margin(logits) == pytest.approx(0.2)
    model = LingForCausalLM.__new__(LingForCausalLM)
    torch.nn.Module.__init__(model)
    model.lm_head = torch.nn.Identity()
    with recorded_ties() as record:
        model.logits(logits)
    assert record.logits == pytest.approx(0.2) and record.routing == float("inf")
    with pytest.raises(AssertionError, match="logit gap"):
        clear_of_ties(lambda: logits, lambda h: model.logits(h), logits=0.5, attempts=2)

"""The top-p cut after a top-k cut walks the top-k list instead of sorting the vocabulary; it must
keep what the sort keeps. Fresh random logits, and logits with ties at the k-th value (kept by the
top-k cut, so they enter the top-p walk after the list)."""

from __future__ import annotations

import shutil

import pytest
import torch

from solo.engine.sampling import SamplingParams, probabilities, top_p_drop_by_sort, top_p_drop_within_top_k


def kept(probs: torch.Tensor, drop: torch.Tensor) -> torch.Tensor:
    """The tokens that keep probability (the sort also marks the top-k cut's zeros; the walk need not)."""
    return (probs > 0) & ~drop


def cut(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    values, top = logits.topk(k, dim=-1)
    masked = logits.masked_fill(logits < values[..., -1:], float("-inf"))
    return torch.softmax(masked, dim=-1), masked, top


@pytest.mark.parametrize("k", [1, 2, 29, 200])
def test_the_walk_drops_what_the_sort_drops(k):
    for _ in range(20):
        logits = torch.randn(4, 3000) * float(torch.empty(()).uniform_(0.5, 4.0))
        top_p = float(torch.empty(()).uniform_(0.05, 0.999))
        probs, masked, top = cut(logits, k)
        want = kept(probs, top_p_drop_by_sort(probs, top_p))
        got = kept(probs, top_p_drop_within_top_k(probs, masked, top, top_p))
        assert torch.equal(got, want)
        params = SamplingParams(temperature=float(torch.empty(()).uniform_(0.3, 1.5)), top_k=k, top_p=top_p)
        dist = probabilities(logits, params)
        assert torch.allclose(dist.sum(-1), torch.ones(4)) and bool((dist > 0).sum(-1).le(k).all())


def test_ties_at_the_kth_logit_are_ranked_after_the_list():
    """Tokens tied with the k-th logit beyond the first k are kept by the top-k cut; the top-p walk
    keeps as many of the tied group as the sort does (which of them is arbitrary in both) and every
    other token's fate is the same."""
    checked = 0
    for _ in range(200):
        vocab, k = 500, int(torch.randint(3, 30, ()))
        logits = torch.randn(vocab).round(decimals=1)  # many equal values
        values, _ = logits.topk(k)
        kth = values[-1]
        group = logits == kth
        if int(group.sum()) < 2 or int((logits > kth).sum()) + int(group.sum()) <= k:
            continue  # no tie reaches past the k-th place
        probs, masked, top = cut(logits[None], k)
        mass_above = float(probs[0][logits > kth].sum())
        p_tie = float(probs[0][group][0])
        # a threshold inside the tied group: only part of it survives
        top_p = mass_above + p_tie * float(torch.empty(()).uniform_(0.2, float(group.sum()) - 1.2))
        if top_p >= 1.0:
            continue
        want = kept(probs, top_p_drop_by_sort(probs, top_p))[0]
        got = kept(probs, top_p_drop_within_top_k(probs, masked, top, top_p))[0]
        assert torch.equal(got[~group], want[~group])
        assert int(got[group].sum()) == int(want[group].sum())
        assert 0 < int(got[group].sum()) < int(group.sum())  # the cut fell inside the group
        checked += 1
    assert checked >= 20


def test_exclusive_count_equals_a_scan_along_the_row():
    from solo.engine.sampling import exclusive_count

    for shape in [(4, 3000), (1, 157), (2, 3, 513), (5, 256)]:
        mask = torch.rand(shape) < float(torch.empty(()).uniform_(0.001, 0.5))
        want = mask.long().cumsum(-1) - mask.long()
        got = exclusive_count(mask, chunk=int(torch.randint(1, 5, ())) * 64)
        assert got.shape == mask.shape and torch.equal(got.long(), want)


def test_the_top_k_softmax_equals_the_masked_softmax():
    """The distribution after a top-k cut, built from the top-k values (ties with the k-th logit
    beyond the list included), equals torch's softmax of the masked logits; without a top-k cut the
    elementwise softmax equals torch's."""
    for _ in range(20):
        logits = (torch.randn(3, 2000) * 3).round(decimals=1)  # ties at the k-th value happen
        k = int(torch.randint(1, 60, ()))
        temperature = float(torch.empty(()).uniform_(0.3, 1.5))
        scaled = logits / temperature
        kth = scaled.topk(k, dim=-1).values[..., -1:]
        want = torch.softmax(scaled.masked_fill(scaled < kth, float("-inf")), dim=-1)
        got = probabilities(logits, SamplingParams(temperature=temperature, top_k=k))
        assert torch.equal(got > 0, want > 0)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7)
        plain = probabilities(logits, SamplingParams(temperature=temperature))
        torch.testing.assert_close(plain, torch.softmax(scaled, dim=-1), rtol=1e-5, atol=1e-7)


def test_the_round_compiles_its_distribution_on_gpus_only_and_past_the_limit_says_so(caplog):
    """distribution_for: the eager reference on the CPU, CompiledDistribution on a GPU. Past the settings
    torch.compile keeps, a new setting runs the eager function (counted, and logged), never a recompile
    that torch would quietly refuse; greedy never reaches the compiled function."""
    from solo.engine.sampling import CompiledDistribution, distribution_for

    assert distribution_for("cpu") is probabilities
    distribution = CompiledDistribution()
    calls = []
    distribution._compiled = lambda logits, params: calls.append(params) or probabilities(logits, params)
    distribution.most = 2
    logits = torch.randn(3, 1000) * 3
    settings = [SamplingParams(temperature=t, top_k=50, top_p=0.9) for t in (0.5, 0.7, 0.9)]
    for params in settings + settings:
        assert torch.equal(distribution(logits, params), probabilities(logits, params))
    distribution(logits, SamplingParams())  # greedy
    assert calls == settings[:2] + settings[:2]
    assert distribution.settings == {(0.5, 50, 0.9), (0.7, 50, 0.9)}
    assert distribution.eager_settings == {(0.9, 50, 0.9)}
    assert "run the eager distribution" in caplog.text


NO_CXX = shutil.which("c++") is None and shutil.which("g++") is None


@pytest.mark.skipif(NO_CXX, reason="Inductor's CPU backend needs a C++ compiler")
def test_the_compiled_distribution_equals_the_eager_one():
    """CompiledDistribution really compiles (its own copy of `probabilities`, here with Inductor's CPU
    backend; the GPU test runs the same on a GPU): the same support and the same probabilities to fp32
    rounding, for a draft step's row and a verification window, with ties at the top-k boundary."""
    from solo.engine.sampling import CompiledDistribution

    distribution = CompiledDistribution()
    params = SamplingParams(temperature=0.6, top_k=29, top_p=0.95)
    for rows in (1, 4):
        logits = torch.randn(rows, 4096) * 3
        logits[:, :5] = logits[:, 5:10]
        got, want = distribution(logits, params), probabilities(logits, params)
        assert torch.equal(got > 0, want > 0) and float((got - want).abs().max()) < 1e-6
    assert distribution.settings == {(0.6, 29, 0.95)} and not distribution.eager_settings

"""Generation loop: stops, limits, streaming, seeded sampling, and the sampling distribution."""

from __future__ import annotations

import pytest
import torch
from scipy.stats import chisquare

from solo.engine.engine import Engine, GenerationParams
from solo.engine.sampling import SamplingParams, probabilities, sample_from


@pytest.fixture(scope="module")
def engine(tiny_checkpoints):
    path, _ = tiny_checkpoints["a"]
    return Engine.from_pretrained(path, lm_head="fp32")


def test_max_tokens_and_streaming_text_equals_result(engine, fresh_ids):
    prompt = fresh_ids(7).tolist()
    generation = engine.stream(prompt, GenerationParams(max_tokens=25, ignore_eos=True))
    events = list(generation)
    result = generation.result
    assert len(result.token_ids) == 25 and result.finish_reason == "length"
    assert "".join(e.text for e in events) == result.text
    assert result.stats.completion_tokens == 25 and result.stats.prompt_tokens == 7
    assert result.stats.tpot_s > 0 and result.stats.ttft_s > 0


def test_stop_on_eos(engine, fresh_ids):
    prompt = fresh_ids(7).tolist()
    free = engine.generate(prompt, GenerationParams(max_tokens=30, ignore_eos=True)).token_ids
    eos = free[5]  # pretend the 6th generated token is the end of sequence
    engine.tokenizer.eos_ids.append(eos)
    try:
        stopped = engine.generate(prompt, GenerationParams(max_tokens=30))
        # the first end of sequence: ours, or one of the tokenizer's own if the free run emitted it first
        first = next(i for i, token in enumerate(free) if token in engine.tokenizer.eos_ids)
    finally:
        engine.tokenizer.eos_ids.remove(eos)
    assert stopped.token_ids == free[: first + 1] and stopped.finish_reason == "stop"


def test_stop_string_truncates_text_and_is_never_streamed(engine, fresh_ids):
    prompt = fresh_ids(7).tolist()
    free = engine.generate(prompt, GenerationParams(max_tokens=30, ignore_eos=True))
    text = free.text
    # the first 3-character piece after position 5 that does not occur earlier in the text
    cut = next(i for i in range(5, len(text) - 3) if text[i : i + 3] not in text[: i + 2])
    stop = text[cut : cut + 3]
    generation = engine.stream(prompt, GenerationParams(max_tokens=30, ignore_eos=True, stop=(stop,)))
    events = list(generation)
    result = generation.result
    assert result.text == text[:cut] and result.finish_reason == "stop"
    assert "".join(e.text for e in events) == result.text


def test_seeded_sampling_is_reproducible(engine, fresh_ids):
    prompt = fresh_ids(7).tolist()
    params = GenerationParams(max_tokens=20, ignore_eos=True, sampling=SamplingParams(1.0, 20, 0.9, seed=42))
    a = engine.generate(prompt, params).token_ids
    b = engine.generate(prompt, params).token_ids
    c = engine.generate(
        prompt,
        GenerationParams(max_tokens=20, ignore_eos=True, sampling=SamplingParams(1.0, 20, 0.9, seed=43)),
    ).token_ids
    assert a == b and a != c


def test_probabilities_apply_temperature_top_k_top_p():
    logits = torch.randn(50) * 3
    p = probabilities(logits, SamplingParams(temperature=0.7, top_k=10, top_p=0.8))
    ref = torch.softmax(logits / 0.7, -1)
    order = ref.argsort(descending=True)
    top10 = ref[order[:10]] / ref[order[:10]].sum()
    keep = int((top10.cumsum(0) - top10 < 0.8).sum())  # smallest prefix reaching 0.8
    expected = torch.zeros(50)
    expected[order[:keep]] = top10[:keep] / top10[:keep].sum()
    torch.testing.assert_close(p, expected)
    greedy = probabilities(logits, SamplingParams())
    assert greedy[logits.argmax()] == 1 and greedy.sum() == 1


def test_sampler_draws_from_the_distribution():
    probs = torch.softmax(torch.randn(12), -1)
    draws = sample_from(probs.expand(40000, -1).contiguous(), torch.Generator().manual_seed(0))
    counts = torch.bincount(draws, minlength=12).double()
    expected = probs.double() * 40000
    assert chisquare(counts.numpy(), (expected * counts.sum() / expected.sum()).numpy()).pvalue > 0.001


@pytest.mark.parametrize("bad", [dict(max_tokens=0), dict(sampling=None)])
def test_bad_requests_are_rejected(engine, bad):
    if "sampling" in bad:
        with pytest.raises(ValueError, match="top_p"):
            SamplingParams(top_p=0.0)
        with pytest.raises(ValueError, match="temperature"):
            SamplingParams(temperature=-1)
        return
    with pytest.raises(ValueError, match="max_tokens"):
        GenerationParams(**bad)


def test_out_of_vocab_and_empty_prompts_are_rejected(engine):
    with pytest.raises(ValueError, match="outside the vocabulary"):
        engine.generate([5, 100000])
    with pytest.raises(ValueError, match="empty"):
        engine.generate("")

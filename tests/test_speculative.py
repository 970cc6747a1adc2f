"""NEXTN speculative decoding: exact for greedy, distribution-preserving for sampling, exact rollback."""

from __future__ import annotations

import itertools

import pytest
import torch
from scipy.stats import chisquare

from solo.checkpoint.loader import load_model
from solo.engine.engine import Engine, GenerationParams
from solo.engine.sampling import SamplingParams
from solo.model.cache import HybridCache
from solo.speculative.acceptance import accept_drafts
from solo.speculative.nextn import NextNDecoder, SpeculationUnavailable, SpeculativeConfig
from solo.testing.routing import clear_of_ties
from solo.tokenizer import Tokenizer


def greedy_gap(head: str) -> float | None:
    """The top-2 logit gap below which verification and plain decoding may pick differently by rounding
    alone. Only for the fp32 head: bf16 and fp8 heads round logits so coarsely that exact ties are
    common (their tie-break is the same on both paths, as the equal tokens show)."""
    return 1e-4 if head == "fp32" else None


class OracleDraftDecoder(NextNDecoder):
    """Drafts the target's known greedy continuation, corrupting each draft with probability
    `corrupt`: every accepted count 0..S occurs, so verification, acceptance and rollback are
    exercised at every split point (the real NEXTN layer still runs for the slots)."""

    def __init__(self, model, reference: list[int], corrupt: float, seed: int) -> None:
        super().__init__(model, SpeculativeConfig())
        self.reference = reference
        self.corrupt = corrupt
        self.rng = torch.Generator().manual_seed(seed)

    def draft_chain(self, first_hidden, state, cache, params, generator):
        start = int(state.position) + 1
        tokens = []
        for i in range(self.config.num_steps):
            true = self.reference[start + i] if start + i < len(self.reference) else 7
            bad = torch.rand((), generator=self.rng) < self.corrupt
            tokens.append((true + 1 + int(torch.randint(0, 200, (), generator=self.rng))) % 262 if bad else true)
        drafts = torch.tensor(tokens)
        state.drafts.copy_(drafts)
        state.draft_probs.zero_().scatter_(1, drafts[:, None], 1.0)


@pytest.fixture(scope="module")
def tiny(tiny_checkpoints):
    return tiny_checkpoints["a"][0]


@pytest.mark.parametrize("head", ["fp32", "fp8", "bf16"])
def test_greedy_identical_with_real_nextn_draft(tiny, head, fresh_ids):
    plain = Engine.from_pretrained(tiny, lm_head=head)
    spec = Engine.from_pretrained(tiny, lm_head=head, speculative=SpeculativeConfig())
    assert spec.decoder.draft_head is spec.model.lm_head
    for prompt_len, new in [(1, 9), (4, 1), (6, 2), (13, 30), (30, 47)]:
        params = GenerationParams(max_tokens=new, ignore_eos=True)
        _, (a, b) = clear_of_ties(
            lambda n=prompt_len: fresh_ids(n).tolist(),
            lambda prompt, p=params: (plain.generate(prompt, p), spec.generate(prompt, p)),
            logits=greedy_gap(head),
        )
        assert a.token_ids == b.token_ids
        assert b.stats.verify_rounds >= 1 or new == 1


@pytest.mark.parametrize(("head", "corrupt"), [("fp32", 0.3), ("fp8", 0.5), ("fp32", 0.0), ("fp32", 1.0)])
def test_greedy_identical_at_every_acceptance_split(tiny, head, corrupt, fresh_ids):
    plain = Engine.from_pretrained(tiny, lm_head=head)
    params = GenerationParams(max_tokens=60, ignore_eos=True)
    prompt, generated = clear_of_ties(
        lambda: fresh_ids(10).tolist(), lambda p: plain.generate(p, params).token_ids, logits=greedy_gap(head)
    )
    reference = prompt + generated
    decoder = OracleDraftDecoder(plain.model, reference, corrupt, seed=int(torch.randint(0, 1000, ())))
    spec = Engine(plain.model, plain.tokenizer, decoder)
    result = spec.generate(prompt, params)
    assert result.token_ids == reference[len(prompt) :]
    s = result.stats
    if corrupt == 0.0:
        assert s.accept_length == pytest.approx(4.0) or s.verify_rounds * 4 + 1 > 60
    if corrupt == 1.0:
        assert s.accepted_tokens <= 1  # a corrupted draft can only match by chance
    assert 1.0 <= s.accept_length <= 4.0 and len(s.per_position_acceptance) == 3
    assert s.per_position_acceptance == sorted(s.per_position_acceptance, reverse=True)


def test_stop_inside_a_verification_window(tiny, fresh_ids):
    plain = Engine.from_pretrained(tiny, lm_head="fp32")
    params = GenerationParams(max_tokens=40, ignore_eos=True)
    for _ in range(20):  # a continuation with none of the tokenizer's own EOS ids where the stops are put
        prompt = fresh_ids(8).tolist()
        free = plain.generate(prompt, params).token_ids
        if not set(free[:12]) & set(plain.tokenizer.eos_ids):
            break
    else:
        pytest.fail("20 prompts in a row continued with an EOS token within 12 tokens")
    decoder = OracleDraftDecoder(plain.model, prompt + free, corrupt=0.0, seed=0)
    spec = Engine(plain.model, plain.tokenizer, decoder)
    for stop_at in (2, 5, 6, 11):  # fully accepted windows: most stops fall inside one
        eos = free[stop_at]
        if eos in free[:stop_at]:
            continue
        plain.tokenizer.eos_ids.append(eos)
        try:
            want = plain.generate(prompt, GenerationParams(max_tokens=40)).token_ids
            got = spec.generate(prompt, GenerationParams(max_tokens=40)).token_ids
        finally:
            plain.tokenizer.eos_ids.remove(eos)
        assert got == want == free[: stop_at + 1]
    for max_tokens in (1, 2, 3, 7):
        got = spec.generate(prompt, GenerationParams(max_tokens=max_tokens, ignore_eos=True)).token_ids
        assert got == free[:max_tokens]
    text = plain.tokenizer.decode(free)
    cut = next(i for i in range(7, len(text) - 3) if text[i : i + 3] not in text[: i + 2])
    stop = text[cut : cut + 3]
    want = plain.generate(prompt, GenerationParams(max_tokens=40, ignore_eos=True, stop=(stop,)))
    got = spec.generate(prompt, GenerationParams(max_tokens=40, ignore_eos=True, stop=(stop,)))
    assert got.text == want.text == text[:cut]


def test_rollback_after_partly_rejected_round_matches_plain_run(tiny, fresh_ids):
    """Verify [t, g1, g2', g3'] where only g1 is right: after rolling back to 2 kept tokens, the next
    step's logits equal those of a run that only ever processed the accepted tokens."""
    model = load_model(tiny)
    prompt = fresh_ids(12)
    n = len(prompt)
    extra = fresh_ids(3)  # t, g1 (kept) and the token processed after the rollback
    wrong = fresh_ids(2)  # rejected drafts
    with torch.no_grad():
        cache = HybridCache(model.config, 32, "cpu", torch.float32)
        model(prompt, torch.arange(n), cache)
        history = cache.new_history(4)
        window = torch.cat([extra[:2], wrong])
        model(window, n + torch.arange(4), cache, kda_history=history)
        cache.rollback_kda(history, torch.tensor([2]))
        after = model.logits(model(extra[2:], torch.tensor([n + 2]), cache))

        clean = HybridCache(model.config, 32, "cpu", torch.float32)
        model(torch.cat([prompt, extra[:2]]), torch.arange(n + 2), clean)
        want = model.logits(model(extra[2:], torch.tensor([n + 2]), clean))
    assert float((after - want).abs().max()) <= 1e-5


def test_sampled_speculation_runs_and_is_seeded(tiny, fresh_ids):
    spec = Engine.from_pretrained(tiny, lm_head="fp8", speculative=SpeculativeConfig())
    prompt = fresh_ids(9).tolist()
    params = GenerationParams(max_tokens=30, ignore_eos=True, sampling=SamplingParams(0.8, 20, 0.95, seed=3))
    a, b = spec.generate(prompt, params), spec.generate(prompt, params)
    assert a.token_ids == b.token_ids and len(a.token_ids) == 30 and a.stats.verify_rounds > 0


# ----------------------------------------------------------------------- the sampling rule, statistically
VOCAB, STEPS, SAMPLES = 5, 3, 24000


def markov(seed: int, sharpness: float) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.softmax(sharpness * torch.randn(VOCAB, VOCAB, generator=g, dtype=torch.float64), -1)


def speculative_pairs(p_next, q_next, rule, generator) -> torch.Tensor:
    """First two tokens emitted by speculative rounds (batched over SAMPLES), for a target Markov
    chain p_next and a different draft chain q_next, starting from token 0."""
    batch = SAMPLES
    last = torch.zeros(batch, dtype=torch.long)
    out = [[] for _ in range(batch)]
    while min(len(o) for o in out) < 2:
        drafts, qs, ps = [], [], []
        prev = last
        for _ in range(STEPS):
            q = q_next[prev]
            d = torch.multinomial(q, 1, generator=generator)[:, 0]
            ps.append(p_next[prev])
            qs.append(q)
            drafts.append(d)
            prev = d
        ps.append(p_next[prev])
        accepted, token = rule(torch.stack(ps, 1), torch.stack(qs, 1), torch.stack(drafts, 1), generator)
        d = torch.stack(drafts, 1)
        for i in range(batch):
            if len(out[i]) < 2:
                out[i].extend(d[i, : accepted[i]].tolist() + [int(token[i])])
        last = token
    return torch.tensor([o[:2] for o in out])


def exact_pair_probs(p_next) -> torch.Tensor:
    return (p_next[0][:, None] * p_next).flatten()


def biased_rule(target, draft, drafts, generator):
    """A subtly wrong rule: on rejection, resample from p instead of normalise(max(0, p - q))."""
    accepted, _ = accept_drafts(target, draft, drafts, generator)
    chosen = target.gather(1, accepted[:, None, None].expand(-1, 1, target.shape[-1]))[:, 0]
    return accepted, torch.multinomial(chosen, 1, generator=generator)[:, 0]


def pair_pvalue(rule, seed: int) -> float:
    p_next, q_next = markov(seed, 1.5), markov(seed + 1, 1.5)
    pairs = speculative_pairs(p_next, q_next, rule, torch.Generator().manual_seed(seed + 2))
    counts = torch.bincount(pairs[:, 0] * VOCAB + pairs[:, 1], minlength=VOCAB * VOCAB).double()
    expected = exact_pair_probs(p_next) * counts.sum()
    return float(chisquare(counts.numpy(), expected.numpy()).pvalue)


def test_sampling_rule_preserves_the_target_distribution():
    """Chi-square over 24,000 emitted token pairs, on fresh random chains. A correct rule fails a
    single p > 0.01 test 1% of the time by construction, so two independent draws are made and
    the test fails only if both reject (1 in 10,000 for a correct rule)."""
    seeds = torch.randint(0, 10_000, (2,)).tolist()
    pvalues = [pair_pvalue(accept_drafts, seed) for seed in seeds]
    assert max(pvalues) > 0.01, f"seeds {seeds}: p-values {pvalues}"


def test_statistical_test_rejects_a_biased_rule():
    seeds = torch.randint(0, 10_000, (2,)).tolist()
    pvalues = [pair_pvalue(biased_rule, seed) for seed in seeds]
    assert max(pvalues) < 0.01, f"seeds {seeds}: p-values {pvalues}"


def test_acceptance_with_filtered_distributions_keeps_support():
    """With top-k/top-p applied to both p and q, every emitted token lies in the target's support."""
    g = torch.Generator().manual_seed(int(torch.randint(0, 10_000, ())))
    target = torch.zeros(4000, STEPS + 1, 8)
    target[..., :3] = torch.rand(4000, STEPS + 1, 3, generator=g)
    target /= target.sum(-1, keepdim=True)
    draft = torch.rand(4000, STEPS, 8, generator=g)
    draft[..., 6:] = 0
    draft /= draft.sum(-1, keepdim=True)
    drafts = torch.multinomial(draft.flatten(0, 1), 1, generator=g).view(4000, STEPS)
    accepted, token = accept_drafts(target, draft, drafts, g)
    assert bool((token < 3).all())
    for i, a in itertools.islice(enumerate(accepted.tolist()), 200):
        assert all(int(drafts[i, j]) < 3 for j in range(a))


def test_greedy_acceptance_equals_the_general_rule_on_one_hot_distributions():
    """accept_greedy (no distributions) gives what accept_drafts gives on greedy decoding's one-hot
    target and draft distributions, for fresh random logits and drafts that match the target's argmax
    at random positions (so every accepted count occurs)."""
    from solo.speculative.acceptance import accept_greedy

    vocab, seen = 50, set()
    for _ in range(200):
        logits = torch.randn(STEPS + 1, vocab)
        target = logits.argmax(-1)
        drafts = torch.randint(0, vocab, (STEPS,))
        hit = torch.rand(STEPS) < 0.6
        drafts = torch.where(hit, target[:STEPS], drafts)
        one_hot = torch.zeros(STEPS + 1, vocab).scatter_(-1, target[:, None], 1.0)
        draft_one_hot = torch.zeros(STEPS, vocab).scatter_(-1, drafts[:, None], 1.0)
        want_accepted, want_token = accept_drafts(one_hot[None], draft_one_hot[None], drafts[None])
        accepted, token = accept_greedy(logits, drafts)
        assert accepted.shape == token.shape == (1,)
        assert torch.equal(accepted, want_accepted) and torch.equal(token, want_token)
        seen.add(int(accepted))
    assert seen == set(range(STEPS + 1))


def test_speculation_without_nextn_weights_is_a_clear_error(tiny_checkpoints, tmp_path):
    from solo.testing.tiny import write_tiny_checkpoint

    write_tiny_checkpoint(tmp_path, preset="c", seed=1, with_nextn=False)
    with pytest.raises(SpeculationUnavailable, match="NEXTN layer"):
        Engine.from_pretrained(tmp_path, speculative=SpeculativeConfig())
    assert Tokenizer.from_dir(tmp_path).vocab_size > 0


@pytest.mark.parametrize("kwargs", [dict(num_steps=3, num_draft_tokens=5), dict(topk=2), dict(algorithm="EAGLE3")])
def test_unsupported_speculative_settings_are_errors(kwargs):
    with pytest.raises(SpeculationUnavailable):
        SpeculativeConfig(**kwargs)

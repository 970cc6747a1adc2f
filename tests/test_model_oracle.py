"""solo's Ling-3.0 model against transformers 5.23 BailingHybridForCausalLM on tiny random configs."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from solo.checkpoint.loader import load_model
from solo.engine.engine import Engine, GenerationParams
from solo.model.cache import HybridCache
from solo.testing.routing import clear_of_ties
from solo.tokenizer import Tokenizer

PRESETS = ("a", "b", "c")


GREEDY_GAP = 1e-4  # fp32 logits of solo and transformers differ by ~1e-5: a closer top-2 is a tie


def rel_err(x: torch.Tensor, ref: torch.Tensor) -> float:
    return float((x - ref).abs().max() / ref.abs().max())


@pytest.mark.parametrize("preset", PRESETS)
def test_full_sequence_logits_match_transformers(tiny_checkpoints, fresh_ids, preset):
    path, ref = tiny_checkpoints[preset]
    model = load_model(path)

    @torch.no_grad()
    def both(ids):
        cache = HybridCache(model.config, 160, "cpu", torch.float32)
        return ref(ids[None]).logits[0], model.logits(model(ids, torch.arange(len(ids)), cache))

    # 150 > 2 KDA chunks of 64: the chunked form crosses chunk boundaries
    _, (expected, got) = clear_of_ties(lambda: fresh_ids(150), both)
    assert rel_err(got, expected) <= 1e-4


@pytest.mark.parametrize("preset", PRESETS)
def test_token_by_token_decode_matches_full_sequence(tiny_checkpoints, fresh_ids, preset):
    """Recurrent KDA == chunked KDA, and the MLA latent cache is right, over 70 decode steps."""
    path, ref = tiny_checkpoints[preset]
    model = load_model(path)
    prompt_len, steps = 9, 70

    @torch.no_grad()
    def both(ids):
        cache = HybridCache(model.config, prompt_len + steps, "cpu", torch.float32)
        outs = [model.logits(model(ids[:prompt_len], torch.arange(prompt_len), cache))]
        for t in range(prompt_len, prompt_len + steps):
            outs.append(model.logits(model(ids[t : t + 1], torch.tensor([t]), cache)))
        return ref(ids[None]).logits[0], torch.cat(outs)

    _, (expected, got) = clear_of_ties(lambda: fresh_ids(prompt_len + steps), both)
    assert rel_err(got, expected) <= 1e-4


@pytest.mark.parametrize("preset", PRESETS)
def test_greedy_generation_equals_transformers_generate(tiny_checkpoints, fresh_ids, preset):
    path, ref = tiny_checkpoints[preset]
    engine = Engine.from_pretrained(path, lm_head="fp32")

    def both(prompt):
        result = engine.generate(prompt, GenerationParams(max_tokens=40, ignore_eos=True))
        with torch.no_grad():
            # eos_token_id=None: plain greedy to the length, like ignore_eos (min_new_tokens would mask EOS)
            out = ref.generate(torch.tensor([prompt]), max_new_tokens=40, eos_token_id=None, do_sample=False)
        return result.token_ids, out[0, len(prompt) :].tolist()

    _, (got, expected) = clear_of_ties(lambda: fresh_ids(11).tolist(), both, logits=GREEDY_GAP)
    assert got == expected


def test_cli_generate_json_equals_transformers(tiny_checkpoints):
    path, ref = tiny_checkpoints["a"]
    prompt = "The quick brown fox"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "solo.cli",
            "generate",
            "--model",
            str(path),
            "--lm-head",
            "fp32",
            "--max-tokens",
            "32",
            "--json",
            prompt,
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    report = json.loads(proc.stdout)
    ids = Tokenizer.from_dir(path).encode(prompt)
    with torch.no_grad():
        out = ref.generate(torch.tensor([ids]), max_new_tokens=32, do_sample=False)
    expected = out[0, len(ids) :].tolist()
    assert report["token_ids"] == expected[: len(report["token_ids"])]
    assert len(report["token_ids"]) == len(expected)
    assert {"ttft_s", "tpot_s", "decode_tok_per_s"} <= set(report["stats"])


def test_chunked_prefill_equals_one_pass(tiny_checkpoints, fresh_ids):
    """A prompt processed in chunks (bounded memory for long contexts) gives the same hidden states
    and leaves the same caches as one pass, for the target and for the NEXTN layer."""
    path, _ = tiny_checkpoints["b"]
    model = load_model(path)

    @torch.no_grad()
    def both(ids):
        one, chunked = (HybridCache(model.config, 160, "cpu", torch.float32, with_nextn=True) for _ in range(2))
        h1, h2 = model.prefill(ids, one, chunk=1000), model.prefill(ids, chunked, chunk=37)
        d1 = model.draft_prefill(ids[1:], h1[:-1], one, chunk=1000)
        d2 = model.draft_prefill(ids[1:], h2[:-1], chunked, chunk=37)
        nxt = ids[-1:]
        l1 = model.logits(model(nxt, torch.tensor([150]), one))
        l2 = model.logits(model(nxt, torch.tensor([150]), chunked))
        return h1, h2, d1, d2, l1, l2

    _, (h1, h2, d1, d2, l1, l2) = clear_of_ties(lambda: fresh_ids(150), both)
    assert rel_err(h2, h1) <= 1e-5 and rel_err(d2, d1) <= 1e-5 and rel_err(l2, l1) <= 1e-5

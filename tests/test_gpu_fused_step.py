"""The fused GPU decode step at full width against the CPU fp32 reference (GPU only; skipped elsewhere).

A random checkpoint in the fp4 format at Ling-3.0-flash's widths (hidden 2560, 32 KDA heads of 128,
32 MLA heads, 512-rank latent, SwiGLU clamps) with 6 layers of both kinds, 64 experts and a smaller
vocabulary: the kernels see the real shapes; fresh weights and prompts every run.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

VOCAB = 16384


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float().cpu() - b.float().cpu()).norm() / b.float().cpu().norm())


@pytest.fixture(scope="module")
def setup():
    from solo.checkpoint.synthetic import load_random_model, synthetic_config
    from solo.fastpath import FastPathOptions, accelerate

    config = synthetic_config(num_layers=6, num_experts=64, vocab_size=VOCAB)
    seed = int(torch.randint(0, 10_000, ()))
    reference = load_random_model(config, "cpu", torch.float32, seed)  # the oracle: fp32 on the CPU
    options = FastPathOptions(moe_backend="cuda", lm_head="fp8", block_fp8="on", decode_step="fused")
    # the same weights: drawn on the CPU for both (CUDA's generator draws other numbers)
    fused = accelerate(load_random_model(config, "cuda", torch.bfloat16, seed, generate_on="cpu"), options)
    assert fused.decode_step is not None
    return config, reference, fused


def _steps(model, config, prompt, window, device, dtype, hidden_in=None):
    """Logits of a decode step, a 4-token verification and a NEXTN draft step (its hidden input given
    or the decode step's), on a fresh cache after a prefill; and the hidden state the draft read."""
    from solo.model.cache import HybridCache

    cache = HybridCache(config, 64, device, dtype, with_nextn=True)
    with torch.inference_mode():
        model.prefill(prompt.to(device), cache)
        one = model(prompt[-1:].to(device), torch.tensor([37], device=device), cache)
        history = cache.new_history(4)
        four = model(window.to(device), torch.arange(38, 42, device=device), cache, kda_history=history)
        draft_in = one if hidden_in is None else hidden_in.to(device, one.dtype)
        draft = model.draft_forward(window[:1].to(device), draft_in, torch.tensor([38], device=device), cache)
        return [model.logits(one), model.logits(four), model.logits(draft)], one


def test_fused_kernels_match_the_reference_per_step(setup):
    """Against the CPU fp32 oracle (decode, verification: bf16-level agreement) and against the same
    model's reference modules on the GPU (the draft too: same inputs, same weights, same backends)."""
    config, reference, fused = setup
    prompt = torch.randint(0, VOCAB, (37,))
    window = torch.randint(0, VOCAB, (4,))
    got, hidden = _steps(fused, config, prompt, window, "cuda", torch.bfloat16)
    want, _ = _steps(reference, config, prompt, window, "cpu", torch.float32)
    step, fused.decode_step = fused.decode_step, None  # the same GPU model on its reference modules
    try:
        same_gpu, _ = _steps(fused, config, prompt, window, "cuda", torch.bfloat16, hidden_in=hidden)
    finally:
        fused.decode_step = step
    to_cpu = [rel(g, w) for g, w in zip(got[:2], want[:2], strict=True)]
    to_gpu = [rel(g, w) for g, w in zip(got, same_gpu, strict=True)]
    print(
        f"\nlogits rel. err vs fp32 CPU: decode {to_cpu[0]:.2e}, verify {to_cpu[1]:.2e}; vs the GPU reference "
        f"modules: decode {to_gpu[0]:.2e}, verify {to_gpu[1]:.2e}, draft {to_gpu[2]:.2e}"
    )
    assert max(to_cpu) < 5e-2  # bf16 activations and an FP8 head against fp32
    assert max(to_gpu) < 5e-2


def test_greedy_decode_in_graphs_emits_the_reference_argmax(setup):
    from solo.engine.engine import Engine, GenerationParams
    from solo.model.cache import HybridCache
    from solo.tokenizer import Tokenizer, synthetic_tokenizer

    config, reference, fused = setup
    engine = Engine(fused, Tokenizer(synthetic_tokenizer(VOCAB)))
    engine.enable_cuda_graphs(256)
    before = fused.decode_step.launches()
    prompt = torch.randint(0, VOCAB, (int(torch.randint(5, 40, ())),)).tolist()
    out = engine.generate(prompt, GenerationParams(max_tokens=64, ignore_eos=True))
    after = fused.decode_step.launches()
    assert after["kda"] - before["kda"] >= 63 * len(config.kda_layers)  # every decode step ran the fused kernels
    sequence = torch.tensor(prompt + out.token_ids)
    cache = HybridCache(config, sequence.numel() + 1, "cpu", torch.float32, with_nextn=True)
    with torch.inference_mode():
        logits = reference.logits(reference.prefill(sequence, cache))[len(prompt) - 1 : -1]
    chosen = logits.gather(1, torch.tensor(out.token_ids)[:, None])[:, 0]
    top2 = logits.topk(2, dim=-1).values
    gap = top2[:, 0] - chosen
    margin = top2[:, 0] - top2[:, 1]
    scale = float(logits.std())
    exact = int((gap == 0).sum())
    # a step may differ only where the reference itself barely prefers its argmax (bf16 vs fp32)
    allowed = margin <= 0.05 * scale
    print(f"\ngreedy: {exact}/64 reference argmax, worst gap {float(gap.max()):.3f} (logit std {scale:.2f})")
    first_wrong = next((i for i in range(64) if gap[i] > 0), None)
    assert first_wrong is None or bool(allowed[first_wrong]), (first_wrong, float(margin[first_wrong]))


def test_speculation_on_the_fused_step_is_lossless_and_checked_at_start_up(setup):
    """NEXTN rounds on the fused step emit plain greedy decoding's tokens. Verification (4 tokens)
    and decode (1) run differently tiled kernels, so their bf16 logits are not bit-identical: where
    the two runs part, the fp32 reference must see a tie between the two tokens."""
    from solo.engine.engine import Engine, GenerationParams
    from solo.model.cache import HybridCache
    from solo.preflight.checks import ACTIVE, check_decode_step
    from solo.speculative.nextn import NextNDecoder
    from solo.tokenizer import Tokenizer, synthetic_tokenizer

    config, reference, fused = setup
    tok = Tokenizer(synthetic_tokenizer(VOCAB))
    plain = Engine(fused, tok)
    plain.enable_cuda_graphs(512)
    spec = Engine(fused, tok, NextNDecoder(fused))
    spec.enable_cuda_graphs(512)
    identical = 0
    for _ in range(3):
        prompt = torch.randint(0, VOCAB, (int(torch.randint(5, 60, ())),)).tolist()
        params = GenerationParams(max_tokens=48, ignore_eos=True)
        a, b = plain.generate(prompt, params).token_ids, spec.generate(prompt, params).token_ids
        assert spec.acceptance.rounds > 0
        if a == b:
            identical += 1
            continue
        i = next(j for j in range(48) if a[j] != b[j])
        cache = HybridCache(config, len(prompt) + i + 1, "cpu", torch.float32, with_nextn=True)
        with torch.inference_mode():
            logits = reference.logits(reference.prefill(torch.tensor(prompt + a[:i]), cache))[-1]
        assert abs(float(logits[a[i]] - logits[b[i]])) <= 0.05 * float(logits.std()), (i, a[i], b[i])
    print(f"\nspeculative vs plain greedy on the fused step: {identical}/3 identical")
    check = check_decode_step(plain, "fused")
    assert check.status == ACTIVE and check.evidence["kda_launches"] > 0, check

"""The fused decode step (solo.fastpath.decode_step) against the reference model it is built from.

CPU part: Triton's interpreter on a narrow random model in the fp4 format (the kernels' real code
paths, small widths); the GPU part (tests/test_gpu_fused_step.py) checks full widths on a GPU.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

from solo.testing.interpreter import interpret_without_gpu

if importlib.util.find_spec("triton") is None:
    pytest.skip("triton is not installed (pip install triton)", allow_module_level=True)
INTERPRET = interpret_without_gpu()
pytestmark = pytest.mark.skipif(not INTERPRET, reason="runs under Triton's CPU interpreter (TRITON_INTERPRET=1)")

from solo.checkpoint.synthetic import load_random_model, synthetic_config  # noqa: E402
from solo.fastpath import FastPathOptions, accelerate  # noqa: E402
from solo.model.cache import HybridCache  # noqa: E402
from solo.testing.routing import clear_of_ties  # noqa: E402

# Narrow, but every kernel's shape constraints hold (powers of two, 128-row FP8 blocks).
NARROW = dict(
    hidden_size=256,
    intermediate_size=256,
    moe_intermediate_size=128,
    num_attention_heads=2,
    num_key_value_heads=2,
    linear_num_heads=2,
    linear_head_dim=64,
    head_dim=64,
    kv_lora_rank=128,
    qk_nope_head_dim=32,
    qk_rope_head_dim=16,
    v_head_dim=32,
    n_group=4,
    topk_group=2,
    num_experts_per_tok=4,
    layer_group_size=2,
    first_k_dense_replace=1,
)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


@pytest.fixture(scope="module")
def models():
    """(reference, fused): the same random checkpoint, two layers (KDA + dense MLP, MLA + MoE) and NEXTN."""
    config = synthetic_config(num_layers=2, num_experts=16, vocab_size=512, **NARROW)
    seed = int(torch.randint(0, 10_000, ()))
    ref = accelerate(load_random_model(config, "cpu", torch.bfloat16, seed), FastPathOptions(block_fp8="on"))
    fast = accelerate(
        load_random_model(config, "cpu", torch.bfloat16, seed),
        FastPathOptions(block_fp8="on", decode_step="fused", verify_tokens=4),
    )
    assert ref.decode_step is None and fast.decode_step is not None
    return config, ref, fast


def run_both(config, ref, fast, prompt, window):
    caches = [HybridCache(config, 32, "cpu", torch.bfloat16, with_nextn=True) for _ in range(2)]
    outs = []
    with torch.inference_mode():
        for model, cache in zip((ref, fast), caches, strict=True):
            model.prefill(prompt, cache)  # 9 tokens: the reference layers in both
            one = model(prompt[-1:], torch.tensor([9]), cache)
            history = cache.new_history(4)
            four = model(window, torch.arange(10, 14), cache, kda_history=history)
            draft = model.draft_forward(window[:1], one, torch.tensor([10]), cache)
            outs.append((one, model.logits(one), four, model.logits(four), draft, history))
    return outs, caches


def test_decode_and_verification_equal_the_reference(models):
    config, ref, fast = models
    # fresh inputs until no token's routing (of every Router that runs: the reference's and the
    # prefills') is a near-tie; bf16 paths, so 2e-3: over 72 draws, flips at margins 8.9e-4 and 1.07e-3
    # gave 7.1e-2 and 3.7e-2, every other draw (margins from 4e-5) at most 8.7e-3; about 4 draws in 10
    # come within 2e-3, so up to 12 draws
    _, (outs, caches) = clear_of_ties(
        lambda: (torch.randint(0, config.vocab_size, (9,)), torch.randint(0, config.vocab_size, (4,))),
        lambda inputs: run_both(config, ref, fast, *inputs),
        routing=2e-3,
        attempts=12,
    )
    (h1, l1, h4, l4, d1, hist1), (h1f, l1f, h4f, l4f, d1f, hist1f) = outs
    assert rel(h1f, h1) < 2e-2 and rel(l1f, l1) < 2e-2
    assert rel(h4f, h4) < 2e-2 and rel(l4f, l4) < 2e-2
    assert rel(d1f, d1) < 2e-2
    for layer, past in hist1.items():  # the per-token KDA states that rollback uses
        assert rel(hist1f[layer].states, past.states) < 2e-2
        assert torch.allclose(hist1f[layer].window, past.window, rtol=1e-2, atol=1e-2)
    for cache_ref, cache_fast in ((caches[0].kda, caches[1].kda),):
        for layer in cache_ref:
            assert rel(cache_fast[layer].recurrent, cache_ref[layer].recurrent) < 2e-2
    counts = fast.decode_step.launches()
    assert all(counts[f] > 0 for f in fast.decode_step.families_per_step()), counts
    assert ref.decode_step is None


def _verify_roll_back_decode(config, runs, prompt, windows, keeps):
    """Per (model, lazy, verify_window): prefill, then per window a verification pass, the rollback to
    `keep` tokens and one token; the hidden states, and the settled KDA states and conv windows."""
    results = []
    with torch.inference_mode():
        for model, lazy, window in runs:
            cache = HybridCache(config, 32, "cpu", torch.bfloat16, with_nextn=True, verify_window=window)
            history = cache.verification if window else cache.new_history(4)
            outs = [model.prefill(prompt, cache)]
            position = prompt.numel()
            for ids, keep in zip(windows, keeps, strict=True):
                before = cache.kda_recurrent.clone()
                outs.append(model(ids, torch.arange(position, position + 4), cache, kda_history=history))
                if window:  # a pass into the cache's own history stores the states there only
                    assert torch.equal(cache.kda_recurrent, before)
                cache.rollback_kda(history, torch.tensor([keep]), lazy=lazy)
                assert int(cache.kda_source) == (keep if lazy else 0)
                position += keep
                outs.append(model(ids[keep - 1 : keep], torch.tensor([position]), cache))  # (repeats a token)
                position += 1
            cache.settle_kda()
            results.append((outs, cache.kda_recurrent.clone(), cache.kda_conv.clone()))
    return results


def test_the_kda_kernel_follows_a_lazy_rollback(models):
    """After a lazy rollback the states stay in the cache's verification history: the fused KDA kernel
    reads them there, a one-token step updates them in place and a verification pass reads the slot it
    then overwrites. Through two rounds of verify, roll back, decode, everything equals the copying
    rollback's run bit for bit; one round equals the reference model's within bf16 bounds (fresh inputs
    clear of routing ties, as in test_decode_and_verification_equal_the_reference)."""
    config, ref, fast = models
    keeps = [int(k) for k in torch.randint(1, 5, (2,))]
    against_reference = ((fast, True, 4), (ref, False, None))
    inputs, results = clear_of_ties(
        lambda: (torch.randint(0, config.vocab_size, (9,)), [torch.randint(0, config.vocab_size, (4,)) for _ in keeps]),
        lambda inputs: _verify_roll_back_decode(config, against_reference, inputs[0], inputs[1][:1], keeps[:1]),
        routing=2e-3,
        attempts=12,
    )
    (lazy_outs, lazy_state, _), (ref_outs, ref_state, _) = results
    for a, b in zip(lazy_outs, ref_outs, strict=True):
        assert rel(a, b) < 2e-2
    assert rel(lazy_state, ref_state) < 2e-2
    lazy, eager = _verify_roll_back_decode(config, ((fast, True, 4), (fast, False, 4)), *inputs, keeps)
    for a, b in zip(lazy[0], eager[0], strict=True):
        assert torch.equal(a, b)
    assert torch.equal(lazy[1], eager[1]) and torch.equal(lazy[2], eager[2])


def test_nextn_rounds_roll_back_lazily_and_emit_what_copying_rollbacks_emit(models):
    """The speculative decoder's rounds on a cache with its own verification history roll the KDA
    states back lazily (the fused step serves the window); the tokens are those of the same rounds
    on a cache without one (copying rollbacks), and the prompt's states settle for the reference layers."""
    from solo.engine.sampling import SamplingParams
    from solo.speculative.nextn import NextNDecoder, SpeculativeConfig

    config, _, fast = models
    spec = NextNDecoder(fast, SpeculativeConfig(num_steps=3, num_draft_tokens=4))
    prompt = torch.randint(0, config.vocab_size, (9,))
    emitted = []
    with torch.inference_mode():
        for window in (spec.verify_window, None):
            cache = HybridCache(config, 64, "cpu", torch.bfloat16, with_nextn=True, verify_window=window)
            assert spec.lazy_rollback(cache, spec.history_for(cache)) == (window is not None)
            rounds = spec.rounds(prompt, cache, SamplingParams())
            taken = [r for _, r in zip(range(8), rounds, strict=False)]
            assert all(r.drafted == 3 for r in taken[1:])  # verification rounds
            tokens = [t for r in taken for t in r.tokens]
            assert cache.kda_lazy == (window is not None)
            emitted.append(tokens)
            hidden = fast(prompt[:5], torch.arange(5), cache)  # a reference-layer pass (5 tokens) settles first
            assert not cache.kda_lazy and int(cache.kda_source) == 0 and torch.isfinite(hidden).all()
    assert emitted[0] == emitted[1] and len(emitted[0]) >= 8


@pytest.mark.parametrize("tokens", [1, 4])
def test_mla_attention_split_over_a_long_context_equals_the_reference(models, tokens):
    """Past a few positions the attention is split over the filled positions (in the interpreter, 16
    a split at least) and the splits' partials merged: at 86..150 positions 6 to 10 splits, the last
    partly filled (the bound: solo.testing.attention)."""
    from solo.testing.attention import LONG_CONTEXT_BOUND, mla_layers_against_reference

    _, _, fast = models
    context = int(torch.randint(86, 150, ()))
    assert mla_layers_against_reference(fast, context=context, tokens=tokens) < LONG_CONTEXT_BOUND


@pytest.mark.parametrize("transposed", [False, True, "early"])
@pytest.mark.parametrize("tokens", [1, 4])
def test_splits_of_several_steps_equal_the_reference(models, tokens, transposed):
    """Splits of several steps each (16 positions a step, at least 64 a split: the online softmax
    rescales what earlier steps summed), for the attention with its products transposed
    (AttendLaunch.transposed: positions on the MMA's M side, rows on its N side; one token's in the
    product), also asking the L2 for each split's first steps of old rows before the wait (early_chunks: a
    hint, under PDL only) and for the step 2 later in the loop (ahead_steps), with the prep's w_uk loaded
    before its wait (prep_weights_early), and without (verification's)."""
    from solo.testing.attention import LONG_CONTEXT_BOUND, mla_launches, mla_layers_against_reference

    _, _, fast = models
    early = 2 if transposed == "early" else 0
    with mla_launches(
        fast,
        transposed=bool(transposed),
        early_chunks=early,
        ahead_steps=early,
        prep_weights_early=bool(early),
        min_chunk=64,
        block_l=16,
    ):
        context = int(torch.randint(150, 250, ()))  # 3 or 4 splits of 4 steps
        assert mla_layers_against_reference(fast, context=context, tokens=tokens) < LONG_CONTEXT_BOUND
        if early:  # this call's rows inside a split's first chunk: one split of one step
            context = int(torch.randint(2, 12, ()))
            assert mla_layers_against_reference(fast, context=context, tokens=tokens) < LONG_CONTEXT_BOUND


@pytest.mark.parametrize("parts", [2, 4])
@pytest.mark.parametrize("tokens", [1, 4])
def test_the_combine_cut_by_latent_columns_equals_the_reference(models, tokens, parts):
    """The MLA combine cut by latent columns (AttendLaunch.combine_rank_parts, the product's at 4: slices,
    the head's last program summing their partial outputs) merges as the product's does, twice in a row
    (its per-head counters back at zero after each launch)."""
    from solo.testing.attention import LONG_CONTEXT_BOUND, mla_launches, mla_layers_against_reference

    _, _, fast = models
    with mla_launches(fast, combine_rank_parts=parts) as mlas:
        assert mlas
        for _ in range(2):
            context = int(torch.randint(86, 150, ()))
            assert mla_layers_against_reference(fast, context=context, tokens=tokens) < LONG_CONTEXT_BOUND
        for mla in mlas:
            assert mla._combine_scratch  # the variant ran
            assert all(int(arrived.abs().sum()) == 0 for _, arrived in mla._combine_scratch.values())


@pytest.mark.parametrize("tokens", [1, 4])
def test_the_mla_prep_after_a_handoff_computes_what_it_does_after_a_plain_wait(models, tokens):
    """The MLA kernels with the projection's q and kv_a handed over (solo.kernels.handoff: the prep
    waits for the signals counted, here all given): the same gated outputs and cache rows bit for bit,
    and both counters zero after. (The GEMV that signals is the CUDA one: tests/test_gpu_fused_step.py.)"""
    config, _, fast = models
    step = fast.decode_step
    attention = next(layer.attention for layer in step.layers if hasattr(layer.attention, "mla"))
    x = torch.randn(tokens, config.hidden_size).to(torch.bfloat16)
    positions = torch.arange(20, 20 + tokens)
    proj = attention.proj(x, norm_weight=attention.norm, eps=attention.eps)
    start = HybridCache(config, 32, "cpu", torch.bfloat16, with_nextn=True).mla[attention.index]
    start.latent.normal_()
    start.rope.normal_()
    results = []
    for handoff in (None, (torch.tensor([5, 0], dtype=torch.int32), 5)):
        latent, rope = start.latent.clone(), start.rope.clone()
        o = torch.empty(tokens, attention.out_dim, dtype=torch.bfloat16)
        attention.mla(proj, positions, latent, rope, o, handoff)
        results.append((o, latent, rope))
        if handoff is not None:
            assert handoff[0].tolist() == [0, 0]
    for a, b in zip(*results, strict=True):
        assert torch.equal(a, b)
    assert results[0][0].float().abs().sum() > 0


def test_the_shared_gate_up_beside_the_router_computes_what_it_computes_after_it(models, monkeypatch):
    """FusedDecodeStep.shared_beside_router (a lab switch): where the router is a kernel of its own (verification;
    here one token too), the shared gate_up normalises x itself (on a GPU on the side stream, beside the router;
    here in order) instead of reading the router's normalised x. Both round the norm as the reference does, so the
    hidden states are the same, on fresh inputs."""
    from solo.fastpath.decode_step import _MoE

    config, _, fast = models
    step = fast.decode_step
    moes = [layer.mlp for layer in step.layers if isinstance(layer.mlp, _MoE)]
    assert moes and all(moe.shared_gate_up is not None for moe in moes)
    assert step.side_stream is None and step.describe()["shared_beside_router"] is False
    beside = []
    launch = _MoE._shared_gate_up_beside
    monkeypatch.setattr(_MoE, "_shared_gate_up_beside", lambda moe, x: beside.append(x.shape[0]) or launch(moe, x))
    prompt = torch.randint(0, config.vocab_size, (9,))
    window = torch.randint(0, config.vocab_size, (4,))
    outs = []
    with torch.inference_mode():
        for on in (False, True):
            monkeypatch.setattr(step, "shared_beside_router", on)
            cache = HybridCache(config, 32, "cpu", torch.bfloat16, with_nextn=True)
            fast.prefill(prompt, cache)
            one = fast(prompt[-1:], torch.tensor([9]), cache)
            four = fast(window, torch.arange(10, 14), cache, kda_history=cache.new_history(4))
            outs.append((one, four))
    assert beside == [1] * len(moes) + [4] * len(moes)  # (on a CPU one token's router is a kernel of its own too)
    assert torch.equal(outs[1][0], outs[0][0])
    assert torch.equal(outs[1][1], outs[0][1]) and outs[0][1].float().abs().sum() > 0


def test_the_shared_expert_beside_the_router_adds_what_its_down_added_after_it(models, monkeypatch):
    """FusedDecodeStep.shared_down_beside (with shared_beside_router): the shared down runs beside the router too, its
    output rounded as its epilogue rounded it, and the experts' add_onto_residual adds it and the routed sum onto x in
    the order that epilogue did (on a GPU inside the GEMV down kernel, tests/test_kernels.py; here the reference's
    addition). The same hidden states as the product's order, on fresh inputs; off, nothing changes."""
    from solo.fastpath.decode_step import _MoE

    config, _, fast = models
    step = fast.decode_step
    moes = [layer.mlp for layer in step.layers if isinstance(layer.mlp, _MoE)]
    assert step.describe()["shared_down_beside"] is False
    onto = []
    add = type(moes[0].experts).add_onto_residual
    monkeypatch.setattr(
        type(moes[0].experts),
        "add_onto_residual",
        lambda moe, *a, **kw: onto.append(a[0].shape[0]) or add(moe, *a, **kw),
    )
    prompt = torch.randint(0, config.vocab_size, (9,))
    window = torch.randint(0, config.vocab_size, (4,))
    outs = []
    with torch.inference_mode():
        for beside, down in ((False, False), (True, True), (False, True)):
            monkeypatch.setattr(step, "shared_beside_router", beside)
            monkeypatch.setattr(step, "shared_down_beside", down)
            assert step.describe()["shared_down_beside"] is (beside and down)
            cache = HybridCache(config, 32, "cpu", torch.bfloat16, with_nextn=True)
            fast.prefill(prompt, cache)
            one = fast(prompt[-1:], torch.tensor([9]), cache)
            four = fast(window, torch.arange(10, 14), cache, kda_history=cache.new_history(4))
            outs.append((one, four))
    assert onto == [1] * len(moes) + [4] * len(moes)  # (only with the shared gate_up beside the router too)
    for other in outs[1:]:
        assert torch.equal(other[0], outs[0][0])
        assert torch.equal(other[1], outs[0][1]) and outs[0][1].float().abs().sum() > 0


def test_a_token_count_it_was_not_built_for_runs_the_reference_layers(models):
    config, _, fast = models
    before = fast.decode_step.launches()
    cache = HybridCache(config, 32, "cpu", torch.bfloat16, with_nextn=True)
    with torch.inference_mode():
        fast(torch.randint(0, config.vocab_size, (3,)), torch.arange(3), cache)  # 3: not a served count
    assert fast.decode_step.launches() == before


def test_pdl_is_refused_under_the_interpreter_naming_the_fix(models):
    """--pdl on where programmatic dependent launch cannot run (here: Triton's CPU interpreter) is an
    error naming the fix, never plain launches under the name of PDL; the plain step reports it off."""
    from solo.fastpath.availability import DecodeStepUnavailable

    config, _, fast = models
    assert fast.decode_step.launch.pdl is False and fast.decode_step.describe()["pdl"] is False
    assert fast.decode_step.describe()["mla_early_chunks"] == 0  # (the early asks run under PDL only)
    assert fast.decode_step.describe()["mla_gluon"] is False  # (Gluon runs on Hopper GPUs only)
    assert fast.decode_step.describe()["mla_gluon_window"] is False
    assert fast.decode_step.describe()["gate_up_window"] == 0  # (no MoE kernel routes inside on the CPU)
    model = load_random_model(config, "cpu", torch.bfloat16, int(torch.randint(0, 10_000, ())))
    refusal = r"^--pdl on: Triton's CPU interpreter \(TRITON_INTERPRET=1\) has no programmatic dependent launch\."
    refusal += r" Use --pdl off\.$"  # said once, whole
    with pytest.raises(DecodeStepUnavailable, match=refusal):
        accelerate(model, FastPathOptions(block_fp8="on", decode_step="fused", verify_tokens=4, pdl=True))


def test_cuda_step_kernels_are_refused_where_they_cannot_run_naming_the_fix(models):
    """--step-kernels cuda where the CUDA kernels cannot run (here: no GPU) is an error naming the fix;
    auto keeps the Triton kernels and says why in the step's description (never a silent mix)."""
    from solo.fastpath.availability import DecodeStepUnavailable

    config, _, fast = models
    described = fast.decode_step.describe()
    assert described["step_kernels"] == "triton" and "NVIDIA GPU" in described["step_kernels_note"]
    assert "cuda_gemv" not in fast.decode_step.families_per_step()
    model = load_random_model(config, "cpu", torch.bfloat16, int(torch.randint(0, 10_000, ())))
    refusal = r"^--step-kernels cuda: .*NVIDIA GPU.*Use --step-kernels triton\.$"
    with pytest.raises(DecodeStepUnavailable, match=refusal):
        accelerate(model, FastPathOptions(block_fp8="on", decode_step="fused", step_kernels="cuda"))
    with pytest.raises(DecodeStepUnavailable, match="drop --decode-step reference or --step-kernels cuda"):
        accelerate(model, FastPathOptions(decode_step="reference", step_kernels="cuda"))
    with pytest.raises(ValueError, match="unknown step kernels 'fast'"):
        FastPathOptions(step_kernels="fast")


def test_the_router_selects_several_tokens_as_it_selects_each_alone():
    """Verification routes its tokens in a second launch, one program per token: the same experts and
    weights as the one-token kernel gives each token, bit for bit (fresh random router and inputs)."""
    from solo.kernels.fused_router import FusedRouter

    gen = torch.Generator().manual_seed(int(torch.randint(0, 2**31, ())))
    experts, hidden, tokens = 16, 256, 4
    weight = (torch.randn(experts, hidden, generator=gen) * 0.05).to(torch.bfloat16)
    bias = torch.randn(experts, generator=gen) * 0.1
    norm = (1 + 0.1 * torch.randn(hidden, generator=gen)).to(torch.bfloat16)
    x = torch.randn(tokens, hidden, generator=gen).to(torch.bfloat16)
    counters = torch.zeros(2, dtype=torch.int32)
    router = FusedRouter(weight, bias, norm, 1e-6, 4, 4, 2, True, 2.5, counters[0:1], counters[1:2])
    xn, ids, wts = router(x)
    alone = [router(x[i : i + 1]) for i in range(tokens)]
    assert torch.equal(ids, torch.cat([a[1] for a in alone]))
    assert torch.equal(wts, torch.cat([a[2] for a in alone]))
    assert torch.equal(xn, torch.cat([a[0] for a in alone]))
    assert counters.tolist() == [1 + tokens, 1]  # scores: 5 launches; the separate selection: 1
    apart = FusedRouter(weight, bias, norm, 1e-6, 4, 4, 2, True, 2.5, counters[0:1], counters[1:2])
    apart.select_separately = True  # one token selected in a second launch, as verification does
    for i, (xn1, ids1, wts1) in enumerate(alone):
        got = apart(x[i : i + 1])
        assert torch.equal(got[0], xn1) and torch.equal(got[1], ids1) and torch.equal(got[2], wts1)
    assert counters.tolist() == [1 + 2 * tokens, 1 + tokens]


def test_the_router_inside_the_moe_kernel_is_refused_where_it_cannot_run_naming_the_fix(models):
    """--moe-router fused needs the persistent MoE kernel (--moe-backend cuda) with the CUDA step kernels:
    where they cannot run (here: no GPU) it is an error naming the fix; auto keeps each MoE layer's own
    router kernel and the step says so (no router counted as inside the experts)."""
    from solo.fastpath.availability import DecodeStepUnavailable

    config, _, fast = models
    described = fast.decode_step.describe()
    assert described["routers_in_experts"] == 0 and "moe_router" not in fast.decode_step.families_per_step()
    model = load_random_model(config, "cpu", torch.bfloat16, int(torch.randint(0, 10_000, ())))
    with pytest.raises(DecodeStepUnavailable, match=r"^--moe-router fused runs with the CUDA step kernels.*auto\.$"):
        accelerate(model, FastPathOptions(block_fp8="on", decode_step="fused", moe_router=True))
    with pytest.raises(DecodeStepUnavailable, match="the router inside the MoE kernel runs with the CUDA step"):
        accelerate(model, FastPathOptions(block_fp8="on", decode_step="fused", moe_router=True, step_kernels="triton"))
    with pytest.raises(DecodeStepUnavailable, match="drop --decode-step reference or --moe-router fused"):
        accelerate(model, FastPathOptions(decode_step="reference", moe_router=True))
    separate = accelerate(model, FastPathOptions(block_fp8="on", decode_step="fused", moe_router=False))
    assert separate.decode_step.describe()["routers_in_experts"] == 0


def small_mla_args(heads: int, rope: int, nope: int = 16, rank: int = 128, v: int = 16) -> tuple[tuple, dict]:
    """FusedMLA's positional arguments (fresh random weights) and its q|kv_a|g offsets for a tiny layer."""
    args = (
        torch.randn(heads, nope, rank).bfloat16(),
        torch.randn(heads, v, rank).bfloat16(),
        torch.ones(rank).bfloat16(),
        torch.rand(rope // 2),
        1.0,
        0.1,
        1e-6,
        rope,
        torch.zeros(3, dtype=torch.int32),
    )
    return args, dict(kv_offset=heads * (nope + rope), gate_offset=heads * (nope + rope) + rank + rope)


@pytest.mark.parametrize("splits", [96, 8])
def test_an_attention_cut_the_kernels_cannot_run_is_refused_naming_it(splits):
    """The combine ranges over the splits (a power of two, at least 16): a configuration that breaks
    this is refused when the layer is built, not as a compiler error at the first call."""
    from dataclasses import replace

    from solo.kernels.fused_mla import FusedMLA

    args, offsets = small_mla_args(heads=2, rope=8)
    bad = type("Bad", (FusedMLA,), {"WINDOW": replace(FusedMLA.WINDOW, splits=splits)})
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TRITON_INTERPRET", "0")  # the interpreter replaces the splits with its own
        with pytest.raises(ValueError, match="splits must be a power of two"):
            bad(*args, **offsets)
    FusedMLA(*args, **offsets)


def test_the_gluon_attention_is_refused_where_it_cannot_run_naming_why():
    """AttendLaunch.gluon (the attention on Hopper's TMA and warpgroup MMA, for one token or a window) is refused
    when the layer is built, naming why and the fix: here on the CPU; launches it cannot take anywhere (rows a
    program, warps, accumulators past the registers, the ring's buffers), before the device is asked."""
    from dataclasses import replace

    from solo.kernels.fused_mla import FusedMLA

    heads, rank, rope = 8, 128, 64
    args, offsets = small_mla_args(heads, rope, rank=rank)
    one = type("One", (FusedMLA,), {"ONE_TOKEN": replace(FusedMLA.ONE_TOKEN, gluon=True)})
    with pytest.raises(ValueError, match="the Gluon MLA attention cannot run: .*leave AttendLaunch.gluon off"):
        one(*args, **offsets)
    several = type("Several", (FusedMLA,), {"WINDOW": replace(FusedMLA.WINDOW, gluon=True)})
    with pytest.raises(ValueError, match="cannot run: .*(CPU|GPU|interpreter)"):
        several(*args, **offsets)
    for changes, why in [
        ({"rows_per_program": 128}, "rows .* go 16, 32 or 64 to a program, not 128"),
        ({"warps": 16}, "4 or 8 warps"),
        ({"ring_buffers": 3}, "1 or 2 steps"),
    ]:
        bad = type("Bad", (FusedMLA,), {"WINDOW": replace(FusedMLA.WINDOW, gluon=True, **changes)})
        with pytest.raises(ValueError, match=why):
            bad(*args, **offsets)
    args, offsets = small_mla_args(heads, rope, rank=512)
    wide = type("Wide", (FusedMLA,), {"WINDOW": replace(FusedMLA.WINDOW, gluon=True, warps=4)})
    with pytest.raises(ValueError, match="512 x 64 fp32 sums take more than 128 registers a thread of 4 warps"):
        wide(*args, **offsets)


def test_the_shared_expert_inside_the_moe_kernel_is_refused_where_it_cannot_run_naming_the_fix(models):
    """--moe-shared fused runs inside the persistent MoE kernel, with the router there: where that cannot
    run (here: no GPU) it is an error naming the fix; auto keeps the shared expert's own kernels."""
    from solo.fastpath.availability import DecodeStepUnavailable

    config, _, fast = models
    assert fast.decode_step.describe()["shared_in_experts"] == 0
    assert "moe_shared" not in fast.decode_step.families_per_step()
    model = load_random_model(config, "cpu", torch.bfloat16, int(torch.randint(0, 10_000, ())))
    with pytest.raises(
        DecodeStepUnavailable, match=r"^--moe-shared fused: no MoE layer runs its router inside.*auto\.$"
    ):
        accelerate(model, FastPathOptions(block_fp8="on", decode_step="fused", moe_shared=True))
    with pytest.raises(DecodeStepUnavailable, match="drop --moe-router separate"):
        accelerate(model, FastPathOptions(block_fp8="on", decode_step="fused", moe_shared=True, moe_router=False))
    with pytest.raises(DecodeStepUnavailable, match="drop --decode-step reference or --moe-shared fused"):
        accelerate(model, FastPathOptions(decode_step="reference", moe_shared=True))


def test_the_fused_kda_front_is_refused_where_it_cannot_run_naming_why(models):
    """The fused KDA front (one launch of norm, q|k|v|f|g|b and recurrence; the product on the cards of
    KDA_FRONT_CARDS) needs the CUDA step kernels: on the Triton ones it is refused naming the layer and why, nothing
    changed (no build running, none chosen for this machine); off is always fine."""
    from solo.fastpath.availability import StepKernelsUnavailable
    from solo.kernels.cuda_kda import CudaKdaFront, kda_front_unavailable

    _, _, fast = models
    step = fast.decode_step
    with pytest.raises(StepKernelsUnavailable, match=r"fused KDA front runs with the CUDA step kernels; layer 0"):
        step.fuse_kda_front(True)
    assert step.kda_fronts() == 0 and step.describe()["kda_fronts"] == 0
    assert step.describe()["kda_front_build"] is None and step.kda_front_product is None
    assert "cuda_kda_front" not in step.families_per_step() and "kda" in step.families_per_step()
    assert step.fuse_kda_front(False) == 0
    attention = step.layers[0].attention
    fused = attention.proj
    assert "NVIDIA GPU" in kda_front_unavailable(fused.weight, fused.scale, fused.scale_mode, attention.attn)
    with pytest.raises(ValueError, match="the fused KDA front cannot run: .*NVIDIA GPU"):
        CudaKdaFront(fused.weight, fused.scale, attention.attn, step.counter("cuda_kda_front"))

"""The whole engine on a CUDA GPU against the CPU reference (skipped without CUDA).

Runs the bundled fp4 model with the Triton MoE backend, the Triton FP8 LM head, its block-FP8 layers
on the Triton block-FP8 GEMV and CUDA graphs.
bf16 arithmetic on the GPU is not bit-identical to fp32 on the CPU, so the reference comparison is
by error bound and top-1 agreement; within one configuration, greedy speculative decoding must
reproduce plain decoding.
"""

from __future__ import annotations

import pytest
import torch

from solo.assets import bundled_model
from solo.bench.quant_quality import compare, default_prompts, position_logits
from solo.checkpoint.loader import load_model
from solo.engine.engine import Engine, GenerationParams
from solo.fastpath import load_accelerated
from solo.preflight.checks import ACTIVE, run_preflight
from solo.speculative.nextn import NextNDecoder, SpeculativeConfig

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

BUNDLED = bundled_model()
GPU = dict(device="cuda", dtype=torch.bfloat16, moe_backend="triton", lm_head="fp8", block_fp8="on")


@pytest.fixture(scope="module")
def prompts():
    return default_prompts(BUNDLED, 6)


def test_gpu_logits_match_cpu_reference(prompts):
    reference = load_model(BUNDLED)
    ref = [position_logits(reference, p) for p in prompts]
    for options in (dict(GPU, moe_backend="torch", lm_head="bf16", block_fp8="off"), GPU):
        model = load_accelerated(BUNDLED, **options)
        got = [position_logits(model, p).cpu() for p in prompts]
        err = max(float((g - r).norm() / r.norm()) for g, r in zip(got, ref, strict=True))
        agreement = compare(ref, got)["top1_agreement"]
        print(f"\n{options['moe_backend']}/{options['lm_head']}: rel err {err:.2e}, top-1 {agreement:.4f}")
        assert err < 5e-2 and agreement > 0.95  # bf16 end to end vs fp32


def test_graphs_reproduce_eager_and_speculation_emits_target_argmax(prompts):
    eager = Engine.from_pretrained(BUNDLED, **GPU)
    eager.cache_for(2048)  # the same cache length as the graphed engine: identical reductions
    graphed = Engine(eager.model, eager.tokenizer)
    graphed.enable_cuda_graphs(2048)
    spec = Engine(eager.model, eager.tokenizer, NextNDecoder(eager.model))
    spec.enable_cuda_graphs(2048)
    params = GenerationParams(max_tokens=96, stop=("Question:",))
    same_graph, same_spec, rounds, accepted, checked, exact, worst_gap = 0, 0, 0, 0, 0, 0, 0.0
    for p in prompts:
        a, b, c = (e.generate(p, params) for e in (eager, graphed, spec))
        same_graph += a.token_ids == b.token_ids
        same_spec += b.token_ids == c.token_ids
        rounds += c.stats.verify_rounds
        accepted += c.stats.accepted_tokens
        # teacher-forced: every token speculation emitted must be the target's argmax there, up to
        # bf16 near-ties between the 4-token verification pass and this 1-pass recomputation
        logits = position_logits(eager.model, p + c.token_ids)[len(p) - 1 : -1].float()
        chosen = logits.gather(1, torch.tensor(c.token_ids, device=logits.device)[:, None])[:, 0]
        gaps = logits.max(-1).values - chosen
        checked += len(c.token_ids)
        exact += int((gaps == 0).sum())
        worst_gap = max(worst_gap, float(gaps.max()))
    print(
        f"\ngraph==eager {same_graph}/{len(prompts)}, spec==plain {same_spec}/{len(prompts)}, "
        f"accept length {1 + accepted / rounds:.2f}, argmax {exact}/{checked}, worst gap {worst_gap:.3f}, "
        f"round replays {spec.decoder.round_replays}"
    )
    assert same_graph == len(prompts)
    assert exact >= 0.99 * checked and worst_gap < 0.25
    assert 1 + accepted / rounds > 2.0 and spec.decoder.round_replays >= rounds


def test_preflight_all_active_on_gpu():
    engine = Engine.from_pretrained(BUNDLED, **GPU, speculative=SpeculativeConfig(), cuda_graphs=True, max_context=2048)
    report = run_preflight(engine, "triton", "fp8", speculative=True, cuda_graphs=True, block_fp8="on")
    print("\n" + report.text())
    statuses = {c.name: c.status for c in report.checks}
    # --decode-step auto: the bundled model's MLA shape is not one the fused kernels run, so the report
    # says OFF with the reason (a request for `fused` would be refused: tests/test_fused_step.py)
    decode_step = next(c for c in report.checks if c.name == "decode_step")
    assert statuses.pop("decode_step") == "OFF" and "kv_lora_rank" in decode_step.evidence["reason"]
    assert statuses.pop("tensor_parallel") == "OFF"  # one process
    assert statuses == dict.fromkeys(
        ("moe_backend", "lm_head", "block_fp8", "draft_head", "mtp", "kernels", "cuda_graphs"), ACTIVE
    )
    assert next(c for c in report.checks if c.name == "block_fp8").evidence["kernel"] == "fp8_block_linear"
    moe = next(c for c in report.checks if c.name == "moe_backend").evidence
    assert moe["gemv_calls"] > 0 and moe["tensor_core_calls"] > 0  # decode on GEMV, prefill on grouped kernels
    assert moe["prefill_products"] == "fp16"


@pytest.mark.parametrize(("temperature", "top_k", "top_p"), [(0.6, 29, 0.95), (1.0, 0, 0.8), (0.9, 2000, 1.0)])
def test_compiled_distribution_equals_the_eager_one(temperature, top_k, top_p):
    """The NEXTN round's distribution on the GPU (torch.compile'd `probabilities`, its top-k cut the
    one-launch kernel) against the eager function on the GPU and on the CPU (torch.topk's cut) on fresh
    random logits of a draft step and a verification window: the same support (the same tokens kept by
    top-k and top-p) and the same probabilities to fp32 rounding."""
    from solo.engine.sampling import CompiledDistribution, SamplingParams, probabilities

    distribution = CompiledDistribution()
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p)
    for rows in (1, 4):
        logits = torch.randn(rows, 157184, device="cuda") * 3
        logits[:, :7] = logits[:, 7:14]  # ties at the top-k boundary and in the top-p walk are legal
        got = distribution(logits, params)
        for want in (probabilities(logits, params), probabilities(logits.cpu(), params).cuda()):
            assert torch.equal(got > 0, want > 0)
            assert float((got - want).abs().max()) < 1e-6
        assert torch.allclose(got.sum(-1), torch.ones(rows, device="cuda"))
    assert distribution.settings == {(temperature, top_k, top_p)} and not distribution.eager_settings


def test_sampled_speculation_in_graphs_runs_the_compiled_distribution(prompts):
    """Sampled NEXTN rounds in CUDA graphs on the GPU draw from the compiled distribution (the graph
    report says so) and emit tokens as a sampled plain decode does: valid, and as many as asked."""
    engine = Engine.from_pretrained(BUNDLED, **GPU, speculative=SpeculativeConfig(), cuda_graphs=True, max_context=2048)
    from solo.engine.sampling import SamplingParams

    seed = int(torch.randint(0, 2**31 - 1, ()))
    sampling = SamplingParams(temperature=0.6, top_k=29, top_p=0.95, seed=seed)
    params = GenerationParams(max_tokens=48, ignore_eos=True, sampling=sampling)
    out = engine.generate(prompts[0], params)
    assert len(out.token_ids) == 48 and all(0 <= t < engine.model.config.vocab_size for t in out.token_ids)
    report = engine.decoder.graph_report()
    assert report["replays"] > 0 and report["distribution"]["compiled_settings"] >= 1
    assert report["distribution"]["eager_settings"] == 0

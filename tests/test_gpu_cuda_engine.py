"""The engine with --moe-backend cuda on a CUDA GPU (skipped without a Hopper GPU or transformers 5.23).

The bundled model's experts (moe_intermediate_size 32) are too small for the persistent decode
kernel (H and I multiples of 256), so this writes a tiny random checkpoint at kernel-sized shapes
through transformers' BailingHybridForCausalLM and converts it to the fp4 format. Greedy decoding
on the persistent kernel, inside CUDA graphs, must emit the reference's argmax at every step
(teacher-forced on the PyTorch reference backend, up to bf16 near-ties), and the start-up check
must see the decode step run on the kernel.
"""

from __future__ import annotations

import pytest
import torch

from solo.bench.quant_quality import position_logits
from solo.engine.engine import Engine, GenerationParams
from solo.fastpath import load_accelerated
from solo.model.moe import SparseMoE
from solo.preflight.checks import ACTIVE, run_preflight

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not (torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 9),
        reason="needs a Hopper (or newer) CUDA GPU",
    ),
]

# preset "a" at shapes the persistent kernel runs: H = I = 256, top-8 of 16 experts
KERNEL_SIZED = dict(
    hidden_size=256, moe_intermediate_size=256, intermediate_size=512, num_local_experts=16, num_experts_per_tok=8
)
GPU = dict(device="cuda", dtype=torch.bfloat16, lm_head="fp8")


@pytest.fixture(scope="module")
def fp4_kernel_sized(tmp_path_factory):
    pytest.importorskip("transformers", minversion="5.23")
    from solo.quantization.convert import quantize_checkpoint
    from solo.testing.tiny import write_tiny_checkpoint

    bf16 = tmp_path_factory.mktemp("kernel_sized_bf16")
    write_tiny_checkpoint(
        bf16, preset="a", seed=int(torch.randint(0, 2**20, ())), max_shard_size="20MB", **KERNEL_SIZED
    )
    out = tmp_path_factory.mktemp("kernel_sized_fp4")
    quantize_checkpoint(bf16, out, verbose=False)  # (returns each tensor's quantization error)
    return out


def launches(moes) -> int:
    """Persistent-kernel launches so far, from the kernels' own device-side counters (graph replays too)."""
    return sum(int(m._launches.item()) // m.blocks for m in moes)


def test_gpu_greedy_decode_on_the_persistent_kernel_emits_the_reference_argmax(fp4_kernel_sized):
    engine = Engine.from_pretrained(fp4_kernel_sized, **GPU, moe_backend="cuda", cuda_graphs=True, max_context=512)
    reference = load_accelerated(fp4_kernel_sized, **{**GPU, "moe_backend": "torch"})
    trunk = engine.model.model.layers[: engine.model.config.num_hidden_layers]
    moes = [m.experts for m in trunk.modules() if isinstance(m, SparseMoE)]
    assert moes and all(m.name == "cuda" for m in moes)
    before = launches(moes)
    checked, exact, worst_gap = 0, 0, 0.0
    for _ in range(3):  # fresh random prompts (byte vocabulary)
        prompt = torch.randint(8, 256, (int(torch.randint(5, 40, ())),)).tolist()
        out = engine.generate(prompt, GenerationParams(max_tokens=48, ignore_eos=True))
        logits = position_logits(reference, prompt + out.token_ids)[len(prompt) - 1 : -1].float()
        chosen = logits.gather(1, torch.tensor(out.token_ids, device=logits.device)[:, None])[:, 0]
        gaps = logits.max(-1).values - chosen
        checked += len(out.token_ids)
        exact += int((gaps == 0).sum())
        worst_gap = max(worst_gap, float(gaps.max()))
    decode_launches = launches(moes) - before
    print(f"\nargmax {exact}/{checked}, worst gap {worst_gap:.3f}, persistent kernel launches {decode_launches}")
    assert decode_launches >= len(moes) * (checked - 3)  # every decode step of every MoE layer (graph replays)
    assert exact >= 0.9 * checked and worst_gap < 0.25


def test_gpu_preflight_sees_the_persistent_kernel(fp4_kernel_sized):
    engine = Engine.from_pretrained(fp4_kernel_sized, **GPU, moe_backend="cuda", cuda_graphs=True, max_context=512)
    report = run_preflight(engine, "cuda", "fp8", speculative=False, cuda_graphs=True)
    print("\n" + report.text())
    status = {c.name: c.status for c in report.checks}
    assert status["moe_backend"] == ACTIVE and status["kernels"] == ACTIVE
    moe = next(c for c in report.checks if c.name == "moe_backend").evidence
    assert moe["persistent_calls"] > 0

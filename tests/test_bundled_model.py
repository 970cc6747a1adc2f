"""The training model of solo.training.train and its export, checked against solo's inference model.

What solo loads from an export must compute what was trained: main logits, NEXTN step-1 draft
logits (slot p: token p and the target's hidden at p-1, RoPE position p) and chained step-2 drafts
(the step-1 output as the hidden). transformers' BailingHybridForCausalLM is a third, independent
opinion on the trunk. The bundled model under models/ is checked too when it is there.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from solo.assets import bundled_model
from solo.checkpoint.loader import load_model
from solo.model.cache import HybridCache
from solo.model.kda import kda_chunked_scan, kda_recurrent, unit_lower_inverse
from solo.model.layers import l2_normalize
from solo.testing.tiny import write_byte_tokenizer
from solo.training import train as T

ROOT = Path(__file__).resolve().parents[1]
BUNDLED_BF16 = bundled_model("ling-gsm8k-tiny-bf16")
BUNDLED = bundled_model()

SMALL = dict(
    vocab_size=300,
    hidden_size=64,
    num_attention_heads=2,
    linear_head_dim=32,
    kv_lora_rank=32,
    qk_nope_head_dim=16,
    qk_rope_head_dim=16,
    v_head_dim=32,
    num_experts=16,
    n_group=4,
    topk_group=2,
    num_experts_per_tok=4,
    moe_intermediate_size=32,
    intermediate_size=128,
)


def _small_model(seed: int = 0) -> T.TrainModel:
    """A small training model with weights large enough that every sub-layer shows in the logits."""
    model = T.TrainModel(T.TinyConfig(**SMALL))
    T.init_weights(model, seed)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if not p.requires_grad:  # expert_bias, set below
                continue
            if p.dim() >= 2 and "conv1d" not in name:
                p.copy_(torch.randn(p.shape, generator=gen) / math.sqrt(p.shape[-1]))
            elif p.dim() == 1 and not name.endswith(("A_log", "dt_bias")):
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=gen))
        for moe in model.moe_layers():
            moe.gate.expert_bias.copy_(0.05 * torch.randn(moe.gate.expert_bias.shape, generator=gen))
    return model.eval()


@pytest.fixture(scope="module")
def exported(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("bundled")
    write_byte_tokenizer(out / "src-tokenizer.json")
    T.export_checkpoint(_small_model(), out / "src-tokenizer.json", out / "ckpt", shard_mb=0.25)
    return out / "ckpt"


def test_kda_chunked_scan_matches_recurrence() -> None:
    torch.manual_seed(0)
    b, t, h, dk, dv = 2, 37, 3, 8, 5
    q = l2_normalize(torch.randn(b, t, h, dk, dtype=torch.float64)) * dk**-0.5
    k = l2_normalize(torch.randn(b, t, h, dk, dtype=torch.float64))
    v = torch.randn(b, t, h, dv, dtype=torch.float64)
    g = -5 * torch.sigmoid(3 * torch.randn(b, t, h, dk, dtype=torch.float64))  # down to the bound
    beta = torch.sigmoid(torch.randn(b, t, h, dtype=torch.float64))
    out = kda_chunked_scan(q, k, v, g, beta)
    for i in range(b):
        state = torch.zeros(h, dk, dv, dtype=torch.float64)
        ref = kda_recurrent(q[i], k[i], v[i], g[i], beta[i], state)
        torch.testing.assert_close(out[i], ref, rtol=1e-10, atol=1e-10)


def test_unit_lower_inverse() -> None:
    lower = torch.randn(4, 16, 16, dtype=torch.float64).tril(-1)
    eye = torch.eye(16, dtype=torch.float64)
    torch.testing.assert_close(unit_lower_inverse(lower) @ (eye + lower), eye.expand(4, 16, 16))


def test_export_names_and_dtypes(exported: Path) -> None:
    index = json.loads((exported / "model.safetensors.index.json").read_text())
    names = set(index["weight_map"])
    n = SMALL["num_experts"]
    nextn = "model.layers.6."
    for suffix in (
        "enorm.weight",
        "hnorm.weight",
        "eh_proj.weight",
        "final_layernorm.weight",
        "attention.kv_b_proj.weight",
        "mlp.gate.expert_bias",
        f"mlp.experts.{n - 1}.down_proj.weight",
        "mlp.shared_experts.up_proj.weight",
    ):
        assert nextn + suffix in names
    config = json.loads((exported / "config.json").read_text())
    assert config["num_nextn_predict_layers"] == 1 and config["eos_token_id"] == 3
    back = T.load_checkpoint(exported)
    assert back.model.layers[1].mlp.gate.expert_bias.dtype == torch.float32


@torch.no_grad()
def test_solo_matches_training_model(exported: Path) -> None:
    ref = T.load_checkpoint(exported)  # the BF16-rounded weights, in fp32
    solo = load_model(exported)
    gen = torch.Generator().manual_seed(1)
    for length in (1, 9, 40):  # 40: solo's prefill runs KDA in chunks, the training model in 3 of 16
        ids = torch.randint(0, SMALL["vocab_size"], (1, length), generator=gen)
        hidden = ref.hidden(ids)
        cache = HybridCache(solo.config, 64, "cpu", torch.float32, with_nextn=True)
        solo_hidden = solo(ids[0], torch.arange(length), cache)
        torch.testing.assert_close(solo.logits(solo_hidden), ref.logits(hidden)[0], rtol=1e-4, atol=1e-4)
        if length < 3:
            continue
        step1, step2 = ref.drafts(ids, hidden, 2)
        # NEXTN slots 1..T-1: (token p, target hidden p-1) at RoPE position p; slot 0 stays unwritten
        d1 = solo.draft_forward(ids[0, 1:], solo_hidden[:-1], torch.arange(1, length), cache)
        torch.testing.assert_close(solo.logits(d1), ref.logits(step1)[0, 1:], rtol=1e-4, atol=1e-4)
        for p in (2, length // 2, length - 1):  # chained: slots < p hold step-1 inputs
            solo.draft_forward(ids[0, 1:p], solo_hidden[: p - 1], torch.arange(1, p), cache)
            d2 = solo.draft_forward(ids[0, p : p + 1], d1[p - 2 : p - 1], torch.tensor([p]), cache)
            torch.testing.assert_close(solo.logits(d2)[0], ref.logits(step2)[0, p], rtol=1e-4, atol=1e-4)


@torch.no_grad()
def test_batched_training_forward_matches_solo_per_sequence(exported: Path) -> None:
    """A batch [B, T] through the training model gives, row by row, solo's batch-1 logits (main and
    NEXTN step 1); T = 150 spans several of solo's KDA prefill chunks and 10 training chunks."""
    ref = T.load_checkpoint(exported)
    solo = load_model(exported)
    ids = torch.randint(0, SMALL["vocab_size"], (3, 150), generator=torch.Generator().manual_seed(4))
    hidden = ref.hidden(ids)
    (step1,) = ref.drafts(ids, hidden, 1)
    for row in range(ids.shape[0]):
        cache = HybridCache(solo.config, ids.shape[1], "cpu", torch.float32, with_nextn=True)
        solo_hidden = solo.prefill(ids[row], cache, chunk=64)
        torch.testing.assert_close(solo.logits(solo_hidden), ref.logits(hidden)[row], rtol=1e-4, atol=1e-4)
        d1 = solo.draft_prefill(ids[row, 1:], solo_hidden[:-1], cache, chunk=64)
        torch.testing.assert_close(solo.logits(d1), ref.logits(step1)[row, 1:], rtol=1e-4, atol=1e-4)


def test_training_model_trains_every_weight_but_the_router_bias() -> None:
    """The training model is built from solo.model's (frozen) modules: every weight must be made
    trainable again and get a gradient from the losses; expert_bias moves only by balancing."""
    model = _small_model().train()
    batch = torch.randint(0, SMALL["vocab_size"], (2, 33), generator=torch.Generator().manual_seed(3))
    losses = T.compute_losses(model, batch, mtp_steps=2, distill=0.5)
    (losses["lm"] + losses["mtp1"] + losses["mtp2"]).backward()
    for name, p in model.named_parameters():
        if name.endswith("expert_bias"):
            assert not p.requires_grad and p.grad is None, name
        else:
            assert p.grad is not None and p.grad.abs().sum() > 0, name
    assert all(m.load.sum() > 0 for m in model.moe_layers())


@torch.no_grad()
def test_transformers_agrees_on_the_trunk(exported: Path) -> None:
    transformers = pytest.importorskip("transformers")
    hf = transformers.BailingHybridForCausalLM.from_pretrained(exported, dtype=torch.float32).eval()
    ref = T.load_checkpoint(exported)
    ids = torch.randint(0, SMALL["vocab_size"], (2, 33), generator=torch.Generator().manual_seed(2))
    torch.testing.assert_close(hf(ids).logits.float(), ref.logits(ref.hidden(ids)), rtol=1e-4, atol=1e-4)


def _fake_gsm8k(path: Path, count: int = 40) -> None:
    with path.open("w") as f:
        for i in range(count):
            q = f"Tom has {i} apples and buys {i + 3} more. How many apples does he have?"
            a = f"He has {i} + {i + 3} = <<{i}+{i + 3}={2 * i + 3}>>{2 * i + 3} apples.\n#### {2 * i + 3}"
            f.write(json.dumps({"question": q, "answer": a}) + "\n")


def test_training_run_is_reproducible_and_loadable(tmp_path: Path) -> None:
    data = tmp_path / "train.jsonl"
    _fake_gsm8k(data)
    args = [
        "--data",
        str(data),
        "--steps",
        "3",
        "--seq-len",
        "64",
        "--batch",
        "2",
        "--vocab-size",
        "320",
        "--hidden-size",
        "64",
        "--heldout",
        "8",
        "--eval-every",
        "2",
        "--eval-windows",
        "2",
        "--warmup",
        "1",
    ]
    for run in ("a", "b"):
        assert T.main([*args, "--out", str(tmp_path / run)]) == 0
    log = json.loads((tmp_path / "a" / "training_log.json").read_text())
    assert log["steps"] == 3 and log["heldout"] and {"lm", "mtp1", "agree1"} <= set(log["heldout"][-1])
    a, b = T.load_checkpoint(tmp_path / "a"), T.load_checkpoint(tmp_path / "b")
    for (name, x), y in zip(a.state_dict().items(), b.state_dict().values(), strict=True):
        assert torch.equal(x, y), name
    solo = load_model(tmp_path / "a")
    vocab = json.loads((tmp_path / "a" / "config.json").read_text())["vocab_size"]
    assert solo.nextn is not None and solo.config.vocab_size == vocab <= 320


def _bundled_prompt() -> str:
    return (
        "Question: Sam has 3 boxes with 4 pens in each box. How many pens does Sam have?\n"
        "Answer: Sam has 3 * 4 = <<3*4=12>>12 pens.\n#### 12\n\n"
        "Question: A baker made 24 muffins and sold 9 of them. How many muffins are left?\nAnswer:"
    )


@pytest.mark.skipif(not BUNDLED_BF16.is_dir(), reason="no BF16 bundled model")
@torch.no_grad()
def test_bundled_bf16_model_matches_training_model() -> None:
    ref = T.load_checkpoint(BUNDLED_BF16)
    solo = load_model(BUNDLED_BF16)
    from solo.tokenizer import Tokenizer

    ids = torch.tensor([Tokenizer.from_dir(BUNDLED_BF16).encode(_bundled_prompt())])
    hidden = ref.hidden(ids)
    cache = HybridCache(solo.config, ids.shape[1] + 4, "cpu", torch.float32, with_nextn=True)
    solo_hidden = solo(ids[0], torch.arange(ids.shape[1]), cache)
    torch.testing.assert_close(solo.logits(solo_hidden), ref.logits(hidden)[0], rtol=1e-3, atol=1e-3)
    (step1,) = ref.drafts(ids, hidden, 1)
    d1 = solo.draft_forward(ids[0, 1:], solo_hidden[:-1], torch.arange(1, ids.shape[1]), cache)
    torch.testing.assert_close(solo.logits(d1), ref.logits(step1)[0, 1:], rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize("path", [BUNDLED_BF16, BUNDLED])
def test_bundled_model_writes_a_gsm8k_answer(path: Path) -> None:
    if not path.is_dir():
        pytest.skip(f"{path.name} is not there")
    from solo.engine.engine import Engine, GenerationParams

    engine = Engine.from_pretrained(path, lm_head="fp32")
    result = engine.generate(_bundled_prompt(), GenerationParams(max_tokens=120, stop=("Question:",)))
    assert "####" in result.text and result.finish_reason == "stop", result.text
    total = sum(f.stat().st_size for f in path.iterdir())
    assert total <= 25 * 2**20

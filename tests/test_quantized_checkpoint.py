"""The fp4 checkpoint format: `solo quantize`, loading, LM head modes, malformed metadata."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from solo.assets import bundled_model
from solo.bench.quant_quality import compare, position_logits
from solo.checkpoint.loader import load_model
from solo.checkpoint.reader import CheckpointError
from solo.fastpath import load_accelerated
from solo.quantization import formats
from solo.quantization.convert import quantize_checkpoint
from solo.testing.routing import clear_of_ties


@pytest.fixture(scope="module")
def fp4_pair(tiny_checkpoints, tmp_path_factory):
    src, _ = tiny_checkpoints["a"]
    out = tmp_path_factory.mktemp("fp4")
    errors = quantize_checkpoint(src, out, verbose=False)
    return src, out, errors


def read_all(path):
    index = json.loads((path / "model.safetensors.index.json").read_text())
    tensors = {}
    for shard in set(index["weight_map"].values()):
        with safe_open(str(path / shard), "pt") as f:
            tensors.update({k: f.get_tensor(k) for k in f.keys()})  # noqa: SIM118
    return tensors


def test_quantized_layout_and_names(fp4_pair):
    src, out, errors = fp4_pair
    t = read_all(out)
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["quantization_config"]["routed_experts_quant_method"] == "mxfp4"
    assert cfg["quantization_config"]["weight_block_size"] == [128, 128]
    up = "model.layers.1.mlp.experts.3.up_proj"
    assert t[f"{up}.weight"].dtype == torch.uint8 and t[f"{up}.weight"].shape == (32, 32)
    assert t[f"{up}.weight_scale_inv"].dtype == torch.uint8 and t[f"{up}.weight_scale_inv"].shape == (32, 2)
    q = "model.layers.0.attention.q_proj"
    assert t[f"{q}.weight"].dtype == torch.float8_e4m3fn and t[f"{q}.weight_scale_inv"].shape == (1, 1)
    assert t["lm_head.weight"].dtype == torch.float32  # the head is not converted
    assert "model.layers.1.mlp.gate.weight_scale_inv" not in t  # the router stays as it was
    assert (out / "tokenizer.json").is_file()
    assert all(e.rel_rms < 0.2 for e in errors) and {e.fmt for e in errors} == {"mxfp4", "fp8"}


def test_fp4_checkpoint_computes_with_exactly_its_dequantized_weights(fp4_pair, tmp_path, fresh_ids):
    """Loading the fp4 checkpoint == loading a dense checkpoint holding its dequantized weights."""
    _, out, _ = fp4_pair
    dense = {}
    for name, w in read_all(out).items():
        if name.endswith("weight_scale_inv"):
            continue
        base = name[: -len(".weight")]
        scales = read_all(out).get(f"{base}.weight_scale_inv") if name.endswith(".weight") else None
        if scales is None:
            dense[name] = w
        elif w.dtype == torch.uint8:
            dense[name] = formats.dequantize_mxfp4(w, scales)
        else:
            dense[name] = formats.dequantize_fp8_block(w, scales)
    save_file(dense, str(tmp_path / "model.safetensors"))
    cfg = json.loads((out / "config.json").read_text())
    del cfg["quantization_config"]
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    shutil.copy(out / "tokenizer.json", tmp_path)
    fp4, unpacked = load_model(out), load_model(tmp_path)
    _, (got, want) = clear_of_ties(
        lambda: fresh_ids(60).tolist(), lambda ids: (position_logits(fp4, ids), position_logits(unpacked, ids))
    )
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_block_fp8_on_keeps_fp8_weights_and_computes_the_same(fp4_pair, fresh_ids):
    """--block-fp8 on: the block-FP8 linears keep their checkpoint bytes (FP8 + per-block scales);
    on CPU the reference kernel dequantizes per call, so the logits equal the dense loading's."""
    from solo.model.layers import Linear

    _, out, _ = fp4_pair
    dense = load_accelerated(out, lm_head="fp32")  # auto on a CPU: dequantized
    fp8 = load_accelerated(out, lm_head="fp32", block_fp8="on")
    kept = [m for m in fp8.modules() if isinstance(m, Linear) and m.is_block_fp8]
    assert kept and not any(m.is_block_fp8 for m in dense.modules() if isinstance(m, Linear))
    assert all(m.weight.dtype == torch.float8_e4m3fn and m.scale_inv.dtype == torch.float32 for m in kept)
    _, (got, want) = clear_of_ties(
        lambda: fresh_ids(40).tolist(), lambda ids: (position_logits(fp8, ids), position_logits(dense, ids))
    )
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    trunk = fp8.model.layers[: fp8.config.num_hidden_layers]
    ran = [m.fp8_calls > 0 or m.folded for m in trunk.modules() if isinstance(m, Linear) and m.is_block_fp8]
    assert ran and all(ran)  # every kept trunk layer ran (or was folded into another at load)
    q = fp8.model.layers[0].attention.q_proj
    torch.testing.assert_close(q.dense_weight(torch.float32), dense.model.layers[0].attention.q_proj.weight)


def test_block_fp8_auto_keeps_only_layers_where_the_kernel_wins():
    """auto: FP8 on a GPU for K >= 1536 (the measured crossover), never on the CPU; on/off: always/never."""
    from solo.fastpath import keep_block_fp8
    from solo.kernels.triton_fp8 import BLOCK_FP8_MIN_K
    from solo.model.layers import Linear

    small, large = Linear(BLOCK_FP8_MIN_K // 2, 64), Linear(BLOCK_FP8_MIN_K, 64)
    gpu, cpu = torch.device("cuda"), torch.device("cpu")  # only the decision: nothing is allocated
    assert not keep_block_fp8(small, "auto", gpu) and keep_block_fp8(large, "auto", gpu)
    assert not keep_block_fp8(large, "auto", cpu)
    assert keep_block_fp8(small, "on", cpu)
    assert not keep_block_fp8(large, "off", gpu)


def test_blocks_the_kernel_cannot_run_load_dense(fp4_pair, tmp_path, fresh_ids):
    """A checkpoint with 64x64 FP8 blocks: loaded dense (no error, same logits as its dequantized
    weights); --block-fp8 on, which would need the 128x128 kernel, is refused with the fix."""
    from solo.checkpoint.reader import CheckpointError
    from solo.fastpath import FastPathOptions, accelerate
    from solo.model.layers import Linear

    _, out, _ = fp4_pair
    tensors = read_all(out)
    requantized = dict(tensors)
    for name, w in tensors.items():
        if name.endswith(".weight") and w.dtype == torch.float8_e4m3fn:
            scale_name = name.removesuffix(".weight") + ".weight_scale_inv"
            dense = formats.dequantize_fp8_block(w, tensors[scale_name])
            requantized[name], requantized[scale_name] = formats.quantize_fp8_block(dense, (64, 64), "ue8m0")
    save_file(requantized, str(tmp_path / "model.safetensors"))
    cfg = json.loads((out / "config.json").read_text())
    cfg["quantization_config"]["weight_block_size"] = [64, 64]
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    shutil.copy(out / "tokenizer.json", tmp_path)
    model = load_model(tmp_path)
    assert not any(m.is_block_fp8 for m in model.modules() if isinstance(m, Linear))
    ids = fresh_ids(30).tolist()
    assert torch.isfinite(position_logits(model, ids)).all()
    with pytest.raises(CheckpointError, match="128x128"):
        accelerate(load_model(tmp_path), FastPathOptions(block_fp8="on"))


def test_block_fp8_check_reports_layers_and_refuses_dense_checkpoints(fp4_pair, tiny_checkpoints):
    from solo.engine.engine import Engine
    from solo.preflight.checks import check_block_fp8

    src, out, _ = fp4_pair
    on = check_block_fp8(Engine.from_pretrained(out, block_fp8="on"), "on")
    assert on.status == "ACTIVE", on
    assert on.evidence["fp8_layers"] > 0 and on.evidence["kernel"] == "reference_fp8_block_linear"
    dense = check_block_fp8(Engine.from_pretrained(src, block_fp8="on"), "on")  # a bf16 checkpoint
    assert dense.status == "FAILED" and "no block-FP8 layers" in dense.reason
    assert check_block_fp8(Engine.from_pretrained(out), "off").status == "OFF"
    auto = check_block_fp8(Engine.from_pretrained(out, block_fp8="auto"), "auto")  # CPU: nothing kept
    assert auto.status == "OFF" and auto.evidence["fp8_layers"] == 0 and "K >= 1536" in auto.evidence["reason"]
    with pytest.raises(ValueError, match="unknown block_fp8 mode"):
        load_accelerated(out, block_fp8="fast")


def test_quantized_model_generates_and_reports_quality(fp4_pair):
    src, out, _ = fp4_pair
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "solo.cli",
            "generate",
            "--model",
            str(out),
            "--json",
            "--max-tokens",
            "8",
            "Hello",
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    assert len(json.loads(proc.stdout)["token_ids"]) >= 1
    prompts = [torch.randint(6, 262, (48,)).tolist() for _ in range(8)]
    ref_model = load_model(src)
    reference = [position_logits(ref_model, p) for p in prompts]
    fp8_head = compare(reference, [position_logits(load_accelerated(src, lm_head="fp8"), p) for p in prompts])
    fp4 = compare(reference, [position_logits(load_model(out), p) for p in prompts])
    print(
        f"\ntiny random model: fp8 head top-1 {fp8_head['top1_agreement']:.3f} KL {fp8_head['mean_kl']:.2e}; "
        f"fp4 checkpoint top-1 {fp4['top1_agreement']:.3f} KL {fp4['mean_kl']:.2e}"
    )
    # a random model has many near-ties; the >= 99% criterion is checked on the trained bundled model
    assert fp8_head["top1_agreement"] > 0.9 and fp8_head["mean_kl"] < 1e-2
    assert fp4["mean_kl"] < 1.0


def test_lm_head_modes_report_what_is_in_use(tiny_checkpoints):
    src, _ = tiny_checkpoints["a"]
    heads = {mode: load_accelerated(src, lm_head=mode).lm_head.describe() for mode in ("bf16", "fp32", "fp8")}
    assert heads["bf16"]["weight_dtype"] == "bfloat16" and heads["fp32"]["weight_dtype"] == "float32"
    assert heads["fp8"]["weight_dtype"] == "float8_e4m3fn" and heads["fp8"]["scales"]["shape"] == [264]
    assert heads["fp8"]["bytes"] < heads["bf16"]["bytes"] * 0.6


def test_fp8_and_fp32_heads_cannot_be_combined(tiny_checkpoints):
    src, _ = tiny_checkpoints["a"]
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "solo.cli",
            "generate",
            "--model",
            str(src),
            "--lm-head",
            "fp8",
            "--lm-head",
            "fp32",
            "hi",
        ],
        capture_output=True,
        text=True,
    )
    assert proc.returncode != 0 and "cannot be combined" in proc.stderr


def _edit(out, tmp_path, edit_tensors=None, edit_config=None):
    dst = tmp_path / "bad"
    shutil.copytree(out, dst)
    if edit_tensors:
        shard = next(dst.glob("model-*.safetensors"))
        with safe_open(str(shard), "pt") as f:
            tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118
        edit_tensors(tensors)
        save_file(tensors, str(shard))
        index = json.loads((dst / "model.safetensors.index.json").read_text())
        index["weight_map"] = dict.fromkeys(tensors, shard.name)
        (dst / "model.safetensors.index.json").write_text(json.dumps(index))
    if edit_config:
        cfg = json.loads((dst / "config.json").read_text())
        edit_config(cfg["quantization_config"])
        (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def test_wrong_scale_shape_is_named(fp4_pair, tmp_path):
    name = "model.layers.2.mlp.experts.5.down_proj.weight_scale_inv"
    bad = _edit(fp4_pair[1], tmp_path, lambda t: t.update({name: t[name][:40].contiguous()}))
    with pytest.raises(CheckpointError, match="experts.5.down_proj.weight_scale_inv"):
        load_model(bad)


def test_missing_scale_tensor_is_named(fp4_pair, tmp_path):
    name = "model.layers.0.attention.g_proj.weight_scale_inv"
    bad = _edit(fp4_pair[1], tmp_path, lambda t: t.pop(name))
    with pytest.raises(CheckpointError, match="g_proj.weight_scale_inv' is missing"):
        load_model(bad)


def test_unknown_quant_method_is_named(fp4_pair, tmp_path):
    bad = _edit(fp4_pair[1], tmp_path, edit_config=lambda qc: qc.update(quant_method="awq"))
    with pytest.raises(CheckpointError, match="quant_method.*'awq'"):
        load_model(bad)
    bad2 = _edit(fp4_pair[1], tmp_path / "2", edit_config=lambda qc: qc.update(routed_experts_quant_method="nvfp4"))
    with pytest.raises(CheckpointError, match="routed_experts_quant_method"):
        load_model(bad2)


BUNDLED = bundled_model().parent


def test_fp8_head_agreement_on_the_trained_bundled_model():
    """The trained model (not a random one, whose logits are full of near-ties): with only the FP8
    LM head, top-1 next-token agreement with the BF16 checkpoint computed in fp32 is >= 99% at the
    positions decoding reads (the reference's own greedy continuations of 16 GSM8K prompts)."""
    from solo.bench.quant_quality import default_prompts, evaluate

    reference = BUNDLED / "ling-gsm8k-tiny-bf16"
    report = evaluate(reference, BUNDLED / "ling-gsm8k-tiny", default_prompts(reference, 16), new_tokens=64)
    fp8 = report["bf16 checkpoint, fp8 head"]
    print("\n" + "\n".join(f"{k}: top-1 {v['top1_agreement']:.4f} KL {v['mean_kl']:.2e}" for k, v in report.items()))
    assert fp8["positions"] == 16 * 64 and fp8["top1_agreement"] >= 0.99
    assert report["fp4 checkpoint, fp8 head"]["top1_agreement"] > 0.9

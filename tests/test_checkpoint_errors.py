"""Bad checkpoints and configs fail with a message naming the tensor, file or field (never a crash)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from solo.checkpoint.loader import LoadOptions, load_model
from solo.checkpoint.reader import CheckpointError
from solo.config import ConfigError, LingConfig
from solo.engine.engine import Engine


@pytest.fixture()
def ckpt(tiny_checkpoints, tmp_path):
    src, _ = tiny_checkpoints["a"]
    dst = tmp_path / "ckpt"
    shutil.copytree(src, dst)
    return dst


def shard_of(path, name):
    return path / json.loads((path / "model.safetensors.index.json").read_text())["weight_map"][name]


def rewrite_shard(shard, edit):
    with safe_open(str(shard), "pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118
    edit(tensors)
    save_file(tensors, str(shard), metadata={"format": "pt"})


def run_cli(path):
    return subprocess.run(
        [sys.executable, "-m", "solo.cli", "generate", "--model", str(path), "hi"],
        capture_output=True,
        text=True,
    )


def test_missing_tensor_is_named(ckpt):
    name = "model.layers.1.attention.kv_b_proj.weight"
    rewrite_shard(shard_of(ckpt, name), lambda t: t.pop(name))
    index = json.loads((ckpt / "model.safetensors.index.json").read_text())
    del index["weight_map"][name]
    (ckpt / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match="kv_b_proj.weight' is missing"):
        load_model(ckpt)
    proc = run_cli(ckpt)
    assert proc.returncode != 0 and "kv_b_proj.weight" in proc.stderr and "Traceback" not in proc.stderr


def test_unexpected_tensor_is_named(ckpt):
    name = "model.layers.0.attention.q_proj.weight"
    shard = shard_of(ckpt, name)
    rewrite_shard(shard, lambda t: t.update({"model.layers.9.mlp.bogus.weight": torch.randn(3)}))
    index = json.loads((ckpt / "model.safetensors.index.json").read_text())
    index["weight_map"]["model.layers.9.mlp.bogus.weight"] = shard.name
    (ckpt / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match="unexpected tensors.*layers.9.mlp.bogus"):
        load_model(ckpt)


def test_misshaped_tensor_is_named(ckpt):
    name = "model.layers.2.attention.f_proj.weight"
    rewrite_shard(shard_of(ckpt, name), lambda t: t.update({name: torch.randn(7, 64)}))
    with pytest.raises(CheckpointError, match=r"f_proj.weight' has shape \[7, 64\], expected \[64, 64\]"):
        load_model(ckpt)


def test_truncated_shard_is_named(ckpt):
    shard = shard_of(ckpt, "model.word_embeddings.weight")
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match=f"{shard.name}.*truncated or corrupt"):
        load_model(ckpt)
    proc = run_cli(ckpt)
    assert proc.returncode != 0 and shard.name in proc.stderr and "Traceback" not in proc.stderr


def test_missing_shard_is_named(ckpt):
    shard = shard_of(ckpt, "lm_head.weight")
    shard.unlink()
    with pytest.raises(CheckpointError, match=f"{shard.name}: shard listed .* is missing"):
        load_model(ckpt)


def test_missing_tokenizer_is_named(ckpt):
    (ckpt / "tokenizer.json").unlink()
    with pytest.raises(CheckpointError, match="tokenizer.json is missing"):
        Engine.from_pretrained(ckpt)
    proc = run_cli(ckpt)
    assert proc.returncode != 0 and "tokenizer.json" in proc.stderr


def test_missing_config_and_folder(tmp_path):
    proc = run_cli(tmp_path / "nowhere")
    assert proc.returncode != 0 and "config.json not found" in proc.stderr


def test_unrunnable_config_names_the_field(ckpt):
    cfg = json.loads((ckpt / "config.json").read_text())
    cfg["hidden_act"] = "gelu"
    (ckpt / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match="hidden_act"):
        load_model(ckpt, LoadOptions())
    proc = run_cli(ckpt)
    assert proc.returncode != 0 and "hidden_act" in proc.stderr


@pytest.mark.parametrize(
    ("field", "value", "named"),
    [
        ("num_expert_group", 3, "n_group"),
        ("topk_group", 9, "topk_group"),
        ("num_experts_per_token", 64, "num_experts_per_tok"),
        ("model_type", "llama", "model_type"),
        ("rope_parameters", {"rope_type": "longrope", "rope_theta": 1e4}, "rope_type"),
        ("layer_types", ["mamba"] * 4, "layer_types"),
        ("vocab_size", None, "vocab_size"),
    ],
)
def test_config_errors_name_the_field(tiny_checkpoints, field, value, named):
    src, _ = tiny_checkpoints["a"]
    raw = json.loads((src / "config.json").read_text())
    raw[field] = value
    with pytest.raises(ConfigError) as err:
        LingConfig.from_dict(raw)
    assert named in str(err.value)


def test_both_config_spellings_agree(tiny_checkpoints):
    src, _ = tiny_checkpoints["b"]
    hf = json.loads((src / "config.json").read_text())
    published = dict(hf)
    for hf_name, original in [
        ("num_experts_per_token", "num_experts_per_tok"),
        ("num_expert_group", "n_group"),
        ("moe_renormalize", "norm_topk_prob"),
        ("num_experts", "num_local_experts"),
        ("model_max_length", "max_position_embeddings"),
        ("num_shared_experts", "n_shared_experts"),
    ]:
        published[original] = published.pop(hf_name)
    published["head_dim"] = published.pop("linear_head_dim")  # the published config has only head_dim
    for derived in ("layer_types", "mlp_layer_types", "linear_num_heads", "linear_conv_kernel_dim"):
        published.pop(derived, None)
    assert LingConfig.from_dict(hf) == LingConfig.from_dict(published)


def test_conflicting_alias_is_an_error(tiny_checkpoints):
    src, _ = tiny_checkpoints["a"]
    raw = json.loads((src / "config.json").read_text())
    raw["num_experts_per_tok"] = raw["num_experts_per_token"] + 1
    with pytest.raises(ConfigError, match="num_experts_per_tok.*disagree"):
        LingConfig.from_dict(raw)

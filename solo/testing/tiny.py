"""Tiny random Ling-3.0 checkpoints written by transformers' own BailingHybridForCausalLM.

transformers 5.23 is the independent oracle: it builds the model from a config, and its
`save_pretrained` writes the original checkpoint naming. It has no NEXTN layer, so a random one is
appended as an extra shard (with the index updated), in the naming of the published checkpoint.
Weights are re-drawn at a scale where every sub-layer visibly changes the output, so an error
anywhere shows in the logits.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from solo.tokenizer import write_byte_tokenizer

BYTE_VOCAB = 256 + 8  # bytes + special tokens, see solo.tokenizer

PRESETS: dict[str, dict[str, Any]] = {
    # two KDA + MLA groups, one dense layer, 4 groups of 4 experts keep 2, top-4
    "a": dict(
        hidden_size=64,
        num_hidden_layers=4,
        layer_group_size=2,
        first_k_dense_replace=1,
        num_attention_heads=4,
        head_dim=16,
        kv_lora_rank=32,
        qk_nope_head_dim=16,
        qk_rope_head_dim=16,
        v_head_dim=16,
        num_local_experts=16,
        n_group=4,
        topk_group=2,
        num_experts_per_tok=4,
        intermediate_size=96,
        moe_intermediate_size=32,
    ),
    # group size 3, two dense layers, 8 groups keep 3, top-6 of 32 experts, other head sizes, yarn RoPE
    "b": dict(
        hidden_size=96,
        num_hidden_layers=6,
        layer_group_size=3,
        first_k_dense_replace=2,
        num_attention_heads=3,
        head_dim=32,
        kv_lora_rank=48,
        qk_nope_head_dim=24,
        qk_rope_head_dim=8,
        v_head_dim=20,
        num_local_experts=32,
        n_group=8,
        topk_group=3,
        num_experts_per_tok=6,
        intermediate_size=128,
        moe_intermediate_size=24,
        rope_parameters={
            "rope_type": "yarn",
            "rope_theta": 10000.0,
            "factor": 4.0,
            "original_max_position_embeddings": 32,
            "mscale": 1.0,
            "mscale_all_dim": 1.0,
        },
    ),
    # no grouping (n_group 1), no dense layer, 2 heads of 64, top-2 of 8
    "c": dict(
        hidden_size=128,
        num_hidden_layers=3,
        layer_group_size=3,
        first_k_dense_replace=0,
        num_attention_heads=2,
        head_dim=64,
        kv_lora_rank=64,
        qk_nope_head_dim=32,
        qk_rope_head_dim=32,
        v_head_dim=32,
        num_local_experts=8,
        n_group=1,
        topk_group=1,
        num_experts_per_tok=2,
        intermediate_size=160,
        moe_intermediate_size=48,
    ),
}


def transformers_config(preset: str = "a", **overrides: Any):
    from transformers import BailingHybridConfig

    kwargs: dict[str, Any] = dict(
        vocab_size=BYTE_VOCAB,
        pad_token_id=0,
        eos_token_id=3,
        bos_token_id=None,
        rope_theta=10000.0,
        max_position_embeddings=4096,
    )
    kwargs.update(PRESETS[preset])
    kwargs.update(overrides)
    return BailingHybridConfig(**kwargs)


def randomize_(model: torch.nn.Module, seed: int) -> None:
    """Redraw weights so that every sub-layer matters: linear weights ~ N(0, 1/fan_in),
    norms around 1, a non-zero expert bias; keep transformers' KDA gate parameters."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("A_log", "dt_bias")):
                continue
            if p.dim() == 1:
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=gen))
            elif "conv1d" in name:
                p.copy_(0.5 * torch.randn(p.shape, generator=gen))
            else:
                p.copy_(torch.randn(p.shape, generator=gen) / math.sqrt(p.shape[-1]))
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.1 * torch.randn(b.shape, generator=gen))


def nextn_tensors(config: Any, seed: int) -> dict[str, torch.Tensor]:
    """A random NEXTN layer (MLA + MoE block) under `model.layers.{num_hidden_layers}`."""
    gen = torch.Generator().manual_seed(seed + 1)
    h, heads = config.hidden_size, config.num_attention_heads
    qk = config.qk_nope_head_dim + config.qk_rope_head_dim
    inter = config.moe_intermediate_size
    p = f"model.layers.{config.num_hidden_layers}."
    shapes: dict[str, tuple[int, ...]] = {
        "enorm.weight": (h,),
        "hnorm.weight": (h,),
        "eh_proj.weight": (h, 2 * h),
        "final_layernorm.weight": (h,),
        "input_layernorm.weight": (h,),
        "post_attention_layernorm.weight": (h,),
        "attention.q_proj.weight": (heads * qk, h),
        "attention.kv_a_proj_with_mqa.weight": (config.kv_lora_rank + config.qk_rope_head_dim, h),
        "attention.kv_a_layernorm.weight": (config.kv_lora_rank,),
        "attention.kv_b_proj.weight": (
            heads * (config.qk_nope_head_dim + config.v_head_dim),
            config.kv_lora_rank,
        ),
        "attention.g_proj.weight": (heads, h),
        "attention.dense.weight": (h, heads * config.v_head_dim),
        "mlp.gate.weight": (config.num_local_experts, h),
        "mlp.gate.expert_bias": (config.num_local_experts,),
        "mlp.shared_experts.gate_proj.weight": (inter, h),
        "mlp.shared_experts.up_proj.weight": (inter, h),
        "mlp.shared_experts.down_proj.weight": (h, inter),
    }
    for e in range(config.num_local_experts):
        shapes[f"mlp.experts.{e}.gate_proj.weight"] = (inter, h)
        shapes[f"mlp.experts.{e}.up_proj.weight"] = (inter, h)
        shapes[f"mlp.experts.{e}.down_proj.weight"] = (h, inter)
    out = {}
    for name, shape in shapes.items():
        if name.endswith("expert_bias"):
            t = 0.1 * torch.randn(shape, generator=gen)
        elif len(shape) == 1:
            t = 1.0 + 0.2 * torch.randn(shape, generator=gen)
        else:
            t = torch.randn(shape, generator=gen) / math.sqrt(shape[-1])
        out[p + name] = t
    return out


def write_tiny_checkpoint(
    out_dir: str | Path,
    preset: str = "a",
    seed: int = 0,
    with_nextn: bool = True,
    max_shard_size: str = "200KB",
    **overrides: Any,
):
    """Write a tiny random checkpoint (sharded safetensors + index, config.json, tokenizer.json)
    and return the transformers model that wrote it (the oracle for tests)."""
    from transformers import BailingHybridForCausalLM

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    config = transformers_config(preset, **overrides)
    torch.manual_seed(seed)
    model = BailingHybridForCausalLM(config).float().eval()
    randomize_(model, seed)
    model.save_pretrained(out, max_shard_size=max_shard_size)
    if with_nextn:
        _append_shard(out, "model-nextn.safetensors", nextn_tensors(config, seed))
    write_byte_tokenizer(out / "tokenizer.json")
    return model


def _append_shard(out: Path, shard_name: str, tensors: dict[str, torch.Tensor]) -> None:
    index_path = out / "model.safetensors.index.json"
    if index_path.is_file():
        index = json.loads(index_path.read_text())
    else:  # a single-file checkpoint becomes a sharded one
        from safetensors import safe_open

        single = out / "model.safetensors"
        with safe_open(str(single), "pt") as f:
            index = {"metadata": {}, "weight_map": dict.fromkeys(f.keys(), "model.safetensors")}
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(out / shard_name), metadata={"format": "pt"})
    index["weight_map"].update(dict.fromkeys(tensors, shard_name))
    index_path.write_text(json.dumps(index, indent=2))

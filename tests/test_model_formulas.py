"""q LoRA and SwiGLU clamps: transformers has neither, so the oracle model is patched with the
formulas (q = q_b(RMSNorm(q_a(x))); act = silu(gate).clamp(max=L) * up.clamp(-L, L)) and compared."""

from __future__ import annotations

import json
import math
import types

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import save_file

from solo.checkpoint.loader import load_model
from solo.model.cache import HybridCache
from solo.testing.tiny import write_tiny_checkpoint


def rms(x: torch.Tensor, w: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def clamped_swiglu(gate: torch.Tensor, up: torch.Tensor, limit: float) -> torch.Tensor:
    return F.silu(gate).clamp(max=limit) * up.clamp(-limit, limit)


class LoraQuery(torch.nn.Module):
    def __init__(self, q_a, norm_w, q_b):
        super().__init__()
        self.q_a, self.norm_w, self.q_b = q_a, norm_w, q_b

    def forward(self, x):
        return F.linear(rms(F.linear(x, self.q_a), self.norm_w), self.q_b)


def solo_logits(path, ids):
    model = load_model(path)
    with torch.no_grad():
        return model.logits(
            model(ids, torch.arange(len(ids)), HybridCache(model.config, len(ids), "cpu", torch.float32))
        )


def add_to_checkpoint(path, tensors: dict[str, torch.Tensor], drop: set[str], config_update: dict):
    index_path = path / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    for name in drop:
        del index["weight_map"][name]
    save_file(tensors, str(path / "extra.safetensors"))
    index["weight_map"].update(dict.fromkeys(tensors, "extra.safetensors"))
    index_path.write_text(json.dumps(index))
    # dropped tensors still sit in their shard: rewrite those shards without them
    from safetensors import safe_open

    for shard in {p for p in path.glob("model-*.safetensors")}:
        with safe_open(str(shard), "pt") as f:
            kept = {k: f.get_tensor(k) for k in f.keys() if k not in drop}  # noqa: SIM118
        save_file(kept, str(shard), metadata={"format": "pt"})
    cfg = json.loads((path / "config.json").read_text())
    cfg.update(config_update)
    (path / "config.json").write_text(json.dumps(cfg))


def test_q_lora_matches_formula(tmp_path):
    ref = write_tiny_checkpoint(tmp_path, preset="a", seed=7, with_nextn=False)
    cfg = ref.config
    rank = 24
    new, drop = {}, set()
    for i, layer in enumerate(ref.model.layers):
        if cfg.layer_types[i] != "full_attention":
            continue
        attn = layer.self_attn
        q_a = torch.randn(rank, cfg.hidden_size) / math.sqrt(cfg.hidden_size)
        norm_w = 1 + 0.2 * torch.randn(rank)
        q_b = torch.randn(attn.q_proj.out_features, rank) / math.sqrt(rank)
        prefix = f"model.layers.{i}.attention."
        new.update(
            {
                prefix + "q_a_proj.weight": q_a,
                prefix + "q_a_layernorm.weight": norm_w,
                prefix + "q_b_proj.weight": q_b,
            }
        )
        drop.add(prefix + "q_proj.weight")

        attn.q_proj = LoraQuery(q_a, norm_w, q_b)  # the oracle with q LoRA written from the formula
    add_to_checkpoint(tmp_path, new, drop, {"q_lora_rank": rank})
    ids = torch.randint(6, 262, (40,))
    with torch.no_grad():
        expected = ref(ids[None]).logits[0]
    got = solo_logits(tmp_path, ids)
    assert float((got - expected).abs().max() / expected.abs().max()) <= 1e-4


def test_swiglu_clamps_match_formula(tmp_path):
    ref = write_tiny_checkpoint(tmp_path, preset="a", seed=8, with_nextn=False)
    cfg = ref.config
    limit_routed, limit_shared = 0.35, 0.25  # small enough that clamping changes the output
    n = cfg.num_hidden_layers
    ids = torch.randint(6, 262, (40,))
    with torch.no_grad():
        unclamped = ref(ids[None]).logits[0]

    def experts_forward(self, hidden, top_k_index, top_k_weights):
        out = torch.zeros_like(hidden)
        for t in range(hidden.shape[0]):
            for slot in range(top_k_index.shape[1]):
                e = int(top_k_index[t, slot])
                gate, up = F.linear(hidden[t], self.gate_up_proj[e]).chunk(2, dim=-1)
                out[t] += top_k_weights[t, slot] * F.linear(clamped_swiglu(gate, up, limit_routed), self.down_proj[e])
        return out

    def shared_forward(self, x):
        return self.down_proj(clamped_swiglu(self.gate_proj(x), self.up_proj(x), limit_shared))

    for i, layer in enumerate(ref.model.layers):
        if cfg.mlp_layer_types[i] == "sparse":
            layer.mlp.experts.forward = types.MethodType(experts_forward, layer.mlp.experts)
            layer.mlp.shared_experts.forward = types.MethodType(shared_forward, layer.mlp.shared_experts)
    add_to_checkpoint(
        tmp_path,
        {},
        set(),
        {
            "expert_swiglu_limit_list": [limit_routed] * n,
            "share_expert_swiglu_limit_list": [limit_shared] * n,
        },
    )
    with torch.no_grad():
        expected = ref(ids[None]).logits[0]
    assert float((expected - unclamped).abs().max() / unclamped.abs().max()) > 1e-2  # the clamp matters
    got = solo_logits(tmp_path, ids)
    assert float((got - expected).abs().max() / expected.abs().max()) <= 1e-4


@pytest.mark.parametrize("chunk_size", [16, 64])
def test_kda_chunked_prefill_equals_the_token_by_token_recurrence(chunk_size):
    """Both prefill chunk sizes (16 on a CPU, 64 on a GPU: solo.model.kda.prefill_chunk_size) give the
    recurrence's outputs and final state, across a partial last chunk and from a non-zero state."""
    from solo.model.kda import kda_chunked, kda_recurrent

    gen = torch.Generator().manual_seed(int(torch.randint(0, 2**31, ())))
    tokens, heads, d_k, d_v = 150, 3, 16, 24
    q = torch.randn(tokens, heads, d_k, generator=gen)
    k = torch.nn.functional.normalize(torch.randn(tokens, heads, d_k, generator=gen), dim=-1)
    v = torch.randn(tokens, heads, d_v, generator=gen)
    g = -torch.rand(tokens, heads, d_k, generator=gen) * 0.7
    beta = torch.rand(tokens, heads, generator=gen)
    start = torch.randn(heads, d_k, d_v, generator=gen) * 0.3
    state_ref, state = start.clone(), start.clone()
    expected = kda_recurrent(q, k, v, g, beta, state_ref)
    out = kda_chunked(q, k, v, g, beta, state, chunk_size)
    torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(state, state_ref, rtol=1e-4, atol=1e-4)

"""Multi-head latent attention (DeepSeek-style) with Ling's head-wise sigmoid output gate.

The cache holds, per token, the normalised compressed kv (kv_lora_rank values) and the rotated
shared rope key. Attention runs in the latent space ("weight absorption"): the key up-projection
is folded into the query and the value up-projection applied after the softmax, so keys and
values are never expanded per head. This is exact algebra, not an approximation.
"""

from __future__ import annotations

import torch
from torch import nn

from solo.config import LingConfig
from solo.model.cache import MLACache
from solo.model.layers import Linear, RMSNorm, RotaryEmbedding, mla_softmax_scale


class MultiLatentAttention(nn.Module):
    """`num_heads`: the heads this module computes (a tensor-parallel rank's share; default all). The
    latent path (kv_a, q_a) is every head's, so it is whole on every rank."""

    def __init__(self, config: LingConfig, num_heads: int | None = None) -> None:
        super().__init__()
        hidden = config.hidden_size
        self.num_heads = num_heads or config.num_attention_heads
        self.nope_dim = config.qk_nope_head_dim
        self.rope_dim = config.qk_rope_head_dim
        self.v_dim = config.v_head_dim
        self.kv_lora_rank = config.kv_lora_rank
        self.q_lora_rank = config.q_lora_rank
        q_out = self.num_heads * config.qk_head_dim
        if self.q_lora_rank:
            self.q_a_proj = Linear(hidden, self.q_lora_rank)
            self.q_a_layernorm = RMSNorm(self.q_lora_rank, config.rms_norm_eps)
            self.q_b_proj = Linear(self.q_lora_rank, q_out)
        else:
            self.q_proj = Linear(hidden, q_out)
        self.kv_a_proj_with_mqa = Linear(hidden, self.kv_lora_rank + self.rope_dim)
        self.kv_a_layernorm = RMSNorm(self.kv_lora_rank, config.rms_norm_eps)
        self.kv_b_proj = Linear(self.kv_lora_rank, self.num_heads * (self.nope_dim + self.v_dim))
        self.g_proj = Linear(hidden, self.num_heads)
        self.dense = Linear(self.num_heads * self.v_dim, hidden)
        self.scale = mla_softmax_scale(config)
        self.register_buffer("w_uk", torch.empty(0), persistent=False)  # [heads, nope, rank]
        self.register_buffer("w_uv", torch.empty(0), persistent=False)  # [heads, v, rank]

    def finalize(self, dtype: torch.dtype) -> None:
        """After loading: split kv_b_proj into the absorbed key and value up-projections."""
        w = self.kv_b_proj.dense_weight(dtype).view(self.num_heads, self.nope_dim + self.v_dim, -1)
        self.kv_b_proj.folded = True  # never called itself from now on
        self.w_uk = w[:, : self.nope_dim].contiguous()
        self.w_uv = w[:, self.nope_dim :].contiguous()

    def queries(self, x: torch.Tensor) -> torch.Tensor:
        if self.q_lora_rank:
            return self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        return self.q_proj(x)

    def project(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [..., T, hidden], cos/sin [T, rope/2] -> q_nope [..., T, heads, nope], the rotated
        q_rope [..., T, heads, rope], the normalised latent [..., T, rank] and the rotated shared
        k_rope [..., T, rope]: what the cache stores and what attends it (the training model runs
        this on batches [B, T, hidden])."""
        q = self.queries(x).unflatten(-1, (self.num_heads, self.nope_dim + self.rope_dim))
        q_nope, q_rope = q.split([self.nope_dim, self.rope_dim], dim=-1)
        q_rope = RotaryEmbedding.rotate(q_rope, cos[:, None], sin[:, None])
        latent, k_rope = self.kv_a_proj_with_mqa(x).split([self.kv_lora_rank, self.rope_dim], dim=-1)
        latent = self.kv_a_layernorm(latent)
        k_rope = RotaryEmbedding.rotate(k_rope, cos, sin)
        return q_nope, q_rope, latent, k_rope

    def forward(
        self,
        x: torch.Tensor,
        positions: torch.Tensor,
        cos_sin: tuple[torch.Tensor, torch.Tensor],
        cache: MLACache,
    ) -> torch.Tensor:
        num_tokens = x.shape[0]
        q_nope, q_rope, latent, k_rope = self.project(x, *cos_sin)
        cache.latent.index_copy_(0, positions, latent.to(cache.latent.dtype))
        cache.rope.index_copy_(0, positions, k_rope.to(cache.rope.dtype))

        q_latent = torch.einsum("thn,hnr->thr", q_nope, self.w_uk)
        scores = torch.einsum("thr,lr->thl", q_latent, cache.latent) + torch.einsum("thd,ld->thl", q_rope, cache.rope)
        key_pos = torch.arange(cache.latent.shape[0], device=x.device)
        visible = key_pos[None, :] <= positions[:, None]  # causal over absolute positions
        scores = scores.float().masked_fill(~visible[:, None, :], float("-inf")) * self.scale
        probs = torch.softmax(scores, dim=-1).to(x.dtype)
        out_latent = torch.einsum("thl,lr->thr", probs, cache.latent)
        out = torch.einsum("thr,hvr->thv", out_latent, self.w_uv)
        gate = torch.sigmoid(self.g_proj(x).float()).to(x.dtype)
        return self.dense((out * gate[..., None]).reshape(num_tokens, -1))

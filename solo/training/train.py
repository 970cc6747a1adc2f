"""Train the bundled tiny Ling-3.0 model (KDA + MLA, grouped MoE, NEXTN) on GSM8K train.

The training model here is batched ([B, T, H]) and differentiable; its modules carry the checkpoint's
tensor names, so the export is (almost) its state dict. It computes exactly what solo's batch-1
inference model computes:

* trunk: KDA layers (short convs, L2-normed q/k, safe gate, delta rule, gated o_norm) and MLA layers
  (latent kv, interleaved RoPE, head-wise sigmoid gate), dense first layer, grouped sigmoid-routed
  MoE with a shared expert (the routed experts are evaluated as one dense SwiGLU of width E*I whose
  units are weighted by the routing weights, which equals the sparse sum);
* NEXTN: slot p (RoPE position p >= 1) gets x = eh_proj([enorm(embed(t_p)); hnorm(h_{p-1})]), one MLA
  + MoE block, final_layernorm; logits = the main lm_head, predicting t_{p+1}. Slot 0 is never
  written, so, as in solo's position-indexed MLA cache, position 0 holds a zero key and value that
  every slot attends. Chained drafting is trained by unrolling: step k at slot p takes the step-(k-1)
  output at slot p-1 as its hidden and attends the step-1 slots before p plus itself (exact for
  step 2; step 3 sees the step-1 slot at p-1 where inference has the step-2 one).

Data: GSM8K train documents "Question: {q}\\nAnswer: {a}" in episodes of 1-8 documents joined by
"\\n\\n" (the 5-shot prompt layout), each episode followed by the eos `<|role_end|>`; windows start
at document starts. The last `--heldout` documents of the file are held out for the loss curves.

CLI: ``python -m solo.training.train --data train.jsonl --out DIR [--steps N --seq-len L ...]``;
``--measure DIR`` instead evaluates an exported checkpoint (NEXTN agreement, accept length).
"""

from __future__ import annotations

import argparse
import bisect
import json
import math
import random
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

from solo.assets import gsm8k_file, read_jsonl

# ============================================================================ configuration


@dataclass
class TinyConfig:
    """The small Ling-3.0 configuration (names as in solo.config.LingConfig)."""

    vocab_size: int = 2048
    hidden_size: int = 256
    num_hidden_layers: int = 6
    layer_group_size: int = 3
    first_k_dense_replace: int = 1
    intermediate_size: int = 512
    num_attention_heads: int = 4
    linear_head_dim: int = 64
    kv_lora_rank: int = 64
    qk_nope_head_dim: int = 32
    qk_rope_head_dim: int = 32
    v_head_dim: int = 64
    num_experts: int = 32
    n_group: int = 4
    topk_group: int = 2
    num_experts_per_tok: int = 4
    moe_intermediate_size: int = 32
    n_shared_experts: int = 1
    routed_scaling_factor: float = 2.5
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    conv_kernel_size: int = 4
    kda_lower_bound: float = -5.0
    max_position_embeddings: int = 4096
    eos_token_id: int = 3
    pad_token_id: int = 0

    def is_mla(self, layer: int) -> bool:
        return layer >= self.num_hidden_layers or (layer + 1) % self.layer_group_size == 0

    def is_moe(self, layer: int) -> bool:
        return layer >= self.first_k_dense_replace

    def to_checkpoint_config(self) -> dict[str, Any]:
        """config.json in transformers' spelling (solo reads both), with the NEXTN layer announced."""
        n = self.num_hidden_layers
        return {
            "architectures": ["BailingHybridForCausalLM"],
            "model_type": "bailing_hybrid",
            "dtype": "bfloat16",
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "num_hidden_layers": n,
            "layer_group_size": self.layer_group_size,
            "layer_types": ["full_attention" if self.is_mla(i) else "linear_attention" for i in range(n)],
            "first_k_dense_replace": self.first_k_dense_replace,
            "mlp_layer_types": ["sparse" if self.is_moe(i) else "dense" for i in range(n)],
            "intermediate_size": self.intermediate_size,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_attention_heads,
            "head_dim": self.linear_head_dim,
            "linear_head_dim": self.linear_head_dim,
            "linear_num_heads": self.num_attention_heads,
            "kv_lora_rank": self.kv_lora_rank,
            "q_lora_rank": None,
            "qk_nope_head_dim": self.qk_nope_head_dim,
            "qk_rope_head_dim": self.qk_rope_head_dim,
            "v_head_dim": self.v_head_dim,
            "num_experts": self.num_experts,
            "num_expert_group": self.n_group,
            "topk_group": self.topk_group,
            "num_experts_per_token": self.num_experts_per_tok,
            "moe_intermediate_size": self.moe_intermediate_size,
            "num_shared_experts": self.n_shared_experts,
            "moe_renormalize": True,
            "routed_scaling_factor": self.routed_scaling_factor,
            "rms_norm_eps": self.rms_norm_eps,
            "hidden_act": "silu",
            "rope_theta": self.rope_theta,
            "rope_parameters": {"rope_type": "default", "rope_theta": self.rope_theta},
            "short_conv_kernel_size": self.conv_kernel_size,
            "kda_safe_gate": True,
            "kda_lower_bound": self.kda_lower_bound,
            "model_max_length": self.max_position_embeddings,
            "num_nextn_predict_layers": 1,
            "tie_word_embeddings": False,
            "attention_bias": False,
            "eos_token_id": self.eos_token_id,
            "pad_token_id": self.pad_token_id,
            "bos_token_id": None,
        }

    @classmethod
    def from_checkpoint_config(cls, raw: dict[str, Any]) -> TinyConfig:
        """Read back a config.json written by `to_checkpoint_config` (either spelling)."""
        from solo.config import LingConfig

        c = LingConfig.from_dict(raw)
        values = {f.name: getattr(c, f.name) for f in fields(cls) if f.name not in ("eos_token_id",)}
        values["linear_head_dim"] = c.linear_head_dim
        values["eos_token_id"] = c.eos_token_id[0] if c.eos_token_id else 3
        return cls(**values)


# ============================================================================ model


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


class ConvWeight(nn.Module):
    """A depthwise conv weight [D, 1, K] under the checkpoint's `*_conv1d.weight` name."""

    def __init__(self, channels: int, kernel: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(channels, 1, kernel))


def linear(i: int, o: int) -> nn.Linear:
    return nn.Linear(i, o, bias=False)


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def unit_lower_inverse(lower: torch.Tensor) -> torch.Tensor:
    """(I + L)^-1 for strictly lower-triangular L [..., C, C] (C a power of two), by doubling the
    inverted diagonal blocks: inv([[A, 0], [X, D]]) = [[A^-1, 0], [-D^-1 X A^-1, D^-1]]. Batched
    matmuls only (fast on both CPU and GPU, unlike batched triangular solves of tiny matrices)."""
    size = lower.shape[-1]
    inv = torch.eye(size, dtype=lower.dtype, device=lower.device).expand_as(lower)
    block = 1
    while block < size:
        n = size // block
        shape = (*lower.shape[:-2], n, block, n, block)
        lb = lower.reshape(shape).transpose(-3, -2)  # [..., n, n, b, b]
        ib = inv.reshape(shape).transpose(-3, -2).clone()
        even = torch.arange(0, n, 2, device=lower.device)
        ib[..., even + 1, even, :, :] = (
            -ib[..., even + 1, even + 1, :, :] @ lb[..., even + 1, even, :, :] @ ib[..., even, even, :, :]
        )
        inv = ib.transpose(-3, -2).reshape(lower.shape)
        block *= 2
    return inv


def kda_chunked(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, chunk: int = 16
) -> torch.Tensor:
    """Batched, differentiable KDA from a zero state: q, k, g [B, T, H, dk], v [B, T, H, dv],
    beta [B, T, H] (fp32) -> o [B, T, H, dv].

    Inside a chunk (cumulative log decay G, G >= chunk * lower_bound, so e^{+-G} stays finite in fp32)
    the intra-chunk terms are plain matmuls of (x e^{G}) and (k e^{-G}); the WY form U = U0 - W S
    leaves a linear recurrence S_{n+1} = A_n S_n + B_n across chunks, solved by a parallel scan.
    """
    bsz, length, heads, dk = k.shape
    dv = v.shape[-1]
    pad = (-length) % chunk
    if pad:  # zero k and beta, zero log-decay: padded tokens change nothing before them
        q, k, v, g = (F.pad(x, (0, 0, 0, 0, 0, pad)) for x in (q, k, v, g))
        beta = F.pad(beta, (0, 0, 0, pad))
    n = (length + pad) // chunk

    def split(x: torch.Tensor) -> torch.Tensor:  # [B, T, H, d] -> [B, H, N, C, d]
        return x.reshape(bsz, n, chunk, heads, -1).permute(0, 3, 1, 2, 4)

    q, k, v, g = split(q), split(k), split(v), split(g)
    beta = beta.reshape(bsz, n, chunk, heads).permute(0, 3, 1, 2)[..., None]  # [B, H, N, C, 1]
    cum = g.cumsum(3)
    last = cum[:, :, :, -1:]  # [B, H, N, 1, dk]
    qg, kg, kinv = q * cum.exp(), k * cum.exp(), k * (-cum).exp()
    kend = k * (last - cum).exp()
    ones = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device)
    strict, incl = ones.tril(-1), ones.tril()
    lower = (kg @ kinv.transpose(-1, -2)) * beta * strict
    scores = (qg @ kinv.transpose(-1, -2)) * incl
    solved = unit_lower_inverse(lower) @ torch.cat([beta * v, beta * kg], -1)
    u0, w = solved.split([dv, dk], dim=-1)
    # S_{n+1} = A_n S_n + B_n with A_n = diag(e^{G_last}) - kend^T W, B_n = kend^T U0
    a = torch.diag_embed(last.squeeze(-2).exp()) - kend.transpose(-1, -2) @ w  # [B, H, N, dk, dk]
    b = kend.transpose(-1, -2) @ u0  # [B, H, N, dk, dv]
    offset = 1
    while offset < n:  # inclusive scan: b[n] becomes the state after chunk n
        b = torch.cat([b[:, :, :offset], a[:, :, offset:] @ b[:, :, :-offset] + b[:, :, offset:]], 2)
        a = torch.cat([a[:, :, :offset], a[:, :, offset:] @ a[:, :, :-offset]], 2)
        offset *= 2
    states = torch.cat([torch.zeros_like(b[:, :, :1]), b[:, :, :-1]], 2)  # state before each chunk
    u = u0 - w @ states
    o = qg @ states + scores @ u  # [B, H, N, C, dv]
    return o.permute(0, 2, 3, 1, 4).reshape(bsz, n * chunk, heads, dv)[:, :length]


class KimiDeltaAttention(nn.Module):
    def __init__(self, c: TinyConfig) -> None:
        super().__init__()
        h, self.heads, self.dim = c.hidden_size, c.num_attention_heads, c.linear_head_dim
        d = self.heads * self.dim
        self.lower_bound = c.kda_lower_bound
        self.q_proj, self.k_proj, self.v_proj = linear(h, d), linear(h, d), linear(h, d)
        self.q_conv1d = ConvWeight(d, c.conv_kernel_size)
        self.k_conv1d = ConvWeight(d, c.conv_kernel_size)
        self.v_conv1d = ConvWeight(d, c.conv_kernel_size)
        self.A_log = nn.Parameter(torch.empty(self.heads))
        self.dt_bias = nn.Parameter(torch.empty(d))
        self.f_proj, self.b_proj, self.g_proj = linear(h, d), linear(h, self.heads), linear(h, d)
        self.o_norm = RMSNorm(self.dim, c.rms_norm_eps)
        self.dense = linear(d, h)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        bsz, length, _ = x.shape
        shape = (bsz, length, self.heads, self.dim)
        convs = (self.q_conv1d, self.k_conv1d, self.v_conv1d)
        qkv = torch.cat([self.q_proj(x), self.k_proj(x), self.v_proj(x)], -1).transpose(1, 2)
        weight = torch.cat([c.weight for c in convs]).to(qkv.dtype)
        kernel = weight.shape[-1]
        qkv = F.silu(F.conv1d(F.pad(qkv, (kernel - 1, 0)), weight, groups=weight.shape[0]))
        q, k, v = qkv.transpose(1, 2).float().chunk(3, dim=-1)
        with torch.autocast(x.device.type, enabled=False):
            q = l2norm(q.reshape(shape)) * self.dim**-0.5
            k = l2norm(k.reshape(shape))
            gate_in = self.f_proj(x).float().view(shape) + self.dt_bias.float().view(self.heads, self.dim)
            g = self.lower_bound * torch.sigmoid(self.A_log.float().exp()[:, None] * gate_in)
            beta = torch.sigmoid(self.b_proj(x).float())
            o = kda_chunked(q, k, v.reshape(shape), g, beta)
            o = self.o_norm(o) * torch.sigmoid(self.g_proj(x).float().view(shape))
        return self.dense(o.to(x.dtype).reshape(bsz, length, -1))


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Interleaved RoPE on x [B, h, T, d]; cos/sin [T, d/2]; output de-interleaved (as solo)."""
    even, odd = x[..., 0::2], x[..., 1::2]
    return torch.cat([even * cos - odd * sin, odd * cos + even * sin], dim=-1)


class MultiLatentAttention(nn.Module):
    def __init__(self, c: TinyConfig) -> None:
        super().__init__()
        h, self.heads = c.hidden_size, c.num_attention_heads
        self.nope, self.rope, self.vdim, self.rank = (
            c.qk_nope_head_dim,
            c.qk_rope_head_dim,
            c.v_head_dim,
            c.kv_lora_rank,
        )
        self.q_proj = linear(h, self.heads * (self.nope + self.rope))
        self.kv_a_proj_with_mqa = linear(h, self.rank + self.rope)
        self.kv_a_layernorm = RMSNorm(self.rank, c.rms_norm_eps)
        self.kv_b_proj = linear(self.rank, self.heads * (self.nope + self.vdim))
        self.g_proj = linear(h, self.heads)
        self.dense = linear(self.heads * self.vdim, h)
        self.scale = (self.nope + self.rope) ** -0.5

    def qkv(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [B, T, H] -> q, k [B, h, T, nope+rope], v [B, h, T, v]."""
        bsz, length, _ = x.shape
        q = self.q_proj(x).view(bsz, length, self.heads, -1).transpose(1, 2)
        q = torch.cat([q[..., : self.nope], rotate(q[..., self.nope :], cos, sin)], -1)
        latent, k_rope = self.kv_a_proj_with_mqa(x).split([self.rank, self.rope], -1)
        kv = self.kv_b_proj(self.kv_a_layernorm(latent)).view(bsz, length, self.heads, -1).transpose(1, 2)
        k_rope = rotate(k_rope[:, None], cos, sin).expand(-1, self.heads, -1, -1)
        k = torch.cat([kv[..., : self.nope], k_rope], -1)
        return q, k, kv[..., self.nope :]

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        sink: bool = False,
        prefix: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        """Causal attention; `sink`: position 0 has a zero key and value (the unwritten NEXTN slot);
        `prefix` (k, v of step-1 NEXTN slots): attend those strictly before each query, plus itself."""
        bsz, length, _ = x.shape
        q, k, v = self.qkv(x, cos, sin)
        if sink:
            keep = torch.ones(length, 1, device=x.device, dtype=k.dtype)
            keep[0] = 0
            k, v = k * keep, v * keep
        if prefix is None:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.scale)
        else:
            pos = torch.arange(length, device=x.device)
            mask = torch.cat([pos[None, :] < pos[:, None], pos[None, :] == pos[:, None]], 1)
            out = F.scaled_dot_product_attention(
                q,
                torch.cat([prefix[0], k], 2),
                torch.cat([prefix[1], v], 2),
                attn_mask=mask,
                scale=self.scale,
            )
        gate = torch.sigmoid(self.g_proj(x).float()).to(out.dtype).transpose(1, 2)[..., None]
        out = (out * gate).transpose(1, 2).reshape(bsz, length, -1)
        return self.dense(out), (k, v)


class SwiGLU(nn.Module):
    def __init__(self, hidden: int, inter: int) -> None:
        super().__init__()
        self.gate_proj, self.up_proj, self.down_proj = (
            linear(hidden, inter),
            linear(hidden, inter),
            linear(inter, hidden),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Router(nn.Module):
    def __init__(self, c: TinyConfig) -> None:
        super().__init__()
        self.c = c
        self.weight = nn.Parameter(torch.empty(c.num_experts, c.hidden_size))
        self.register_buffer("expert_bias", torch.zeros(c.num_experts))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [N, H] -> dense routing weights [N, E] (zero for unselected experts), fp32."""
        c = self.c
        with torch.autocast(x.device.type, enabled=False):
            scores = torch.sigmoid(F.linear(x.float(), self.weight.float()))
        biased = scores.detach() + self.expert_bias
        if c.n_group > 1 and c.topk_group < c.n_group:
            grouped = biased.view(-1, c.n_group, c.num_experts // c.n_group)
            kept = grouped.topk(2, dim=-1).values.sum(-1).topk(c.topk_group, dim=-1).indices
            group_mask = torch.zeros(grouped.shape[:2], dtype=torch.bool, device=x.device).scatter_(1, kept, True)
            biased = grouped.masked_fill(~group_mask[..., None], float("-inf")).flatten(1)
        ids = biased.topk(c.num_experts_per_tok, dim=-1).indices
        weights = scores.gather(1, ids)
        weights = weights / (weights.sum(-1, keepdim=True) + 1e-20) * c.routed_scaling_factor
        return torch.zeros_like(scores).scatter(1, ids, weights)


class Experts(nn.Module):
    """Routed experts as [E, I, H] / [E, H, I] stacks, evaluated as one weighted SwiGLU of width E*I."""

    def __init__(self, c: TinyConfig) -> None:
        super().__init__()
        e, h, i = c.num_experts, c.hidden_size, c.moe_intermediate_size
        self.gate_proj = nn.Parameter(torch.empty(e, i, h))
        self.up_proj = nn.Parameter(torch.empty(e, i, h))
        self.down_proj = nn.Parameter(torch.empty(e, h, i))

    def forward(self, x: torch.Tensor, routing: torch.Tensor) -> torch.Tensor:
        e, i, h = self.gate_proj.shape
        act = F.silu(F.linear(x, self.gate_proj.reshape(e * i, h))) * F.linear(x, self.up_proj.reshape(e * i, h))
        act = act * routing.to(act.dtype).repeat_interleave(i, dim=1)
        return F.linear(act, self.down_proj.permute(1, 0, 2).reshape(h, e * i))


class SparseMoE(nn.Module):
    def __init__(self, c: TinyConfig) -> None:
        super().__init__()
        self.gate = Router(c)
        self.experts = Experts(c)
        self.shared_experts = SwiGLU(c.hidden_size, c.moe_intermediate_size * c.n_shared_experts)
        self.register_buffer("load", torch.zeros(c.num_experts), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        routing = self.gate(flat)
        if self.training:
            self.load += (routing > 0).sum(0).float()
        return (self.experts(flat, routing) + self.shared_experts(flat)).view_as(x)


class DecoderLayer(nn.Module):
    def __init__(self, c: TinyConfig, layer: int, dropout: float) -> None:
        super().__init__()
        self.is_mla = c.is_mla(layer)
        self.attention: nn.Module = MultiLatentAttention(c) if self.is_mla else KimiDeltaAttention(c)
        self.mlp: nn.Module = SparseMoE(c) if c.is_moe(layer) else SwiGLU(c.hidden_size, c.intermediate_size)
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.dropout = nn.Dropout(dropout)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, **attn: Any
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor] | None]:
        h = self.attention(self.input_layernorm(x), cos, sin, **attn)
        kv = None
        if isinstance(h, tuple):
            h, kv = h
        x = x + self.dropout(h)
        x = x + self.dropout(self.mlp(self.post_attention_layernorm(x)))
        return x, kv


class NextNLayer(DecoderLayer):
    def __init__(self, c: TinyConfig, dropout: float) -> None:
        super().__init__(c, c.num_hidden_layers, dropout)
        h = c.hidden_size
        self.enorm, self.hnorm = RMSNorm(h, c.rms_norm_eps), RMSNorm(h, c.rms_norm_eps)
        self.eh_proj = linear(2 * h, h)
        self.final_layernorm = RMSNorm(h, c.rms_norm_eps)


class Backbone(nn.Module):
    def __init__(self, c: TinyConfig, dropout: float) -> None:
        super().__init__()
        self.word_embeddings = nn.Embedding(c.vocab_size, c.hidden_size)
        layers: list[nn.Module] = [DecoderLayer(c, i, dropout) for i in range(c.num_hidden_layers)]
        self.layers = nn.ModuleList([*layers, NextNLayer(c, dropout)])
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)


class TrainModel(nn.Module):
    """The batched training twin of solo.model.ling.LingForCausalLM (same tensor names)."""

    def __init__(self, c: TinyConfig, dropout: float = 0.0) -> None:
        super().__init__()
        self.config = c
        self.model = Backbone(c, dropout)
        self.lm_head = linear(c.hidden_size, c.vocab_size)
        inv = 1.0 / c.rope_theta ** (torch.arange(0, c.qk_rope_head_dim, 2).float() / c.qk_rope_head_dim)
        self.register_buffer("inv_freq", inv, persistent=False)

    @property
    def nextn(self) -> NextNLayer:
        layer = self.model.layers[self.config.num_hidden_layers]
        assert isinstance(layer, NextNLayer)
        return layer

    def moe_layers(self) -> list[SparseMoE]:
        return [m for m in self.modules() if isinstance(m, SparseMoE)]

    def rope(self, length: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        angles = torch.arange(length, device=self.inv_freq.device).float()[:, None] * self.inv_freq[None]
        return angles.cos().to(dtype), angles.sin().to(dtype)

    def hidden(self, ids: torch.Tensor) -> torch.Tensor:
        """ids [B, T] -> final-norm hidden states [B, T, H] (what feeds the LM head)."""
        x = self.model.word_embeddings(ids)
        cos, sin = self.rope(ids.shape[1], _compute_dtype(x))
        for layer in self.model.layers[: self.config.num_hidden_layers]:
            x, _ = layer(x, cos, sin)
        return self.model.norm(x)

    def drafts(self, ids: torch.Tensor, hidden: torch.Tensor, steps: int) -> list[torch.Tensor]:
        """NEXTN outputs (final_layernorm) for `steps` chained steps; entry k-1 at slot p predicts
        ids[p+1] from ids[p] and the step-(k-1) hidden at p-1 (the target's for k = 1)."""
        nextn = self.nextn
        emb = nextn.enorm(self.model.word_embeddings(ids))
        cos, sin = self.rope(ids.shape[1], _compute_dtype(emb))
        out, prev, prefix = [], hidden, None
        for step in range(steps):
            shifted = F.pad(prev[:, :-1], (0, 0, 1, 0))
            x = nextn.eh_proj(torch.cat([emb, nextn.hnorm(shifted)], -1)).float()
            if step == 0:
                x, prefix = nextn(x, cos, sin, sink=True)
            else:
                x, _ = nextn(x, cos, sin, prefix=prefix)
            prev = nextn.final_layernorm(x)
            out.append(prev)
        return out

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype matmuls produce here: the autocast dtype when autocast is on, else x's."""
    kind = x.device.type
    return torch.get_autocast_dtype(kind) if torch.is_autocast_enabled(kind) else x.dtype


def init_weights(model: TrainModel, seed: int) -> None:
    """GPT-style init: N(0, 0.02), output projections scaled by 1/sqrt(2 L); transformers' KDA gate init."""
    gen = torch.Generator().manual_seed(seed)
    depth = 2 * (model.config.num_hidden_layers + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("A_log"):
                p.copy_(torch.empty(p.shape).uniform_(1.0, 16.0, generator=gen).log())
            elif name.endswith("dt_bias"):
                dt = torch.exp(torch.empty(p.shape).uniform_(math.log(1e-3), math.log(1e-1), generator=gen))
                dt = dt.clamp_min(1e-4)
                p.copy_(dt + torch.log(-torch.expm1(-dt)))
            elif "conv1d" in name:
                p.copy_(torch.empty(p.shape).uniform_(-0.5, 0.5, generator=gen))
            elif p.dim() == 1:
                p.fill_(1.0)
            else:
                std = (
                    0.02 / math.sqrt(depth)
                    if name.endswith(("dense.weight", "down_proj.weight", "down_proj"))
                    else 0.02
                )
                p.copy_(torch.randn(p.shape, generator=gen) * std)


# ============================================================================ export / import


def checkpoint_tensors(model: TrainModel) -> dict[str, torch.Tensor]:
    """The model's tensors under checkpoint names: experts split per expert, BF16 except the small
    precision-sensitive ones (A_log, dt_bias, conv weights, expert_bias), which stay FP32."""
    out: dict[str, torch.Tensor] = {}
    for name, t in model.state_dict().items():
        t = t.detach().cpu()
        if name.endswith(("experts.gate_proj", "experts.up_proj", "experts.down_proj")):
            base, kind = name.rsplit(".", 1)
            for e in range(t.shape[0]):
                out[f"{base}.{e}.{kind}.weight"] = t[e].to(torch.bfloat16).contiguous()
        elif name.endswith(("A_log", "dt_bias", "conv1d.weight", "expert_bias")):
            out[name] = t.float().contiguous()
        else:
            out[name] = t.to(torch.bfloat16).contiguous()
    return out


def export_checkpoint(model: TrainModel, tokenizer_json: Path, out_dir: Path, shard_mb: float = 12.0) -> None:
    """Write config.json, tokenizer.json and safetensors shards (with an index if more than one)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    tensors = checkpoint_tensors(model)
    (out_dir / "config.json").write_text(json.dumps(model.config.to_checkpoint_config(), indent=2) + "\n")
    (out_dir / "tokenizer.json").write_text(Path(tokenizer_json).read_text())
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name in sorted(tensors):
        nbytes = tensors[name].numel() * tensors[name].element_size()
        if shards[-1] and size + nbytes > shard_mb * 2**20:
            shards.append({})
            size = 0
        shards[-1][name] = tensors[name]
        size += nbytes
    if len(shards) == 1:
        save_file(shards[0], str(out_dir / "model.safetensors"), metadata={"format": "pt"})
        return
    weight_map = {}
    for i, shard in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(out_dir / fname), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, fname))
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out_dir / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")


def load_checkpoint(path: str | Path, dtype: torch.dtype = torch.float32) -> TrainModel:
    """Build a TrainModel from an exported (unquantized) checkpoint folder."""
    path = Path(path)
    config = TinyConfig.from_checkpoint_config(json.loads((path / "config.json").read_text()))
    model = TrainModel(config)
    tensors: dict[str, torch.Tensor] = {}
    for shard in sorted(path.glob("*.safetensors")):
        with safe_open(str(shard), "pt") as f:
            for name in f.keys():  # noqa: SIM118
                tensors[name] = f.get_tensor(name)
    state = {}
    for name, ref in model.state_dict().items():
        if name.endswith(("experts.gate_proj", "experts.up_proj", "experts.down_proj")):
            base, kind = name.rsplit(".", 1)
            state[name] = torch.stack([tensors.pop(f"{base}.{e}.{kind}.weight") for e in range(ref.shape[0])])
        else:
            state[name] = tensors.pop(name)
    if tensors:
        raise ValueError(f"{path}: unexpected tensors {sorted(tensors)[:5]}")
    model.load_state_dict({k: v.to(dtype) for k, v in state.items()})
    return model.to(dtype).eval()


def parameter_counts(c: TinyConfig) -> dict[str, int]:
    """Total parameters, and those active per token (top-k routed experts, no NEXTN)."""
    model = TrainModel(c)
    total = sum(p.numel() for p in model.parameters()) + sum(m.gate.expert_bias.numel() for m in model.moe_layers())
    nextn = sum(p.numel() for p in model.nextn.parameters()) + c.num_experts
    per_expert = 3 * c.hidden_size * c.moe_intermediate_size
    moe_trunk = c.num_hidden_layers - c.first_k_dense_replace
    inactive = moe_trunk * (c.num_experts - c.num_experts_per_tok) * per_expert
    return {
        "total": total,
        "nextn": nextn,
        "total_without_nextn": total - nextn,
        "active_per_token": total - nextn - inactive - c.vocab_size * c.hidden_size,  # embedding: one row
    }


# ============================================================================ data


def gsm8k_documents(path: str | Path) -> list[str]:
    """GSM8K jsonl -> documents in the lm-eval shot format."""
    return [f"Question: {r['question']}\nAnswer: {r['answer']}" for r in read_jsonl(path)]


class Packer:
    """Shuffles documents into eos-terminated episodes of 1-8 documents joined by "\\n\\n" and cuts
    the stream into windows of `length` + 1 tokens that start at document starts."""

    def __init__(self, doc_ids: list[list[int]], sep: list[int], eos: int, length: int, seed: int) -> None:
        self.doc_ids, self.sep, self.eos, self.length = doc_ids, sep, eos, length
        self.rng = random.Random(seed)
        self.epoch = 0

    def windows(self) -> list[list[int]]:
        order = list(range(len(self.doc_ids)))
        self.rng.shuffle(order)
        stream: list[int] = []
        starts: list[int] = []
        i = 0
        while i < len(order):
            size = self.rng.randint(1, 8)
            for j, d in enumerate(order[i : i + size]):
                if j:
                    stream += self.sep
                starts.append(len(stream))
                stream += self.doc_ids[d]
            stream.append(self.eos)
            i += size
        out, start = [], 0
        while start + self.length + 1 <= len(stream):
            out.append(stream[start : start + self.length + 1])
            nxt = starts[bisect.bisect_right(starts, start + self.length) - 1]
            if nxt <= start:  # one document longer than the window: skip to the next one
                later = bisect.bisect_right(starts, start)
                if later == len(starts):
                    break
                nxt = starts[later]
            start = nxt
        self.epoch += 1
        return out

    def batches(self, batch: int) -> Iterator[torch.Tensor]:
        while True:
            windows = self.windows()
            self.rng.shuffle(windows)
            for i in range(0, len(windows) - batch + 1, batch):
                yield torch.tensor(windows[i : i + batch])


# ============================================================================ losses / eval


def compute_losses(model: TrainModel, batch: torch.Tensor, mtp_steps: int, distill: float) -> dict[str, torch.Tensor]:
    """LM loss, per-step NEXTN losses (CE to data, mixed with KL to the main model), and the step-1
    top-1 agreement of the NEXTN with the main model's greedy token."""
    ids, targets = batch[:, :-1], batch[:, 1:]
    hidden = model.hidden(ids)
    main_logits = model.logits(hidden)
    vocab = main_logits.shape[-1]
    out = {"lm": F.cross_entropy(main_logits.reshape(-1, vocab), targets.reshape(-1))}
    teacher = main_logits.detach().log_softmax(-1)
    greedy = main_logits.detach().argmax(-1)
    for k, d in enumerate(model.drafts(ids, hidden, mtp_steps), start=1):
        logits = model.logits(d)[:, k:]
        ce = F.cross_entropy(logits.reshape(-1, vocab), targets[:, k:].reshape(-1))
        loss = ce
        if distill > 0:
            kl = F.kl_div(logits.log_softmax(-1), teacher[:, k:], log_target=True, reduction="none").sum(-1)
            loss = (1 - distill) * ce + distill * kl.mean()
        out[f"mtp{k}"] = loss
        out[f"mtp{k}_ce"] = ce.detach()
        out[f"agree{k}"] = (logits.detach().argmax(-1) == greedy[:, k:]).float().mean()
    return out


@torch.no_grad()
def evaluate(model: TrainModel, windows: torch.Tensor, mtp_steps: int, batch: int, device: str) -> dict[str, float]:
    """Mean losses and agreements over held-out windows (eval mode, no dropout)."""
    was = model.training
    model.eval()
    sums: dict[str, float] = {}
    for i in range(0, len(windows), batch):
        chunk = windows[i : i + batch].to(device)
        with autocast(device):
            losses = compute_losses(model, chunk, mtp_steps, distill=0.0)
        for k, v in losses.items():
            sums[k] = sums.get(k, 0.0) + float(v) * len(chunk)
    model.train(was)
    return {k: v / len(windows) for k, v in sums.items()}


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def autocast(device: str) -> torch.autocast:
    return (
        torch.autocast("cuda", dtype=torch.bfloat16)
        if device.startswith("cuda")
        else torch.autocast("cpu", enabled=False)
    )


# ============================================================================ training


@dataclass
class TrainArgs:
    data: str
    out: str
    steps: int = 1200
    seq_len: int = 2048
    batch: int = 16
    lr: float = 2e-3
    min_lr_ratio: float = 0.1
    warmup: int = 100
    weight_decay: float = 0.1
    dropout: float = 0.1
    mtp_steps: int = 3
    mtp_weight: float = 0.5
    distill: float = 0.5
    bias_rate: float = 1e-3
    heldout: int = 374
    eval_every: int = 100
    eval_windows: int = 32
    time_budget: float = 0.0
    device: str = "cpu"
    seed: int = 0
    tokenizer: str | None = None
    vocab_size: int = 2048
    hidden_size: int = 256
    moe_intermediate_size: int = 32
    num_hidden_layers: int = 6


def lr_at(step: int, total: int, a: TrainArgs) -> float:
    if step < a.warmup:
        return a.lr * (step + 1) / a.warmup
    t = min(1.0, (step - a.warmup) / max(1, total - a.warmup))
    return a.lr * (a.min_lr_ratio + (1 - a.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * t)))


def train(a: TrainArgs) -> dict[str, Any]:
    """Train, keep the weights with the lowest held-out objective, export them; returns the log."""
    from tokenizers import Tokenizer

    from solo.training.tokenizer import EOS_TOKEN, save_tokenizer, train_tokenizer

    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(a.seed)
    started = time.time()
    tok_path = out / "tokenizer.json"
    tok = Tokenizer.from_file(a.tokenizer) if a.tokenizer else train_tokenizer(Path(a.data), a.vocab_size)
    save_tokenizer(tok, tok_path)
    eos = tok.token_to_id(EOS_TOKEN)
    docs = gsm8k_documents(a.data)
    train_docs, held_docs = docs[: len(docs) - a.heldout], docs[len(docs) - a.heldout :]
    encode = [e.ids for e in tok.encode_batch(train_docs, add_special_tokens=False)]
    held_ids = [e.ids for e in tok.encode_batch(held_docs, add_special_tokens=False)]
    sep = tok.encode("\n\n", add_special_tokens=False).ids
    packer = Packer(encode, sep, eos, a.seq_len, a.seed)
    held = Packer(held_ids, sep, eos, a.seq_len, a.seed + 1).windows()[: a.eval_windows]
    held_t = torch.tensor(held) if held else torch.empty(0, a.seq_len + 1, dtype=torch.long)

    config = TinyConfig(
        vocab_size=tok.get_vocab_size(),
        eos_token_id=eos,
        hidden_size=a.hidden_size,
        moe_intermediate_size=a.moe_intermediate_size,
        num_hidden_layers=a.num_hidden_layers,
        max_position_embeddings=max(4096, a.seq_len),
    )
    model = TrainModel(config, a.dropout)
    init_weights(model, a.seed)
    model.to(a.device).train()
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2 and "conv1d" not in n]
    no_decay = [p for n, p in model.named_parameters() if not (p.dim() >= 2 and "conv1d" not in n)]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": a.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=a.lr,
        betas=(0.9, 0.95),
        eps=1e-8,
        fused=a.device.startswith("cuda"),
    )
    if a.device.startswith("cuda"):
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True

    log: dict[str, Any] = {
        "args": asdict(a),
        "config": asdict(config),
        "train": [],
        "heldout": [],
        "params": parameter_counts(config),
    }
    batches = packer.batches(a.batch)
    total = a.steps
    best: tuple[float, int, dict[str, torch.Tensor]] | None = None
    train_start = time.time()
    marks: dict[int, float] = {}
    step = 0
    try:
        while step < total:
            for group in opt.param_groups:
                group["lr"] = lr_at(step, total, a)
            batch = next(batches).to(a.device)
            with autocast(a.device):
                losses = compute_losses(model, batch, a.mtp_steps, a.distill)
                mtp = sum(losses[f"mtp{k}"] for k in range(1, a.mtp_steps + 1)) / max(1, a.mtp_steps)
                loss = losses["lm"] + a.mtp_weight * mtp
            opt.zero_grad(set_to_none=True)
            loss.backward()
            grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            with torch.no_grad():  # auxiliary-loss-free balancing: raise the bias of under-used experts
                for moe in model.moe_layers():
                    moe.gate.expert_bias += a.bias_rate * torch.sign(moe.load.mean() - moe.load)
                    moe.load.zero_()
            step += 1
            if a.time_budget and step in (10, 20):  # size the run to the budget from steps 10-20
                _sync(a.device)
                marks[step] = time.time()
                if step == 20:
                    per_step = (marks[20] - marks[10]) / 10
                    left = a.time_budget - (marks[20] - started)
                    total = min(a.steps, step + max(1, int(left / (per_step * 1.04))))  # 4%: evals
                    log["planned_steps"] = total
                    print(f"{per_step * 1000:.0f} ms/step -> {total} steps", flush=True)
            if a.time_budget and time.time() - started > 1.1 * a.time_budget:  # estimate was off: stop
                total = step
            if step % 10 == 0 or step == total:
                row = {
                    "step": step,
                    "time_s": round(time.time() - train_start, 1),
                    "lr": lr_at(step - 1, total, a),
                    "loss": float(loss.detach()),
                    "grad_norm": float(grad_norm),
                    "epoch": packer.epoch,
                    **{k: round(float(v.detach()), 4) for k, v in losses.items()},
                }
                log["train"].append(row)
            if (step % a.eval_every == 0 or step == total) and len(held_t):
                ev = evaluate(model, held_t, a.mtp_steps, a.batch, a.device)
                objective = ev["lm"] + a.mtp_weight * sum(ev[f"mtp{k}"] for k in range(1, a.mtp_steps + 1)) / max(
                    1, a.mtp_steps
                )
                ev = {"step": step, "objective": objective, **ev}
                log["heldout"].append({k: round(v, 4) if isinstance(v, float) else v for k, v in ev.items()})
                print(json.dumps(log["heldout"][-1]), flush=True)
                if best is None or objective < best[0]:
                    best = (objective, step, {k: v.detach().cpu().clone() for k, v in model.state_dict().items()})
    except Exception as e:  # keep what was learned: export the best weights so far, then re-raise
        log["error"] = repr(e)
        print(f"training stopped at step {step}: {e!r}", flush=True)
    log["steps"] = step
    log["train_time_s"] = round(time.time() - train_start, 1)
    log["tokens_seen"] = step * a.batch * a.seq_len
    log["epochs"] = packer.epoch
    if best is not None:
        model.load_state_dict(best[2])
        log["best_step"] = best[1]
    model.cpu().eval()
    export_checkpoint(model, tok_path, out)
    log["total_time_s"] = round(time.time() - started, 1)
    (out / "training_log.json").write_text(json.dumps(log, indent=1) + "\n")
    if "error" in log:
        raise RuntimeError(f"training failed after {step} steps (best weights exported): {log['error']}")
    return log


# ============================================================================ measurement (CPU)


@torch.no_grad()
def heldout_agreement(
    ckpt: str | Path,
    data: str | Path,
    heldout: int = 374,
    seq_len: int = 2048,
    windows: int = 8,
    steps: int = 3,
) -> dict[str, float]:
    """Teacher-forced on held-out GSM8K text (exported weights, fp32, CPU): losses and the NEXTN
    step-k top-1 agreement with the main model's greedy token at the same position."""
    from tokenizers import Tokenizer

    model = load_checkpoint(ckpt)
    tok = Tokenizer.from_file(str(Path(ckpt) / "tokenizer.json"))
    docs = gsm8k_documents(data)[-heldout:]
    ids = [e.ids for e in tok.encode_batch(docs, add_special_tokens=False)]
    sep = tok.encode("\n\n", add_special_tokens=False).ids
    held = Packer(ids, sep, model.config.eos_token_id, seq_len, 1).windows()[:windows]
    return evaluate(model, torch.tensor(held), steps, 2, "cpu")


@torch.no_grad()
def accept_length(
    ckpt: str | Path, prompts: Sequence[str], max_new: int = 200, steps: int = 3, stop: str = "Question:"
) -> dict[str, Any]:
    """Greedy speculative decoding simulated with solo's own model: the target's greedy text is
    generated first; then, round by round, the NEXTN drafts `steps` chained tokens from the last
    accepted state (its slots rewritten with the target's hidden states) and the drafts that match
    the greedy text are accepted. Same result as verify-and-accept greedy decoding."""
    from solo.checkpoint.loader import LoadOptions, load_model
    from solo.model.cache import HybridCache
    from solo.tokenizer import Tokenizer as SoloTokenizer

    model = load_model(ckpt, LoadOptions(lm_head="fp32"))
    tok = SoloTokenizer.from_dir(ckpt, model.config.eos_token_id)
    rounds = accepted = 0
    per_pos = [0] * steps
    texts = []
    for prompt in prompts:
        ids = tok.encode(prompt)
        n0 = len(ids)
        cache = HybridCache(model.config, n0 + max_new + steps + 2, "cpu", torch.float32, with_nextn=True)
        hidden = [model(torch.tensor(ids), torch.arange(n0), cache)]
        seq = ids + [int(model.logits(hidden[0][-1:]).argmax())]
        while len(seq) - n0 < max_new and seq[-1] not in tok.eos_ids:
            h = model(torch.tensor(seq[-1:]), torch.tensor([len(seq) - 1]), cache)
            hidden.append(h)
            seq.append(int(model.logits(h).argmax()))
            if stop in tok.decode(seq[n0:]):
                break
        hs = torch.cat(hidden)  # hs[j]: target hidden at position j (predicts seq[j + 1])
        end = len(seq) - 1
        texts.append(tok.decode(seq[n0:]))
        written = 0  # NEXTN slots 1..written hold the target's (token, hidden) inputs
        n = n0  # the target has just produced seq[n]; draft from slot n
        while n < end:
            if written < n:
                pos = torch.arange(written + 1, n + 1)
                model.draft_forward(torch.tensor(seq[written + 1 : n + 1]), hs[written:n], pos, cache)
            prev = hs[n - 1 : n]
            token = seq[n]
            got = 0
            for k in range(steps):
                d = model.draft_forward(torch.tensor([token]), prev, torch.tensor([n + k]), cache)
                token = int(model.logits(d).argmax())
                if n + k + 1 > end or token != seq[n + k + 1]:
                    break
                got += 1
                per_pos[k] += 1
                prev = d
            written = n  # slots after n now hold draft inputs; rewritten next round
            rounds += 1
            accepted += got
            n += got + 1
    return {
        "rounds": rounds,
        "accepted": accepted,
        "accept_length": 1 + accepted / max(1, rounds),
        "per_position_acceptance": [p / max(1, rounds) for p in per_pos],
        "completions": texts,
    }


def measure(ckpt: str, data: str, test: str | None, prompts: int) -> dict[str, Any]:
    quantized = json.loads((Path(ckpt) / "config.json").read_text()).get("quantization_config")
    result: dict[str, Any] = {}
    if not quantized:  # the training model reads unquantized exports only
        result["heldout"] = heldout_agreement(ckpt, data)
    if test:
        from solo.bench.gsm8k import build_fewshot_prompt, load_gsm8k

        train_ex, test_ex = load_gsm8k(data), load_gsm8k(test)
        ps = [build_fewshot_prompt(test_ex[i].question, train_ex, index=i) for i in range(prompts)]
        result["speculative"] = accept_length(ckpt, ps)
        result["targets"] = [test_ex[i].target for i in range(prompts)]
    return result


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m solo.training.train", description=__doc__.split("\n")[0])
    p.add_argument("--data", default=str(gsm8k_file("train")), help="GSM8K train.jsonl[.gz] (default: packaged)")
    p.add_argument("--out", help="output folder (checkpoint, tokenizer, training_log.json)")
    p.add_argument("--measure", metavar="CKPT", help="evaluate an exported checkpoint instead of training")
    p.add_argument("--test-data", help="GSM8K test.jsonl[.gz] (for --measure: accept length on 5-shot prompts)")
    p.add_argument("--prompts", type=int, default=3)
    for f in fields(TrainArgs):
        if f.name in ("data", "out"):
            continue
        kind = type(f.default) if f.default is not None else str
        p.add_argument("--" + f.name.replace("_", "-"), type=kind, default=f.default)
    args = p.parse_args(argv)
    if args.measure:
        print(json.dumps(measure(args.measure, args.data, args.test_data, args.prompts), indent=1))
        return 0
    if not args.out:
        p.error("--out is required for training")
    values = {f.name: getattr(args, f.name) for f in fields(TrainArgs)}
    log = train(TrainArgs(**values))
    print(json.dumps({k: log[k] for k in ("steps", "train_time_s", "total_time_s", "best_step", "epochs") if k in log}))
    print(json.dumps(log["heldout"][-1] if log["heldout"] else {}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

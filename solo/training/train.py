"""Train the bundled tiny Ling-3.0 model (KDA + MLA, grouped MoE, NEXTN) on GSM8K train.

The training model is solo.model's own (solo.model.ling.LingBackbone: the same KDA, MLA, norm,
router, SwiGLU and rotary modules, so the same tensor names and formulas), run batched ([B, T, H])
and differentiably from a zero state; the export is (almost) its state dict. It computes exactly
what solo's batch-1 inference model computes:

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
from solo.config import LingConfig
from solo.kernels.moe import swiglu
from solo.model.kda import KimiDeltaAttention, kda_chunked_scan
from solo.model.layers import Linear, RotaryEmbedding
from solo.model.ling import DecoderLayer, LingBackbone, NextNLayer
from solo.model.mla import MultiLatentAttention
from solo.model.moe import Router, SwiGLUMLP

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

    def ling_config(self) -> LingConfig:
        """The config solo reads from the export (what builds the model's modules)."""
        return LingConfig.from_dict(self.to_checkpoint_config())

    @classmethod
    def from_checkpoint_config(cls, raw: dict[str, Any]) -> TinyConfig:
        """Read back a config.json written by `to_checkpoint_config` (either spelling)."""
        c = LingConfig.from_dict(raw)
        values = {f.name: getattr(c, f.name) for f in fields(cls) if f.name not in ("eos_token_id",)}
        values["linear_head_dim"] = c.linear_head_dim
        values["eos_token_id"] = c.eos_token_id[0] if c.eos_token_id else 3
        return cls(**values)


# ============================================================================ model
#
# The layers are solo.model's own modules (solo.model.ling.LingBackbone: KDA, MLA, RMSNorm, SwiGLU,
# router, rotary), so the parameters, their names and every formula are the inference model's. What
# follows is what only training needs: batched, differentiable forwards of those modules from a zero
# state, the routed experts as one dense-equivalent SwiGLU, residual dropout and the unrolled NEXTN.


def kda_forward(attn: KimiDeltaAttention, x: torch.Tensor) -> torch.Tensor:
    """solo's KDA layer on a batch x [B, T, H] from a zero state. Training-specific: the short conv is
    one padded conv1d (differentiable in its weights, no conv state) and the delta rule the parallel
    chunk form (solo.model.kda.kda_chunked_scan); gates, delta rule and output norm run in fp32."""
    qkv = attn.qkv(x).transpose(1, 2)  # [B, 3D, T]
    weight = torch.cat([c.weight for c in (attn.q_conv1d, attn.k_conv1d, attn.v_conv1d)]).to(qkv.dtype)
    qkv = F.silu(F.conv1d(F.pad(qkv, (attn.kernel_size - 1, 0)), weight, groups=weight.shape[0]))
    with torch.autocast(x.device.type, enabled=False):
        q, k, v, g, beta = attn.delta_inputs(qkv.transpose(1, 2).float(), x)
        o = attn.gated_norm(kda_chunked_scan(q, k, v, g, beta), x)
    return attn.dense(o.to(x.dtype))


def mla_forward(
    attn: MultiLatentAttention,
    x: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    sink: bool = False,
    prefix: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
    """solo's MLA layer on a batch x [B, T, H], causal. Training-specific: keys and values expanded
    per head (kv_b_proj applied, not absorbed) for one SDPA call; `sink`: position 0 has a zero key
    and value (the unwritten NEXTN slot); `prefix` (k, v of step-1 NEXTN slots): attend those strictly
    before each query, plus itself. Returns the output and this call's (k, v) [B, h, T, *]."""
    bsz, length, _ = x.shape
    q_nope, q_rope, latent, k_rope = attn.project(x, cos, sin)
    q = torch.cat([q_nope.transpose(1, 2), q_rope.transpose(1, 2)], -1)  # [B, h, T, nope+rope]
    kv = attn.kv_b_proj(latent).view(bsz, length, attn.num_heads, -1).transpose(1, 2)
    k = torch.cat([kv[..., : attn.nope_dim], k_rope[:, None].expand(-1, attn.num_heads, -1, -1)], -1)
    v = kv[..., attn.nope_dim :]
    if sink:
        keep = torch.ones(length, 1, device=x.device, dtype=k.dtype)
        keep[0] = 0
        k, v = k * keep, v * keep
    if prefix is None:
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=attn.scale)
    else:
        pos = torch.arange(length, device=x.device)
        mask = torch.cat([pos[None, :] < pos[:, None], pos[None, :] == pos[:, None]], 1)
        k_all, v_all = torch.cat([prefix[0], k], 2), torch.cat([prefix[1], v], 2)
        out = F.scaled_dot_product_attention(q, k_all, v_all, attn_mask=mask, scale=attn.scale)
    gate = torch.sigmoid(attn.g_proj(x).float()).to(out.dtype).transpose(1, 2)[..., None]
    out = (out * gate).transpose(1, 2).reshape(bsz, length, -1)
    return attn.dense(out), (k, v)


class Experts(nn.Module):
    """Routed experts as [E, I, H] / [E, H, I] stacks, evaluated as one SwiGLU of width E*I whose
    units are weighted by the dense routing weights (zero for unselected experts): equal to the
    sparse sum, and training-specific because every expert keeps its gradient path."""

    def __init__(self, c: LingConfig) -> None:
        super().__init__()
        e, h, i = c.num_experts, c.hidden_size, c.moe_intermediate_size
        self.gate_proj = nn.Parameter(torch.empty(e, i, h))
        self.up_proj = nn.Parameter(torch.empty(e, i, h))
        self.down_proj = nn.Parameter(torch.empty(e, h, i))

    def forward(self, x: torch.Tensor, routing: torch.Tensor) -> torch.Tensor:
        e, i, h = self.gate_proj.shape
        act = swiglu(F.linear(x, self.gate_proj.reshape(e * i, h)), F.linear(x, self.up_proj.reshape(e * i, h)), None)
        act = act * routing.to(act.dtype).repeat_interleave(i, dim=1)
        return F.linear(act, self.down_proj.permute(1, 0, 2).reshape(h, e * i))


class SparseMoE(nn.Module):
    """solo's router (fp32 scores) and shared expert around the dense-equivalent `Experts`; counts
    each expert's tokens in training (for the auxiliary-loss-free balancing of `expert_bias`)."""

    def __init__(self, c: LingConfig) -> None:
        super().__init__()
        self.gate = Router(c)
        self.experts = Experts(c)
        self.shared_experts = SwiGLUMLP(c.hidden_size, c.moe_intermediate_size * c.n_shared_experts)
        self.register_buffer("load", torch.zeros(c.num_experts), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        with torch.autocast(x.device.type, enabled=False):
            weights, ids = self.gate(flat)
        routing = torch.zeros(flat.shape[0], self.gate.num_experts, device=x.device, dtype=weights.dtype)
        routing = routing.scatter(1, ids, weights)
        if self.training:
            self.load += (routing > 0).sum(0).float()
        return (self.experts(flat, routing) + self.shared_experts(flat)).view_as(x)


class TrainModel(nn.Module):
    """solo.model's Ling backbone and LM head (same modules, same tensor names), trained batched."""

    def __init__(self, c: TinyConfig, dropout: float = 0.0) -> None:
        super().__init__()
        self.config = c
        ling = c.ling_config()
        self.model = LingBackbone(ling)
        for layer in self.model.layers:
            if ling.is_moe(layer.layer):
                layer.mlp = SparseMoE(ling)  # in place: the parameter order stays the checkpoint's
        self.lm_head = Linear(c.hidden_size, c.vocab_size)
        self.rotary = RotaryEmbedding(ling)
        self.dropout = nn.Dropout(dropout)  # on each residual branch
        for name, p in self.named_parameters():  # solo's modules are frozen; expert_bias is not learned
            p.requires_grad_(not name.endswith("expert_bias"))

    @property
    def nextn(self) -> NextNLayer:
        layer = self.model.layers[self.config.num_hidden_layers]
        assert isinstance(layer, NextNLayer)
        return layer

    def moe_layers(self) -> list[SparseMoE]:
        return [m for m in self.modules() if isinstance(m, SparseMoE)]

    def rope(self, length: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        return self.rotary.cos_sin(torch.arange(length, device=self.rotary.inv_freq.device), dtype)

    def block(
        self, layer: DecoderLayer, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, **attn: Any
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor] | None]:
        """One decoder layer on [B, T, H], with residual dropout; returns its MLA (k, v), if any."""
        h, kv = layer.input_layernorm(x), None
        if layer.is_mla:
            h, kv = mla_forward(layer.attention, h, cos, sin, **attn)
        else:
            h = kda_forward(layer.attention, h)
        x = x + self.dropout(h)
        return x + self.dropout(layer.mlp(layer.post_attention_layernorm(x))), kv

    def hidden(self, ids: torch.Tensor) -> torch.Tensor:
        """ids [B, T] -> final-norm hidden states [B, T, H] (what feeds the LM head)."""
        x = self.model.word_embeddings(ids)
        cos, sin = self.rope(ids.shape[1], _compute_dtype(x))
        for layer in self.model.layers[: self.config.num_hidden_layers]:
            x, _ = self.block(layer, x, cos, sin)
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
                x, prefix = self.block(nextn, x, cos, sin, sink=True)
            else:
                x, _ = self.block(nextn, x, cos, sin, prefix=prefix)
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
    """GPT-style init: N(0, 0.02), output projections scaled by 1/sqrt(2 L); transformers' KDA gate init.
    Training-only (solo loads weights, it never initialises them)."""
    gen = torch.Generator().manual_seed(seed)
    depth = 2 * (model.config.num_hidden_layers + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if not p.requires_grad:  # expert_bias: starts at zero
                continue
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
    total = sum(p.numel() for p in model.parameters())  # with each router's expert_bias
    nextn = sum(p.numel() for p in model.nextn.parameters())
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
    params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    decay = [p for n, p in params if p.dim() >= 2 and "conv1d" not in n]
    no_decay = [p for n, p in params if not (p.dim() >= 2 and "conv1d" not in n)]
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
    # dropout draws from here on, whatever building the modules drew: on a GPU (the bundled run) the
    # CUDA generator was untouched anyway, so this changes nothing there
    torch.manual_seed(a.seed)
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

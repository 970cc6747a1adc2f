"""The Ling-3.0 hybrid decoder (KDA + MLA layers, MoE MLPs) and its NEXTN draft layer.

Batch size is always 1, so activations are [T, hidden] with no batch dimension. Module names
mirror the checkpoint's tensor names (`model.word_embeddings`, `model.layers.N.attention...`),
so loading is a name-for-name assignment.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from solo.config import LingConfig
from solo.distributed.parallel import TensorParallel
from solo.distributed.sharding import ShardPlan
from solo.model.cache import HybridCache, KDAHistory
from solo.model.kda import KimiDeltaAttention
from solo.model.layers import Linear, RMSNorm, RotaryEmbedding
from solo.model.mla import MultiLatentAttention
from solo.model.moe import SparseMoE, SwiGLUMLP
from solo.quantization.lm_head import head_logits

PREFILL_CHUNK = 2048


class DecoderLayer(nn.Module):
    """Attention and MLP with residuals. Under tensor parallelism each holds this rank's shard
    (solo.distributed.sharding) and returns a partial sum: the layer adds the ranks' parts with one
    all-reduce after the attention and one after the MLP (routed and shared experts together)."""

    def __init__(
        self, config: LingConfig, layer: int, tp: TensorParallel | None = None, plan: ShardPlan | None = None
    ) -> None:
        super().__init__()
        plan = plan or ShardPlan()
        self.layer = layer
        self.is_mla = config.is_mla(layer)
        self.tp = tp or TensorParallel.single()
        self.attention: nn.Module = (
            MultiLatentAttention(config, plan.mla_heads(config))
            if self.is_mla
            else KimiDeltaAttention(config, plan.kda_heads(config))
        )
        self.mlp: nn.Module = (
            SparseMoE(config, layer, plan)
            if config.is_moe(layer)
            else SwiGLUMLP(config.hidden_size, plan.dense_intermediate(config))
        )
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self,
        x: torch.Tensor,
        positions: torch.Tensor,
        cos_sin: tuple[torch.Tensor, torch.Tensor],
        cache: HybridCache,
        kda_history: dict[int, KDAHistory] | None = None,
    ) -> torch.Tensor:
        h = self.input_layernorm(x)
        if self.is_mla:
            h = self.attention(h, positions, cos_sin, cache.mla[self.layer])
        else:
            history = None if kda_history is None else kda_history[self.layer]
            h = self.attention(h, cache.kda[self.layer], history)
        x = x + self.tp.all_reduce(h)
        return x + self.tp.all_reduce(self.mlp(self.post_attention_layernorm(x)))


class NextNLayer(DecoderLayer):
    """The multi-token-prediction layer: x = eh_proj([enorm(embed(token)); hnorm(hidden)]), one
    MLA + MoE decoder block, then final_layernorm. The LM head is the target model's own."""

    def __init__(self, config: LingConfig, tp: TensorParallel | None = None, plan: ShardPlan | None = None) -> None:
        super().__init__(config, config.num_hidden_layers, tp, plan)
        hidden = config.hidden_size
        self.enorm = RMSNorm(hidden, config.rms_norm_eps)
        self.hnorm = RMSNorm(hidden, config.rms_norm_eps)
        self.eh_proj = Linear(2 * hidden, hidden)
        self.final_layernorm = RMSNorm(hidden, config.rms_norm_eps)

    def draft_hidden(
        self,
        token_embeddings: torch.Tensor,
        previous_hidden: torch.Tensor,
        positions: torch.Tensor,
        cos_sin: tuple[torch.Tensor, torch.Tensor],
        cache: HybridCache,
    ) -> torch.Tensor:
        x = self.eh_proj(torch.cat([self.enorm(token_embeddings), self.hnorm(previous_hidden)], dim=-1))
        return self.final_layernorm(super().forward(x, positions, cos_sin, cache))


class LingBackbone(nn.Module):
    def __init__(self, config: LingConfig, tp: TensorParallel | None = None, plan: ShardPlan | None = None) -> None:
        super().__init__()
        self.word_embeddings = nn.Embedding(config.vocab_size, config.hidden_size)  # replicated
        self.word_embeddings.weight.requires_grad_(False)
        layers: list[nn.Module] = [DecoderLayer(config, i, tp, plan) for i in range(config.num_hidden_layers)]
        if config.has_nextn:
            layers.append(NextNLayer(config, tp, plan))
        self.layers = nn.ModuleList(layers)
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class LingForCausalLM(nn.Module):
    """`tp`: the tensor-parallel group this process is a rank of (None: one process); the modules
    then hold the rank's shard (`shard`, solo.distributed.sharding) and the LM head its vocabulary
    rows, gathered into full logits (solo.distributed.layers.VocabParallelHead, installed by the loader)."""

    def __init__(self, config: LingConfig, tp: TensorParallel | None = None) -> None:
        super().__init__()
        self.config = config
        self.tp = tp or TensorParallel.single()
        self.shard = ShardPlan.create(config, self.tp.world, self.tp.rank, self.tp.expert_split)
        self.model = LingBackbone(config, self.tp, self.shard)
        vocab = self.shard.vocab_span(config)
        self.lm_head: nn.Module = Linear(config.hidden_size, vocab[1] - vocab[0])
        self.rotary = RotaryEmbedding(config)
        self.fp8_block_size: tuple[int, int] | None = None  # the checkpoint's FP8 blocks (None: no FP8 layers)
        # block-FP8 layers whose tensor-parallel split cuts their blocks: dequantized at load (solo.checkpoint.shard)
        self.split_dequantized: list[str] = []
        self.fast_path: object | None = None  # the FastPathOptions installed by solo.fastpath.accelerate
        # the fused GPU decode step (solo.fastpath.decode_step), when installed: it serves the token
        # counts it was built for (decode, verification); prefill stays on the layers below
        self.decode_step: Any = None

    @property
    def nextn(self) -> NextNLayer | None:
        if not self.config.has_nextn:
            return None
        layer = self.model.layers[self.config.num_hidden_layers]
        assert isinstance(layer, NextNLayer)
        return layer

    @property
    def dtype(self) -> torch.dtype:
        return self.model.norm.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.model.norm.weight.device

    def finalize(self) -> None:
        """Build derived buffers after the weights are in place (fused conv, absorbed MLA)."""
        self.rotary.inv_freq = self.rotary.inv_freq.to(self.device)
        for layer in self.model.layers:
            attention = layer.attention
            if isinstance(attention, MultiLatentAttention):
                attention.finalize(self.dtype)
            elif isinstance(attention, KimiDeltaAttention):
                attention.finalize()

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.word_embeddings(input_ids)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        cache: HybridCache,
        kda_history: dict[int, KDAHistory] | None = None,
    ) -> torch.Tensor:
        """input_ids, positions [T] -> final-norm hidden states [T, hidden]; updates the cache."""
        if self.decode_step is not None and self.decode_step.serves(input_ids.numel()):
            return self.decode_step.forward(input_ids, positions, cache, kda_history)
        cache.settle_kda()  # the reference KDA layers read kda_recurrent (solo.model.cache)
        x = self.embed(input_ids)
        cos_sin = self.rotary.cos_sin(positions, x.dtype)
        for layer in self.model.layers[: self.config.num_hidden_layers]:
            x = layer(x, positions, cos_sin, cache, kda_history)
        return self.model.norm(x)

    def prefill(self, input_ids: torch.Tensor, cache: HybridCache, chunk: int = PREFILL_CHUNK) -> torch.Tensor:
        """The prompt in chunks of `chunk` tokens (positions 0..T-1): attention scores and KDA
        intra-chunk tensors stay bounded however long the prompt. Returns hidden states [T, hidden]."""
        positions = torch.arange(input_ids.numel(), device=input_ids.device)
        return torch.cat(
            [self(ids, pos, cache) for ids, pos in zip(input_ids.split(chunk), positions.split(chunk), strict=True)]
        )

    def draft_prefill(
        self, input_ids: torch.Tensor, previous_hidden: torch.Tensor, cache: HybridCache, chunk: int = PREFILL_CHUNK
    ) -> torch.Tensor:
        """NEXTN over a prompt: slot j holds token j + 1 and the target's hidden state at j, at
        position j + 1 (`input_ids` are tokens 1..T). Returns the NEXTN hidden states [T, hidden]."""
        positions = torch.arange(1, input_ids.numel() + 1, device=input_ids.device)
        pieces = zip(input_ids.split(chunk), previous_hidden.split(chunk), positions.split(chunk), strict=True)
        return torch.cat([self.draft_forward(ids, h, pos, cache) for ids, h, pos in pieces])

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """LM head in fp32 logits (the head's own arithmetic decides the precision of the product)."""
        return head_logits(self.lm_head, hidden)

    def draft_forward(
        self,
        input_ids: torch.Tensor,
        previous_hidden: torch.Tensor,
        positions: torch.Tensor,
        cache: HybridCache,
    ) -> torch.Tensor:
        """NEXTN: hidden states predicting the token after `input_ids`, from the target's hidden
        state at the previous position. Logits come from `self.logits` (the shared head module)."""
        nextn = self.nextn
        if nextn is None:
            raise RuntimeError("this checkpoint has no NEXTN layer (num_nextn_predict_layers = 0)")
        if self.decode_step is not None and self.decode_step.serves(input_ids.numel()):
            return self.decode_step.draft_forward(input_ids, previous_hidden, positions, cache)
        x = self.embed(input_ids)
        cos_sin = self.rotary.cos_sin(positions, x.dtype)
        return nextn.draft_hidden(x, previous_hidden, positions, cos_sin, cache)

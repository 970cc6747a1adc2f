"""Bytes a decode step must read (and write): the denominator of every bandwidth number solo prints.

For one token at a given context: every dense weight the step multiplies with (as stored: FP8 with
its scales, BF16), the LM head, the routers, the top-k routed experts of each MoE layer (their share
of the layer's expert bytes), the KDA states (read and written) and conv windows, the MLA latent
cache up to the context, and the token's embedding row. Weights shared by the fused step and the
reference modules are counted once (by storage). Speculative verification of T tokens reads the
distinct experts of its T tokens: with random routing, E * (1 - (1 - k/E)^T) of them. Under tensor
parallelism, the bytes of this rank's shard.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

from solo.model.kda import KimiDeltaAttention
from solo.model.ling import LingForCausalLM
from solo.model.moe import Router, SparseMoE

KDA_INPUT_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "f_proj", "g_proj", "b_proj")


@dataclass
class StepTraffic:
    dense_weights: int  # attention, dense MLPs, shared experts, norms of the NEXTN-free trunk, less kda_inputs
    kda_inputs: int  # the KDA layers' q|k|v|f|g|b projections: what a fused KDA front reads beside the states
    lm_head: int
    experts: int  # the routed experts one token (or T tokens) read
    routers: int  # the MoE layers' router weights and biases
    kda_states: int  # recurrent states and conv windows, read and written
    mla_cache: int  # latent + rope cache entries up to the context
    embedding: int

    @property
    def total(self) -> int:
        return sum(asdict(self).values())

    def to_dict(self) -> dict[str, int]:
        return {**asdict(self), "total": self.total}


def _storage_bytes(tensors: list[torch.Tensor]) -> int:
    """Bytes of the storages behind `tensors`, each counted once (views of one buffer share it)."""
    seen: dict[int, int] = {}
    for t in tensors:
        storage = t.untyped_storage()
        seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


def expert_layer_bytes(moe: SparseMoE, config) -> int:
    """Bytes of all routed experts of one layer as the checkpoint stores them (MXFP4 codes and E8M0
    scales; dense experts as loaded): what the kernels read, whatever layout they repack into."""
    source = getattr(moe.experts, "source", None)
    if source is not None:
        return sum(t.nbytes for t in vars(source).values() if isinstance(t, torch.Tensor))
    h, i, e = config.hidden_size, config.moe_intermediate_size, config.num_experts
    return e * 3 * i * h * (1 / 2 + 1 / 32)


def decode_traffic(model: LingForCausalLM, context: int, tokens: int = 1) -> StepTraffic:
    """Bytes of one target forward over `tokens` tokens at `context` positions (see module docstring)."""
    config = model.config
    trunk = model.model.layers[: config.num_hidden_layers]
    k, e = config.num_experts_per_tok, config.num_experts
    share = (1 - (1 - k / e) ** tokens) if e else 0.0  # fraction of a layer's experts the tokens touch
    experts = sum(expert_layer_bytes(m, config) * share for m in trunk.modules() if isinstance(m, SparseMoE))
    folded = {id(t) for m in trunk.modules() if getattr(m, "folded", False) for t in m.parameters(recurse=False)}
    routers = [p for m in trunk.modules() if isinstance(m, Router) for p in m.parameters(recurse=False)]
    apart = folded | {id(p) for p in routers}
    kda_inputs = [
        p
        for m in trunk.modules()
        if isinstance(m, KimiDeltaAttention)
        for name in KDA_INPUT_PROJECTIONS
        for p in getattr(m, name).parameters()
        if p.numel() > 0
    ]
    apart |= {id(p) for p in kda_inputs}
    dense = [p for p in trunk.parameters() if id(p) not in apart and p.numel() > 0]
    dense += [b for name, b in trunk.named_buffers() if name.endswith(("w_uk", "w_uv"))]
    c = config
    kda_layers = len(c.kda_layers)
    heads = c.linear_num_heads // model.tp.world  # a tensor-parallel rank's heads: its bytes
    kda = kda_layers * 2 * 4 * (heads * c.linear_head_dim**2)  # fp32 state, read + write
    kda += kda_layers * 2 * 4 * 3 * heads * c.linear_head_dim * (c.conv_kernel_size - 1)
    per_position = (c.kv_lora_rank + c.qk_rope_head_dim) * model.dtype.itemsize
    return StepTraffic(
        dense_weights=_storage_bytes(dense),
        kda_inputs=_storage_bytes(kda_inputs),
        lm_head=sum(t.nbytes for t in model.lm_head.parameters()),
        experts=int(experts),
        routers=_storage_bytes([p for p in routers if p.numel() > 0]),
        kda_states=kda,
        mla_cache=len(c.mla_layers) * per_position * context,
        embedding=tokens * c.hidden_size * model.dtype.itemsize,
    )

"""Preallocated decode state of the hybrid model: static buffers, updated in place.

KDA layers keep a fixed-size state (an fp32 [heads, d_k, d_v] matrix and the last K-1 inputs of
the q/k/v short convolutions); MLA layers keep a latent cache of kv_lora_rank + rope values per
token, indexed by position. Shapes never change during a request, so a decode or verify step over
these buffers can be captured in a CUDA graph.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from solo.config import LingConfig


@dataclass
class KDAState:
    recurrent: torch.Tensor  # [heads, d_k, d_v] fp32
    conv: torch.Tensor  # [3 * heads * d, K - 1]: last K-1 inputs of the q, k, v convolutions


@dataclass
class KDAHistory:
    """What a KDA layer saw during a verification pass of W tokens, kept to roll back to any prefix."""

    states: torch.Tensor  # [W, heads, d_k, d_v]: the recurrent state after each token
    window: torch.Tensor  # [3 * heads * d, K - 1 + W]: the conv inputs before and during the pass


@dataclass
class MLACache:
    latent: torch.Tensor  # [max_len, kv_lora_rank], normalised compressed kv
    rope: torch.Tensor  # [max_len, qk_rope_head_dim], rotated shared key


class HybridCache:
    def __init__(
        self,
        config: LingConfig,
        max_len: int,
        device: torch.device | str,
        dtype: torch.dtype,
        with_nextn: bool = False,
        tensor_parallel: int = 1,
    ) -> None:
        """`tensor_parallel`: the ranks the KDA heads are split over (each rank's states hold its heads;
        the MLA latent cache is every head's, so it is whole on every rank)."""
        self.max_len = max_len
        self.kda: dict[int, KDAState] = {}
        self.mla: dict[int, MLACache] = {}
        heads, d = config.linear_num_heads // tensor_parallel, config.linear_head_dim
        for layer in config.kda_layers:
            self.kda[layer] = KDAState(
                recurrent=torch.zeros(heads, d, d, dtype=torch.float32, device=device),
                conv=torch.zeros(3 * heads * d, config.conv_kernel_size - 1, dtype=torch.float32, device=device),
            )
        mla_layers = list(config.mla_layers)
        if with_nextn and config.has_nextn:
            mla_layers.append(config.num_hidden_layers)
        for layer in mla_layers:
            self.mla[layer] = MLACache(
                latent=torch.zeros(max_len, config.kv_lora_rank, dtype=dtype, device=device),
                rope=torch.zeros(max_len, config.qk_rope_head_dim, dtype=dtype, device=device),
            )

    def new_history(self, tokens: int) -> dict[int, KDAHistory]:
        return {
            layer: KDAHistory(
                states=torch.zeros(
                    (tokens, *state.recurrent.shape), dtype=torch.float32, device=state.recurrent.device
                ),
                window=torch.zeros(state.conv.shape[0], state.conv.shape[1] + tokens, device=state.conv.device),
            )
            for layer, state in self.kda.items()
        }

    def rollback_kda(self, history: dict[int, KDAHistory], keep: torch.Tensor) -> None:
        """Make each KDA state what it would be had only the first `keep` (a 1-element tensor, >= 1)
        tokens of the verification pass been processed. MLA caches need nothing: entries past the
        kept positions are masked by position and overwritten by the next pass."""
        for layer, state in self.kda.items():
            past = history[layer]
            state.recurrent.copy_(past.states.index_select(0, keep - 1)[0])
            columns = keep + torch.arange(state.conv.shape[1], device=keep.device)
            state.conv.copy_(past.window.index_select(1, columns))

    def reset(self) -> None:
        """Zero every buffer in place (a new request); MLA slots past the position are masked anyway."""
        for state in self.kda.values():
            state.recurrent.zero_()
            state.conv.zero_()
        for cache in self.mla.values():
            cache.latent.zero_()
            cache.rope.zero_()

    def nbytes(self) -> int:
        total = 0
        for state in self.kda.values():
            total += state.recurrent.nbytes + state.conv.nbytes
        for cache in self.mla.values():
            total += cache.latent.nbytes + cache.rope.nbytes
        return total

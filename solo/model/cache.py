"""Preallocated decode state of the hybrid model: static buffers, updated in place.

KDA layers keep a fixed-size state (an fp32 [heads, d_k, d_v] matrix and the last K-1 inputs of
the q/k/v short convolutions); MLA layers keep a latent cache of kv_lora_rank + rope values per
token, indexed by position. Shapes never change during a request, so a decode or verify step over
these buffers can be captured in a CUDA graph.

Speculative verification stores each KDA layer's state after every token of its window (a history),
and the rollback to the accepted prefix copies one of them back: 73 MB of fp32 states at
Ling-3.0-flash shape, about 80 us a round on the H200. A cache made with `verify_window` owns one
history of that window (`verification`) and can roll back lazily instead: `kda_source` (a device
scalar) then says where the recurrent states live, 0 for `kda_recurrent`, s >= 1 for the history's
slot s - 1. The fused KDA kernel follows it (solo.kernels.fused_kda); every other reader settles the
states back first (`settle_kda`, called by the model's reference forward).
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


class KDAHistories(dict[int, KDAHistory]):
    """Every KDA layer's history of one verification pass, by layer: views of two tensors holding all
    layers, so that a rollback is two gathers instead of a few small copies per layer."""

    def __init__(self, layers: list[int], states: torch.Tensor, window: torch.Tensor) -> None:
        super().__init__((layer, KDAHistory(states[i], window[i])) for i, layer in enumerate(layers))
        self.layers = list(layers)
        self.states = states  # [layers, W, heads, d_k, d_v]
        self.window = window  # [layers, 3 * heads * d, K - 1 + W]


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
        verify_window: int | None = None,
    ) -> None:
        """`tensor_parallel`: the ranks the KDA heads are split over (each rank's states hold its heads;
        the MLA latent cache is every head's, so it is whole on every rank). `verify_window`: the tokens
        of a speculative verification pass, for the cache's own history (`verification`), allocated
        here so that every kernel and captured graph sees the same buffers from the start."""
        self.max_len = max_len
        self.kda: dict[int, KDAState] = {}
        self.mla: dict[int, MLACache] = {}
        heads, d = config.linear_num_heads // tensor_parallel, config.linear_head_dim
        self.kda_layers = list(config.kda_layers)
        # every KDA layer's state in one tensor (each layer's KDAState holds views): a rollback after a
        # verification pass is then one gather for all layers
        layers = len(self.kda_layers)
        self.kda_recurrent = torch.zeros(layers, heads, d, d, dtype=torch.float32, device=device)
        self.kda_conv = torch.zeros(
            layers, 3 * heads * d, config.conv_kernel_size - 1, dtype=torch.float32, device=device
        )
        self._conv_offsets = torch.arange(config.conv_kernel_size - 1, device=device)
        for i, layer in enumerate(self.kda_layers):
            self.kda[layer] = KDAState(recurrent=self.kda_recurrent[i], conv=self.kda_conv[i])
        # where the recurrent states live: 0 in kda_recurrent, s >= 1 in verification.states[:, s - 1]
        self.kda_source = torch.zeros(1, dtype=torch.int32, device=device)
        self.verification: KDAHistories | None = self.new_history(verify_window) if verify_window else None
        self.kda_lazy = False  # whether kda_source may be nonzero (set by lazy rollbacks and rounds)
        mla_layers = list(config.mla_layers)
        if with_nextn and config.has_nextn:
            mla_layers.append(config.num_hidden_layers)
        for layer in mla_layers:
            self.mla[layer] = MLACache(
                latent=torch.zeros(max_len, config.kv_lora_rank, dtype=dtype, device=device),
                rope=torch.zeros(max_len, config.qk_rope_head_dim, dtype=dtype, device=device),
            )

    def new_history(self, tokens: int) -> KDAHistories:
        """Room for what a verification pass of `tokens` tokens shows every KDA layer."""
        layers, channels, width = self.kda_conv.shape
        return KDAHistories(
            self.kda_layers,
            torch.zeros(
                (layers, tokens, *self.kda_recurrent.shape[1:]), dtype=torch.float32, device=self.kda_conv.device
            ),
            torch.zeros((layers, channels, width + tokens), dtype=torch.float32, device=self.kda_conv.device),
        )

    def rollback_kda(self, history: dict[int, KDAHistory], keep: torch.Tensor, lazy: bool = False) -> None:
        """Make each KDA state what it would be had only the first `keep` (a 1-element tensor, >= 1)
        tokens of the verification pass been processed. MLA caches need nothing: entries past the
        kept positions are masked by position and overwritten by the next pass. A history from
        `new_history` rolls every layer back in two gathers (no host synchronisation: graph-safe).

        `lazy` (the cache's own `verification` history only): the recurrent states stay in the history
        and `kda_source` points at slot keep - 1; only the conv windows are gathered. For flows whose
        KDA steps all run the fused kernel, which reads (and a one-token step updates) the states
        where `kda_source` says; anything else reads them after `settle_kda`."""
        columns = keep + self._conv_offsets.to(keep.device)
        if lazy:
            if history is not self.verification:
                raise ValueError(
                    "a lazy KDA rollback keeps the states in the cache's own verification history; "
                    "make the cache with verify_window and verify into cache.verification"
                )
            self.kda_source.copy_(keep)
            torch.index_select(history.window, 2, columns, out=self.kda_conv)
            self.kda_lazy = True
            return
        if isinstance(history, KDAHistories) and history.layers == self.kda_layers:
            torch.index_select(history.states, 1, keep - 1, out=self.kda_recurrent.unsqueeze(1))
            torch.index_select(history.window, 2, columns, out=self.kda_conv)
        else:
            for layer, state in self.kda.items():
                past = history[layer]
                state.recurrent.copy_(past.states.index_select(0, keep - 1)[0])
                state.conv.copy_(past.window.index_select(1, columns))
        if self.verification is not None:  # the states are in kda_recurrent again
            self.kda_source.zero_()
        self.kda_lazy = False

    def settle_kda(self) -> None:
        """Bring the recurrent states back into `kda_recurrent` after lazy rollbacks (for readers that
        do not follow `kda_source`: the reference KDA layers). Graph-safe (no host synchronisation);
        nothing to do unless `kda_lazy`."""
        if not self.kda_lazy or self.verification is None:
            return
        source = self.kda_source
        slot = (source.long() - 1).clamp(min=0)
        held = self.verification.states.index_select(1, slot)[:, 0]
        self.kda_recurrent.copy_(torch.where(source.bool(), held, self.kda_recurrent))
        source.zero_()
        self.kda_lazy = False

    def reset(self) -> None:
        """Zero every buffer in place (a new request); MLA slots past the position are masked anyway."""
        self.kda_recurrent.zero_()
        self.kda_conv.zero_()
        self.kda_source.zero_()
        self.kda_lazy = False
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

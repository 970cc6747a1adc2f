"""The vocabulary-parallel LM head: each rank multiplies its vocabulary rows, the logits are gathered."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from solo.distributed.parallel import TensorParallel


class VocabParallelHead(nn.Module):
    """Wraps a head module (any LM-head mode: solo.quantization.lm_head) over this rank's vocabulary
    rows [start, stop); returns the full logits row, gathered in rank order (the same on every rank).
    It is one module object, shared by the target and the NEXTN draft like the single-process head."""

    def __init__(self, inner: nn.Module, tp: TensorParallel, span: tuple[int, int], vocab_size: int) -> None:
        super().__init__()
        self.inner = inner
        self.tp = tp
        self.span = span
        self.vocab_size = vocab_size

    @property
    def mode(self) -> str:
        return self.inner.mode

    @property
    def weight(self) -> torch.Tensor:
        return self.inner.weight

    def rebuilt(self, inner: nn.Module) -> VocabParallelHead:
        """The same shard with another head module (a new LM-head mode)."""
        return VocabParallelHead(inner, self.tp, self.span, self.vocab_size)

    takes_out_dtype = True  # (solo.quantization.lm_head.head_logits)

    def forward(self, x: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
        if out_dtype is None:
            shard = self.inner(x)
        elif getattr(self.inner, "takes_out_dtype", False):
            shard = self.inner(x, out_dtype=out_dtype)
        else:
            shard = self.inner(x).to(out_dtype)
        return self.tp.all_gather_last(shard)

    def describe(self) -> dict[str, Any]:
        info = self.inner.describe() if hasattr(self.inner, "describe") else {"mode": "dense"}
        return {**info, "vocab_shard": list(self.span), "vocab_size": self.vocab_size, "tensor_parallel": self.tp.world}

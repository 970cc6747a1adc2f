"""One tensor-parallel rank's view of a checkpoint: the loader reads it as if it were the checkpoint.

`ShardedReader` answers the loader's questions (names, shape, get) with this rank's shard
(solo.distributed.sharding says which dimension of which tensor is split): a split tensor has its
local shape and `get` reads only its slice (`CheckpointReader.get_part`, through safetensors' slices;
other sources are narrowed after reading). Routed experts split by expert are renumbered: local
expert j is checkpoint expert first + j, and the other ranks' experts are not in the view (their
owners check them). Quantized tensors split consistently with their scales:

  * block-FP8 linears: when every rank's slice starts on a block boundary (the slice is a multiple of
    the 128-row or 128-column block), the FP8 weight and its block scales are sliced together and
    stay FP8. When the split cuts a block (the slice is not a multiple of the block: small layers
    such as the bundled model's head-wise gates), the rank reads its FP8 slice and the scale blocks
    covering it and dequantizes exactly those values (what the CPU path computes with anyway); the
    layer is listed in `dequantized`, and `--block-fp8 on` refuses it (the FP8 kernel needs whole
    blocks).
  * MXFP4 experts split by width: codes and E8M0 scales split along the same dimension, and the plan
    only allows slices of whole 32-element groups.

Nothing here chooses what is loaded: the loader is the same for one rank and for many.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from solo.checkpoint.reader import CheckpointError
from solo.config import LingConfig
from solo.distributed.sharding import EXPERT_TENSOR, ShardPlan

SCALE = ".weight_scale_inv"


@dataclass(frozen=True)
class _Entry:
    source: str  # the checkpoint's tensor name
    dim: int | None = None  # split along this dimension (None: read whole)
    scale: str | None = None  # set: a block-FP8 weight whose split cuts blocks, dequantized with this scale


class ShardedReader:
    """The reader interface (names, shape, get, nbytes, directory) over rank `plan.rank`'s shard."""

    def __init__(
        self, reader: Any, config: LingConfig, plan: ShardPlan, block_size: tuple[int, int] | None = None
    ) -> None:
        self.reader = reader
        self.directory = reader.directory
        self.plan = plan
        self.block_size = block_size
        self.dequantized: list[str] = []  # block-FP8 layers dequantized because the split cuts their blocks
        self._entries: dict[str, _Entry] = {}
        names = reader.names
        first, count = plan.expert_span(config)
        for name in sorted(names):
            expert = EXPERT_TENSOR.match(name)
            if expert is not None:
                prefix, index, projection, kind = expert.groups()
                if plan.experts == "expert":
                    if first <= int(index) < first + count:
                        self._entries[f"{prefix}{int(index) - first}.{projection}.{kind}"] = _Entry(name)
                else:
                    self._entries[name] = _Entry(name, plan.expert_dim(projection))
                continue
            if name.endswith(SCALE):
                continue  # placed with its weight below
            dim = plan.split_dim(name)
            scale = name.removesuffix(".weight") + SCALE
            if name.endswith(".weight") and scale in names and dim is not None and block_size is not None:
                size = reader.shape(name)[dim]
                if size % plan.world == 0 and (size // plan.world) % block_size[dim] == 0:
                    self._entries[name] = _Entry(name, dim)
                    self._entries[scale] = _Entry(scale, dim)
                else:
                    self._entries[name] = _Entry(name, dim, scale)
                    self.dequantized.append(name.removesuffix(".weight"))
                continue
            self._entries[name] = _Entry(name, dim)
            if scale in names:
                self._entries[scale] = _Entry(scale, dim)
        for name in names:  # scales of tensors the view does not hold as such (e.g. a missing weight)
            if name.endswith(SCALE) and not EXPERT_TENSOR.match(name):
                weight = name.removesuffix(SCALE) + ".weight"
                if weight not in names:
                    self._entries[name] = _Entry(name)
        if config.tie_word_embeddings and "lm_head.weight" not in names and "model.word_embeddings.weight" in names:
            self._entries["lm_head.weight"] = _Entry("model.word_embeddings.weight", 0)  # the head's vocabulary rows

    # ------------------------------------------------------------------ the reader interface
    @property
    def names(self) -> set[str]:
        return set(self._entries)

    def __contains__(self, name: str) -> bool:
        return name in self._entries

    def nbytes(self) -> int:
        return self.reader.nbytes()

    def _entry(self, name: str) -> _Entry:
        if name not in self._entries:
            raise CheckpointError(f"{self.directory}: tensor '{name}' is missing from the checkpoint.")
        return self._entries[name]

    def _span(self, entry: _Entry) -> tuple[int, int]:
        assert entry.dim is not None
        size = self.reader.shape(entry.source)[entry.dim]
        if size % self.plan.world:
            raise CheckpointError(
                f"{self.directory}: tensor '{entry.source}' has {size} along dimension {entry.dim}, which does not "
                f"split into {self.plan.world} equal shards (--tensor-parallel {self.plan.world}); the checkpoint "
                "does not match its config.json."
            )
        return self.plan.span(size)

    def shape(self, name: str) -> tuple[int, ...]:
        entry = self._entry(name)
        shape = list(self.reader.shape(entry.source))
        if entry.dim is not None:
            start, stop = self._span(entry)
            shape[entry.dim] = stop - start
        return tuple(shape)

    def get(self, name: str) -> torch.Tensor:
        entry = self._entry(name)
        if entry.dim is None:
            return self.reader.get(entry.source)
        start, stop = self._span(entry)
        if entry.scale is not None:
            return self._dequantized_part(entry, start, stop)
        return self._part(entry.source, entry.dim, start, stop)

    def _part(self, name: str, dim: int, start: int, stop: int) -> torch.Tensor:
        if hasattr(self.reader, "get_part"):
            return self.reader.get_part(name, dim, start, stop)
        return self.reader.get(name).narrow(dim, start, stop - start).contiguous()

    def _dequantized_part(self, entry: _Entry, start: int, stop: int) -> torch.Tensor:
        """The fp32 values of a block-FP8 weight's slice [start, stop) along `entry.dim`, from the slice's
        FP8 codes and the block scales covering it (exactly what dequantizing the whole tensor gives there)."""
        assert entry.dim is not None and entry.scale is not None and self.block_size is not None
        dim, block = entry.dim, self.block_size
        full = self.reader.shape(entry.source)
        expected = tuple(-(-n // b) for n, b in zip(full, block, strict=True))
        if entry.scale not in self.reader or tuple(self.reader.shape(entry.scale)) != expected:
            found = list(self.reader.shape(entry.scale)) if entry.scale in self.reader else "missing"
            raise CheckpointError(
                f"{self.directory}: '{entry.scale}' should hold {list(expected)} block scales for the FP8 weight "
                f"'{entry.source}' {list(full)} with {block[0]}x{block[1]} blocks, found {found}. Re-export the "
                "checkpoint with `solo quantize`."
            )
        weight = self._part(entry.source, dim, start, stop)
        if weight.dtype != torch.float8_e4m3fn:
            raise CheckpointError(
                f"{self.directory}: '{entry.source}' is {weight.dtype}, expected float8_e4m3fn next to its "
                f"'{entry.scale}' (quantization_config.quant_method = 'fp8')."
            )
        first, last = start // block[dim], -(-stop // block[dim])
        scale = self._part(entry.scale, dim, first, last).float()
        scale = scale.repeat_interleave(block[0], 0).repeat_interleave(block[1], 1)
        scale = scale.narrow(dim, start - first * block[dim], stop - start)
        other = 1 - dim
        scale = scale.narrow(other, 0, full[other])
        return weight.float() * scale

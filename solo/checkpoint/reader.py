"""Memory-mapped access to a (possibly sharded) safetensors checkpoint, with clear errors."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open


class CheckpointError(RuntimeError):
    """A checkpoint solo cannot load; the message names the file or tensor and the fix."""


INDEX_NAME = "model.safetensors.index.json"


class CheckpointReader:
    """Maps tensor names to shards; tensors are read lazily through safetensors' mmap."""

    def __init__(self, directory: str | Path) -> None:
        self.directory = Path(directory)
        if not self.directory.is_dir():
            raise CheckpointError(f"{self.directory}: no such checkpoint folder. Pass --model PATH.")
        self._handles: dict[Path, object] = {}
        self._where: dict[str, Path] = {}
        index = self.directory / INDEX_NAME
        if index.is_file():
            self._read_index(index)
        else:
            shards = sorted(self.directory.glob("*.safetensors"))
            if not shards:
                raise CheckpointError(
                    f"{self.directory}: no *.safetensors files and no {INDEX_NAME}. "
                    "The folder is not a safetensors checkpoint."
                )
            for shard in shards:
                for name in self._open(shard).keys():  # type: ignore[attr-defined]  # noqa: SIM118
                    self._where[name] = shard

    def _read_index(self, index: Path) -> None:
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise CheckpointError(f"{index}: unreadable index ({e}). Re-download or re-export it.") from e
        for name, shard_name in weight_map.items():
            shard = self.directory / shard_name
            if not shard.is_file():
                raise CheckpointError(
                    f"{shard}: shard listed in {INDEX_NAME} (for tensor '{name}') is missing. "
                    "The download is incomplete; fetch the missing file."
                )
            self._where[name] = shard
        for shard in sorted(set(self._where.values())):
            present = set(self._open(shard).keys())  # type: ignore[attr-defined]
            for name, where in self._where.items():
                if where == shard and name not in present:
                    raise CheckpointError(
                        f"{shard}: {INDEX_NAME} lists tensor '{name}' in this shard but it is not there. "
                        "The index and the shards do not belong together."
                    )

    def _open(self, shard: Path) -> object:
        handle = self._handles.get(shard)
        if handle is None:
            try:
                handle = safe_open(str(shard), framework="pt")
            except (SafetensorError, OSError, ValueError) as e:
                raise CheckpointError(
                    f"{shard}: not a readable safetensors file ({e}). The file is truncated or "
                    "corrupt; download or export it again."
                ) from e
            self._handles[shard] = handle
        return handle

    @property
    def names(self) -> set[str]:
        return set(self._where)

    def __contains__(self, name: str) -> bool:
        return name in self._where

    def _slice(self, name: str):
        if name not in self._where:
            raise CheckpointError(f"{self.directory}: tensor '{name}' is missing from the checkpoint.")
        return self._open(self._where[name]).get_slice(name)  # type: ignore[attr-defined]

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._slice(name).get_shape())

    def get(self, name: str) -> torch.Tensor:
        try:
            return self._open(self._where[name]).get_tensor(name)  # type: ignore[attr-defined]
        except KeyError:
            raise CheckpointError(f"{self.directory}: tensor '{name}' is missing from the checkpoint.") from None
        except (SafetensorError, OSError, RuntimeError, ValueError) as e:
            raise CheckpointError(
                f"{self._where[name]}: reading tensor '{name}' failed ({e}). The file is truncated "
                "or corrupt; download or export it again."
            ) from e

    def get_part(self, name: str, dim: int, start: int, stop: int) -> torch.Tensor:
        """The slice [start, stop) of tensor `name` along `dim`, read on its own (a tensor-parallel
        rank's shard: the rest of the tensor is not read)."""
        try:
            view = self._slice(name)
            index = [slice(None)] * len(view.get_shape())
            index[dim] = slice(start, stop)
            return view[tuple(index)].contiguous()
        except CheckpointError:
            raise
        except (SafetensorError, OSError, RuntimeError, ValueError) as e:
            raise CheckpointError(
                f"{self._where[name]}: reading [{start}, {stop}) along dimension {dim} of tensor '{name}' failed "
                f"({e}). The file is truncated or corrupt; download or export it again."
            ) from e

    def nbytes(self) -> int:
        return sum(p.stat().st_size for p in set(self._where.values()))

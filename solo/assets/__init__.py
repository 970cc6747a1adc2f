"""Data shipped inside the package: the bundled default model and GSM8K (read through
``importlib.resources``, so a wheel installed anywhere finds them)."""

from __future__ import annotations

import gzip
import json
from collections.abc import Iterator
from importlib import resources
from pathlib import Path

DEFAULT_MODEL_NAME = "ling-gsm8k-tiny"
GSM8K_SPLITS = ("train", "test")


def _root() -> Path:
    # a regular (not zipped) install: the resources are files on disk, which the loaders need
    return Path(str(resources.files(__name__)))


def bundled_models() -> list[str]:
    """Names of the bundled checkpoints."""
    folder = _root() / "models"
    return sorted(p.name for p in folder.iterdir() if (p / "config.json").is_file()) if folder.is_dir() else []


def bundled_model_path(name: str = DEFAULT_MODEL_NAME) -> Path:
    """Where the bundled checkpoint ``name`` lives in this install (not checked)."""
    return _root() / "models" / name


def bundled_model(name: str = DEFAULT_MODEL_NAME) -> Path:
    """The folder of a bundled checkpoint (config.json, safetensors, tokenizer); an error naming the
    fix when this install lacks it."""
    path = bundled_model_path(name)
    if not (path / "config.json").is_file():
        raise FileNotFoundError(
            f"bundled model {name!r} is missing from this install ({path}); the bundled models are "
            f"{bundled_models()}. Reinstall solo, or pass --model PATH."
        )
    return path


def gsm8k_file(split: str) -> Path:
    """The packaged GSM8K ``split`` ("train" or "test"), a gzip-compressed jsonl file."""
    if split not in GSM8K_SPLITS:
        raise ValueError(f"GSM8K has the splits {GSM8K_SPLITS}, not {split!r}")
    path = _root() / "gsm8k" / f"{split}.jsonl.gz"
    if not path.is_file():
        raise FileNotFoundError(
            f"the packaged GSM8K {split} split is missing ({path}): reinstall solo, or pass --data DIR"
        )
    return path


def read_jsonl(path: Path | str) -> Iterator[dict]:
    """The records of a jsonl file, ``.gz`` compressed or not, skipping blank lines."""
    path = Path(path)
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as f:
        for line in f:
            if line.strip():
                yield json.loads(line)

"""Shared fixtures: tiny random checkpoints written by transformers (the oracle)."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(scope="session")
def tiny_checkpoints(tmp_path_factory):
    """preset -> (checkpoint dir, transformers model that wrote it)."""
    pytest.importorskip("transformers", minversion="5.23")  # the oracle (CI installs it)
    from solo.testing.tiny import write_tiny_checkpoint

    made = {}
    for i, preset in enumerate(("a", "b", "c")):
        path = tmp_path_factory.mktemp(f"tiny_{preset}")
        model = write_tiny_checkpoint(path, preset=preset, seed=100 + i)
        made[preset] = (path, model)
    return made


@pytest.fixture()
def fresh_ids():
    """Fresh random prompt ids each call (never a fixed or zero input)."""

    def draw(n: int, vocab: int = 262, low: int = 6) -> torch.Tensor:
        return torch.randint(low, vocab, (n,))

    return draw

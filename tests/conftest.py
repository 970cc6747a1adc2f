"""Shared fixtures: tiny random checkpoints written by transformers (the oracle)."""

from __future__ import annotations

import os

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

    # its own generator from the OS: fixtures that seed torch's global one (tiny checkpoints) must not
    # make the prompts the same every run; the seed is in the failure message's locals
    seed = int.from_bytes(os.urandom(8), "little") >> 1
    gen = torch.Generator().manual_seed(seed)

    def draw(n: int, vocab: int = 262, low: int = 6) -> torch.Tensor:
        return torch.randint(low, vocab, (n,), generator=gen)

    return draw

"""Tests of Triton kernels without a GPU: Triton's CPU interpreter runs the same kernel code."""

from __future__ import annotations

import os
import sys

import torch


def interpret_without_gpu() -> bool:
    """Where there is no GPU, point Triton at its CPU interpreter (TRITON_INTERPRET is read when triton
    is first imported, so call this before importing it; a value set by the caller is kept). Returns
    whether kernels run interpreted."""
    if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") is None and "triton" not in sys.modules:
        os.environ["TRITON_INTERPRET"] = "1"
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")

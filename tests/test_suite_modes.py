"""The suite itself: without a GPU, the kernel tests run under Triton's CPU interpreter. Their modules
turn it on while they are collected, and only if Triton is not loaded yet: a module collected before
them that imports Triton at its top makes them all skip, silently (78 tests did, once). This fails then."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest
import torch

INTERPRETER_MODULES = {"test_fused_gemv.py", "test_fused_step.py", "test_kernels.py"}


@pytest.mark.skipif(torch.cuda.is_available(), reason="with a GPU the kernel tests run on it")
@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="no Triton: the kernel tests skip by design")
def test_the_kernel_tests_run_under_the_interpreter_without_a_gpu(request):
    collected = {Path(str(item.fspath)).name for item in request.session.items}
    if not collected & INTERPRETER_MODULES:
        pytest.skip("no kernel test module was collected in this run")
    assert os.environ.get("TRITON_INTERPRET") == "1", (
        "Triton was imported before the kernel tests were collected, so they run without the interpreter "
        "and skip: import Triton (or solo's kernel modules) inside the tests of modules collected earlier"
    )

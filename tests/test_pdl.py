"""Programmatic dependent launch (solo.kernels.pdl): asked for, it is proven from the compiled kernels'
own flags, and refused with the fix wherever it cannot run. Its effect on the step is measured on
the GPU (`solo bench decode --configs cuda:fp8:fused,cuda:fp8:fused+pdl`), its results checked
against the plain launches in tests/test_gpu_fused_step.py."""

from __future__ import annotations

import importlib.util
import re
from types import SimpleNamespace

import pytest
import torch

from solo.bench.decode import parse_configs
from solo.cli import main

if importlib.util.find_spec("triton") is None:
    pytest.skip("triton is not installed (pip install triton)", allow_module_level=True)

from solo.kernels.pdl import LaunchPolicy, launch_options, pdl_unavailable  # noqa: E402


def _compiled(launch_pdl: bool) -> SimpleNamespace:
    return SimpleNamespace(metadata=SimpleNamespace(launch_pdl=launch_pdl))


def test_the_policy_reports_what_the_compiled_kernels_say():
    policy = LaunchPolicy(pdl=True)
    assert policy.options == {"launch_pdl": True} and launch_options(False) == {}
    policy.record("gemv", _compiled(True))
    policy.record("gemv", _compiled(True))
    policy.record("router", _compiled(True))
    policy.record("router", _compiled(False))  # one launch of the family without PDL spoils it
    policy.record("kda", None)  # the interpreter's launch returns nothing: not a PDL launch
    assert policy.families_with_pdl() == {"gemv": True, "kda": False, "router": False}


def test_pdl_is_unavailable_off_a_hopper_gpu():
    reason = pdl_unavailable("cpu")
    assert reason is not None and ("GPU" in reason or "interpreter" in reason)
    if torch.cuda.is_available() and torch.cuda.get_device_capability()[0] < 9:
        assert "9.0" in pdl_unavailable("cuda")


def test_bench_configs_name_the_launch_mode():
    plain, pdl = parse_configs("cuda:fp8:fused,cuda:fp8:fused+pdl")
    assert (plain.step, plain.pdl, pdl.step, pdl.pdl) == ("fused", False, "fused", True)
    assert pdl.name == "cuda/fp8/fused+pdl"
    with pytest.raises(ValueError, match="decode step is one of"):
        parse_configs("cuda:fp8:fast")
    cuda, triton = parse_configs("cuda:fp8:fused+cuda+pdl,cuda:fp8:fused+triton")
    assert (cuda.step, cuda.pdl, cuda.step_kernels) == ("fused", True, "cuda")
    assert (triton.step, triton.pdl, triton.step_kernels, plain.step_kernels) == ("fused", False, "triton", "auto")
    assert (cuda.step_kernel_tokens, triton.step_kernel_tokens) == (8, 8)
    one, all_pdl = parse_configs("cuda:fp8:fused+cuda1+pdl,cuda:fp8:fused+cuda+pdlall")
    assert (one.step_kernels, one.step_kernel_tokens, one.pdl) == ("cuda", 1, True)
    assert (all_pdl.step_kernels, all_pdl.pdl, "pdlall" in all_pdl.modifiers) == ("cuda", True, True)
    fused, separate = parse_configs("cuda:fp8:fused+cuda+pdl,cuda:fp8:fused+cuda+pdl+seprouter")
    assert (fused.moe_router, separate.moe_router, separate.pdl, separate.step_kernels) == (None, False, True, "cuda")
    lab = parse_configs("cuda:fp8:fused+cuda+pdl+handoff+latewait+beside")[0]
    assert lab.step == "fused" and {"handoff", "latewait", "beside"} <= set(lab.modifiers) and lab.pdl
    inside = parse_configs("cuda:fp8:fused+cuda+pdl+inshared")[0]
    assert (fused.moe_shared, separate.moe_shared, inside.moe_shared) == (None, None, True)
    ringed = parse_configs("cuda:fp8:fused+cuda+pdl+inshared+bulk")[0]
    assert "bulk" in ringed.modifiers and ringed.moe_shared and "bulk" not in fused.modifiers
    front = parse_configs("cuda:fp8:fused+cuda+pdl+kdafront")[0]
    assert "kdafront" in front.modifiers and "kdafront" not in fused.modifiers
    down = parse_configs("cuda:fp8:fused+cuda+pdl+beside+downbeside")[0]
    assert {"beside", "downbeside"} <= set(down.modifiers) and "downbeside" not in fused.modifiers
    off = parse_configs("cuda:fp8:fused+cuda+pdl+nokdafront")[0]
    assert "nokdafront" in off.modifiers and "kdafront" not in off.modifiers
    bad_ones = ("fused+pdl+pdl", "fused+fast", "reference+pdl", "fused+cuda+triton", "reference+seprouter")
    bad_ones += ("fused+cuda+cuda1", "fused+pdl+pdlall", "reference+inshared", "reference+handoff", "reference+bulk")
    bad_ones += ("reference+kdafront", "reference+nokdafront", "fused+cuda+kdafront+nokdafront", "reference+beside")
    bad_ones += ("fused+beside+nobeside", "fused+downbeside+nodownbeside", "reference+downbeside")
    for bad in bad_ones:
        with pytest.raises(ValueError, match="modifiers|one of triton, cuda, cuda1|pdlall includes pdl|give one"):
            parse_configs(f"cuda:fp8:{bad}")


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal on a machine without a GPU")
@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ([], "--pdl on needs the fused decode step, which cannot run: .*Use --pdl off"),
        (["--decode-step", "reference"], "drop --decode-step reference or --pdl on"),
    ],
)
def test_the_cli_refuses_pdl_it_cannot_run(capsys, extra, message):
    assert main(["generate", "hello", "--max-tokens", "2", "--pdl", "on", *extra]) != 0
    err = capsys.readouterr().err
    assert "error" in err and re.search(message, err), err


def test_a_weight_prefetch_that_cannot_run_is_refused_naming_why(monkeypatch):
    """LaunchPolicy(prefetch=True) where no PTX runs (the interpreter) is an error, not a no-op."""
    from solo.kernels.fused_router import FusedRouter

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    weight, counter = torch.randn(64, 256).bfloat16(), torch.zeros(1, dtype=torch.int32)
    with pytest.raises(ValueError, match="cannot prefetch its weight into the L2: Triton's CPU interpreter"):
        FusedRouter(
            weight,
            torch.zeros(64),
            torch.ones(256),
            1e-6,
            8,
            8,
            4,
            True,
            1.0,
            counter,
            launch=LaunchPolicy(prefetch=True),
        )
    assert LaunchPolicy(pdl=True).prefetch and not LaunchPolicy(pdl=True, prefetch=False).prefetch


def test_pdl_for_one_token_calls_only():
    """The decode step's policy: one-token calls launch with PDL, calls of several tokens plainly, and
    the evidence the start-up check reads covers the launches PDL applies to."""
    policy = LaunchPolicy(True, prefetch=False, one_token_only=True)
    assert policy.at(1) is policy and policy.at(1).options == {"launch_pdl": True}
    several = policy.at(4)
    assert several.pdl is False and several.options == {} and several.prefetch is False
    assert policy.at(4) is several  # one plain view, reused
    several.record("gemv", None)
    assert policy.families_with_pdl() == {}
    everywhere = LaunchPolicy(True, prefetch=False)
    assert everywhere.at(4) is everywhere
    assert LaunchPolicy().at(1).pdl is False


def test_cuda_sources_inline_the_headers_beside_them(tmp_path):
    """NVRTC gets one text: `#include "X"` of a file beside the source is inlined (so the kernel cache key
    covers the header), and a missing one is an error naming it."""
    from pathlib import Path

    from solo.kernels import cuda_step
    from solo.kernels.cuda_runtime import expand_includes

    for source in (cuda_step.GEMV_SOURCE, cuda_step.ROUTER_SOURCE):
        text = expand_includes(source)
        assert '#include "' not in text and "block_rstd" in text and 'extern "C"' in text
    (tmp_path / "k.cu").write_text('#include "missing.cuh"\n')
    with pytest.raises(RuntimeError, match="missing.cuh"):
        expand_includes(Path(tmp_path / "k.cu"))


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal on a machine without a GPU")
def test_the_cli_refuses_a_router_inside_the_moe_kernel_it_cannot_run(capsys):
    args = ["generate", "hello", "--max-tokens", "2", "--moe-router", "fused"]
    assert main(args) != 0
    err = capsys.readouterr().err
    assert re.search("--moe-router fused needs the fused decode step, which cannot run: .*Use --moe-router auto", err)

"""Start-up verification: requested optimizations are proven live or start-up fails, loudly."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from solo.assets import bundled_model
from solo.engine.engine import Engine, GenerationParams
from solo.kernels.moe import TorchMoE
from solo.model.moe import SparseMoE
from solo.preflight.checks import ACTIVE, FAILED, UnknownEnvironment, check_environment, run_preflight
from solo.quantization.convert import quantize_checkpoint
from solo.quantization.lm_head import DenseHead
from solo.speculative.nextn import SpeculativeConfig

BUNDLED = bundled_model()


def solo(*args, env=None):
    return subprocess.run(
        [sys.executable, "-m", "solo.cli", *args],
        capture_output=True,
        text=True,
        env={**os.environ, **(env or {})},
    )


def by_name(report):
    return {c.name: c for c in report.checks}


@pytest.fixture(scope="module")
def fp4_tiny(tiny_checkpoints, tmp_path_factory):
    out = tmp_path_factory.mktemp("fp4")
    quantize_checkpoint(tiny_checkpoints["a"][0], out, verbose=False)
    return out


def miswire_fp8_bytes_as_bf16(engine: Engine) -> None:
    """The seed's bug: the draft gets only the FP8 head's weight tensor (no scales, not the module)
    and reads its bytes as BF16: each E4M3 byte lands in the high byte of a BF16 value."""
    raw = engine.model.lm_head.weight.data.view(torch.uint8).to(torch.int16)
    engine.decoder.draft_head = DenseHead((raw << 8).view(torch.bfloat16), "bf16")


def miswire_own_bf16_head(engine: Engine, path) -> None:
    """The draft has its own BF16 copy of the head: numerically plausible, but not the target's module."""
    from solo.fastpath import load_accelerated

    engine.decoder.draft_head = load_accelerated(path, lm_head="bf16").lm_head


def test_seed_failure_fp8_weight_tensor_in_draft_is_caught():
    engine = Engine.from_pretrained(BUNDLED, lm_head="fp8", speculative=SpeculativeConfig())
    good = by_name(run_preflight(engine, "torch", "fp8", speculative=True))
    assert good["draft_head"].status == ACTIVE and good["mtp"].status == ACTIVE, good
    miswire_fp8_bytes_as_bf16(engine)
    bad = by_name(run_preflight(engine, "torch", "fp8", speculative=True))
    assert bad["draft_head"].status == FAILED
    assert bad["mtp"].status == FAILED and bad["mtp"].evidence["accept_length"] < 1.2
    assert bad["lm_head"].status == ACTIVE  # the target's head itself is fine: only the wiring is wrong


def test_draft_with_its_own_bf16_head_is_caught():
    engine = Engine.from_pretrained(BUNDLED, lm_head="bf16", speculative=SpeculativeConfig())
    miswire_own_bf16_head(engine, BUNDLED)
    report = by_name(run_preflight(engine, "torch", "bf16", speculative=True))
    assert report["draft_head"].status == FAILED and "same_object" in report["draft_head"].evidence


def test_check_cli_passes_with_correct_wiring_and_reports_json():
    proc = solo(
        "check",
        "--model",
        str(BUNDLED),
        "--lm-head",
        "fp8",
        "--block-fp8",
        "on",
        "--speculative-algorithm",
        "NEXTN",
        "--json",
    )
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    statuses = {c["name"]: c["status"] for c in report["checks"]}
    assert statuses == {
        "tensor_parallel": "OFF",  # one process (tests/test_tensor_parallel.py runs the split)
        "moe_backend": "ACTIVE",
        "lm_head": "ACTIVE",
        "block_fp8": "ACTIVE",
        "decode_step": "OFF",  # auto on a CPU: the reference decode step, with the reason
        "draft_head": "ACTIVE",
        "mtp": "ACTIVE",
        "kernels": "OFF",
        "cuda_graphs": "OFF",
    }
    assert all(c["evidence"] for c in report["checks"] if c["status"] == "ACTIVE")
    assert report["ok"] and report["seconds"] < 30


def test_check_fails_when_speculation_does_not_pay(tiny_checkpoints):
    """A random NEXTN layer never gets its drafts accepted: start-up refuses, unless --allow-fallback."""
    path = tiny_checkpoints["a"][0]
    proc = solo("check", "--model", str(path), "--speculative-algorithm", "NEXTN")
    assert proc.returncode != 0 and "mtp" in proc.stderr and "FAILED" in proc.stdout
    proc = solo("generate", "--model", str(path), "--speculative-algorithm", "NEXTN", "--max-tokens", "4", "hi")
    assert proc.returncode != 0 and "requested optimization not active: mtp" in proc.stderr
    proc = solo(
        "generate",
        "--model",
        str(path),
        "--speculative-algorithm",
        "NEXTN",
        "--max-tokens",
        "4",
        "--allow-fallback",
        "hi",
    )
    assert proc.returncode == 0 and "WARNING" in proc.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only behaviour")
@pytest.mark.parametrize("backend", ["triton", "humming", "cuda"])
def test_gpu_backend_on_cpu_fails_loudly(fp4_tiny, backend):
    proc = solo("generate", "--model", str(fp4_tiny), "--moe-backend", backend, "--max-tokens", "2", "hi")
    assert proc.returncode != 0 and f"--moe-backend {backend}" in proc.stderr and "Traceback" not in proc.stderr
    proc = solo("check", "--model", str(fp4_tiny), "--moe-backend", backend)
    assert proc.returncode != 0 and backend in proc.stderr


def test_misspelled_option_and_unknown_environment_fail(tiny_checkpoints):
    path = str(tiny_checkpoints["a"][0])
    proc = solo("generate", "--model", path, "--lm-haed", "fp8", "hi")
    assert proc.returncode == 2 and "unrecognized arguments: --lm-haed" in proc.stderr
    proc = solo("generate", "--model", path, "--lm-head", "fp4", "hi")
    assert proc.returncode == 2 and "invalid choice: 'fp4'" in proc.stderr
    proc = solo("check", "--model", path, env={"SOLO_CACHE_DIRR": "/tmp/x"})
    assert proc.returncode != 0 and "SOLO_CACHE_DIRR" in proc.stderr
    with pytest.raises(UnknownEnvironment, match="SOLO_MOE_BACKEND"):
        check_environment({"SOLO_MOE_BACKEND": "triton"})
    check_environment({"SOLO_CACHE_DIR": "/tmp/x", "PATH": "/bin"})


def test_check_reports_backend_that_actually_ran(tiny_checkpoints):
    engine = Engine.from_pretrained(tiny_checkpoints["b"][0], lm_head="fp32")
    report = by_name(run_preflight(engine, "torch", "fp32", speculative=False))
    assert report["moe_backend"].status == ACTIVE and report["moe_backend"].evidence["calls"] >= 1
    asked_other = by_name(run_preflight(engine, "triton", "fp32", speculative=False))
    assert asked_other["moe_backend"].status == FAILED  # the experts ran on torch, not triton
    wrong_head = by_name(run_preflight(engine, "torch", "fp8", speculative=False))
    assert wrong_head["lm_head"].status == FAILED


class _DecodeKernelBackend(TorchMoE):
    """The torch reference dressed as a backend with a dedicated one-token kernel (like --moe-backend
    cuda); ``falls_back`` makes its one-token calls take the multi-token path instead."""

    name = "cuda"

    def __init__(self, inner: TorchMoE, falls_back: bool) -> None:
        self.__dict__.update(inner.__dict__)
        self.falls_back = falls_back
        self.path_calls = {"gemv": 0, "tensor_core": 0, "persistent": 0}

    def family_for(self, tokens: int) -> str:
        return "persistent" if tokens == 1 else "gemv" if tokens <= 8 else "tensor_core"

    def forward(self, x, topk_ids, topk_weights):
        t = topk_ids.shape[0]
        family = self.family_for(t)
        if family == "persistent" and self.falls_back:
            family = "gemv"
        self.path_calls[family] += 1
        return super().forward(x, topk_ids, topk_weights)


@pytest.mark.parametrize("falls_back", [False, True])
def test_check_catches_a_decode_step_that_skipped_its_kernel(tiny_checkpoints, falls_back):
    engine = Engine.from_pretrained(tiny_checkpoints["b"][0], lm_head="fp32")
    for module in engine.model.modules():
        if isinstance(module, SparseMoE):
            module.experts = _DecodeKernelBackend(module.experts, falls_back)
    check = by_name(run_preflight(engine, "cuda", "fp32", speculative=False))["moe_backend"]
    if falls_back:
        assert check.status == FAILED and "did not run the persistent kernels" in check.reason
    else:
        assert check.status == ACTIVE and check.evidence["persistent_calls"] >= 1


def test_watchdog_warns_when_accept_length_stays_low(tiny_checkpoints, caplog):
    engine = Engine.from_pretrained(tiny_checkpoints["a"][0], speculative=SpeculativeConfig())
    with caplog.at_level(logging.WARNING, logger="solo.speculative"):
        engine.generate(list(range(6, 20)), GenerationParams(max_tokens=90, ignore_eos=True))
    assert engine.watchdog.warnings >= 1
    assert any("accept length" in r.message for r in caplog.records)


class _FakeHumming(TorchMoE):
    """The torch reference dressed as the Humming backend, with a cache folder of its own: the start-up
    check must show the compiled kernels it finds there, and fail when there are none."""

    name = "humming"

    def __init__(self, inner: TorchMoE, cache_dir: Path) -> None:
        self.__dict__.update(inner.__dict__)
        self.cache_dir = cache_dir

    def compile_evidence(self):
        from solo.kernels.humming_moe import humming_artifacts
        from solo.kernels.moe import CompileEvidence

        return CompileEvidence("humming", str(self.cache_dir), humming_artifacts(str(self.cache_dir)))


@pytest.mark.parametrize("cached", [False, True])
def test_humming_kernel_check_shows_its_compiled_kernels_or_fails(tiny_checkpoints, tmp_path, cached):
    from solo.preflight.checks import check_kernels

    cache = tmp_path / "humming"
    cache.mkdir()
    if cached:
        (cache / "gemm_sm90_n1536_k2560.cubin").write_bytes(b"\x7fELF fake cubin")
    engine = Engine.from_pretrained(tiny_checkpoints["b"][0], lm_head="fp32")
    for module in engine.model.modules():
        if isinstance(module, SparseMoE):
            module.experts = _FakeHumming(module.experts, cache)
    check = check_kernels(engine, "humming")
    if cached:
        assert check.status == ACTIVE and check.evidence["moe"]["artifacts"] == 1
        assert check.evidence["moe"]["examples"][0].endswith(".cubin")
    else:
        assert check.status == FAILED and "no compiled humming kernel" in check.reason


def test_fused_decode_step_on_a_cpu_is_refused_with_the_fix(tiny_checkpoints):
    path = str(tiny_checkpoints["a"][0])
    # TRITON_INTERPRET (set by the interpreter tests of this session) would let the step run on a CPU
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run(
        [sys.executable, "-m", "solo.cli", "generate", "--model", path, "--decode-step", "fused", "hi"],
        capture_output=True,
        text=True,
        env=env,
    )
    assert proc.returncode == 1 and "--decode-step fused" in proc.stderr and "--device cuda" in proc.stderr
    assert "Traceback" not in proc.stderr
    proc = solo("check", "--model", path, "--json")
    check = {c["name"]: c for c in json.loads(proc.stdout)["checks"]}["decode_step"]
    assert check["status"] == "OFF" and "NVIDIA GPU" in check["evidence"]["reason"]


def test_python_dash_m_solo_is_the_solo_command():
    """`python -m solo` takes the same command line as the `solo` script (the lab's device scripts use it
    where the package is on PYTHONPATH but not installed)."""
    got = subprocess.run([sys.executable, "-m", "solo", "bench", "decode", "--help"], capture_output=True, text=True)
    want = solo("bench", "decode", "--help")
    assert got.returncode == want.returncode == 0 and "--random-weights" in got.stdout
    assert got.stdout == want.stdout

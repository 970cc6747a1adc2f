"""A non-editable install works on its own: the wheel carries the bundled model, GSM8K and the CUDA
sources, and `solo generate`, `solo check` and `solo bench gsm8k` run from an unrelated folder.

The wheel goes into a fresh virtual environment that holds nothing else; its dependencies (torch,
tokenizers, ...) are the test environment's, made visible by a path file, so the test needs no
network. Imports are checked to come from the fresh environment, not from this checkout.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import venv
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SKIP = {".git", ".venv", "build", "dist", "__pycache__", ".pytest_cache", ".ruff_cache", ".cache", ".data", "runs"}

pytestmark = pytest.mark.slow


def _copy_sources(dest: Path) -> Path:
    """The checkout without environments and build outputs (the build must not see a stale egg-info)."""

    def ignore(_dir: str, names: list[str]) -> set[str]:
        return {n for n in names if n in SKIP or n.endswith(".egg-info")}

    shutil.copytree(ROOT, dest, ignore=ignore)
    return dest


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> dict:
    work = tmp_path_factory.mktemp("wheel")
    source = _copy_sources(work / "src")
    wheels = work / "wheels"
    build = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(wheels), "."],
        cwd=source,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert build.returncode == 0, build.stderr[-3000:]
    (wheel,) = wheels.glob("solo-*.whl")

    env_dir = work / "env"
    venv.EnvBuilder(with_pip=False).create(env_dir)
    python = env_dir / "bin" / "python"
    purelib = Path(
        subprocess.run(
            [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    )
    with zipfile.ZipFile(wheel) as z:  # installing a wheel is unpacking it into site-packages
        z.extractall(purelib)
    # the test environment's packages for the dependencies, after the fresh site-packages
    (purelib / "_solo_test_deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    entry = env_dir / "bin" / "solo"
    entry.write_text(f"#!{python}\nimport sys\nfrom solo.cli import main\nsys.exit(main())\n")
    entry.chmod(0o755)
    elsewhere = work / "elsewhere"
    elsewhere.mkdir()
    return {"wheel": wheel, "python": python, "solo": entry, "cwd": elsewhere, "purelib": purelib}


def _run(installed: dict, *args: str, timeout: int = 600) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env["SOLO_CACHE_DIR"] = str(installed["cwd"] / "cache")
    return subprocess.run(
        [str(installed["solo"]), *args], cwd=installed["cwd"], env=env, capture_output=True, text=True, timeout=timeout
    )


def test_the_wheel_carries_what_solo_reads_at_run_time(installed):
    names = set(zipfile.ZipFile(installed["wheel"]).namelist())
    for needed in (
        "solo/kernels/cuda/moe_decode.cu",
        "solo/kernels/cuda/gemv_decode.cu",
        "solo/kernels/cuda/router_decode.cu",
        "solo/kernels/cuda/step_common.cuh",
        "solo/assets/gsm8k/test.jsonl.gz",
        "solo/assets/gsm8k/train.jsonl.gz",
        "solo/assets/gsm8k/LICENSE",
        "solo/assets/models/ling-gsm8k-tiny/config.json",
        "solo/assets/models/ling-gsm8k-tiny/model-00001-of-00001.safetensors",
        "solo/assets/models/ling-gsm8k-tiny/tokenizer.json",
    ):
        assert needed in names, needed
    where = subprocess.run(
        [str(installed["python"]), "-c", "import solo, solo.assets as a; print(solo.__file__, a.bundled_model())"],
        cwd=installed["cwd"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    assert all(Path(p).is_relative_to(installed["purelib"]) for p in where), where


def test_installed_solo_generates_with_the_bundled_model(installed):
    proc = _run(
        installed, "generate", "--speculative-algorithm", "NEXTN", "--lm-head", "fp8", "--max-tokens", "24", "--json",
        "Question: Tom has 3 bags of 4 apples. How many apples?\nAnswer:",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout)
    assert out["stats"]["completion_tokens"] >= 1 and out["text"]
    assert out["stats"]["accept_length"] >= 1 and out["engine"]["lm_head"]["mode"] == "fp8"


def test_installed_solo_check_proves_the_optimizations(installed):
    proc = _run(installed, "check", "--speculative-algorithm", "NEXTN", "--lm-head", "fp8", "--json")
    assert proc.returncode == 0, proc.stderr[-3000:]
    statuses = {c["name"]: c["status"] for c in json.loads(proc.stdout)["checks"]}
    assert statuses["lm_head"] == "ACTIVE" and statuses["mtp"] == "ACTIVE"


def test_installed_solo_benches_gsm8k_from_the_packaged_data(installed):
    out = installed["cwd"] / "bench"
    proc = _run(installed, "bench", "gsm8k", "--num-prompts", "3", "--output-len", "48", "--out", str(out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads((out / "report.json").read_text())
    assert report["workload"]["name"] == "gsm8k"
    (config,) = report["configs"].values()
    assert config["completed"] == 3

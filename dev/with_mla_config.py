"""Run a command with FusedMLA's launch configuration set to the best one a dev/mla_probe.py report
measured (lowest total time over its contexts and token counts, among variants that ran and agree
with the first to 1e-2), so that one device call can probe and then measure the whole step with the
winner before it becomes the default.

    python3 dev/with_mla_config.py REPORT.json -m solo.cli bench decode ...
    python3 dev/with_mla_config.py REPORT.json -m pytest tests/test_gpu_fused_step.py
"""

from __future__ import annotations

import json
import runpy
import sys
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mla_probe import ATTRS  # noqa: E402  (dev/, the script's own folder)

from solo.kernels.fused_mla import FusedMLA  # noqa: E402

KEYS = ("block_l", "stages", "warps", "min_chunk", "v_per_program", "rows")  # the report's names of ATTRS


def best(report: dict) -> tuple[int, ...]:
    total: dict[tuple[int, ...], float] = defaultdict(float)
    cells: dict[tuple[int, ...], int] = defaultdict(int)
    bad = set()
    for row in report["rows"]:
        key = tuple(row[k] for k in KEYS)
        if "error" in row or row["rel_err"] > 1e-2:
            bad.add(key)
            continue
        total[key] += row["us"]
        cells[key] += 1
    full = max(cells.values())
    return min((k for k in total if k not in bad and cells[k] == full), key=total.__getitem__)


def main() -> None:
    report = json.loads(Path(sys.argv[1]).read_text())
    choice = best(report)
    for attr, value in zip(ATTRS, choice, strict=True):
        setattr(FusedMLA, attr, value)
    print("FusedMLA configuration: " + ", ".join(f"{a}={v}" for a, v in zip(ATTRS, choice, strict=True)), flush=True)
    if sys.argv[2] != "-m":
        raise SystemExit("usage: with_mla_config.py REPORT.json -m MODULE [ARGS...]")
    sys.argv = [sys.argv[3], *sys.argv[4:]]
    runpy.run_module(sys.argv[0], run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()

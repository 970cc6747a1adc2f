"""Run a command with FusedMLA's launch configurations set to the best ones a dev/mla_probe.py report
measured: for one token (`FusedMLA.ONE_TOKEN`) and for several (`FusedMLA.WINDOW`) apart, the variant
with the lowest total time over the report's contexts, among those that ran everywhere and agree with
the first to 1e-2. So one device call can probe and then measure the whole step with the winners
before they become the defaults.

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

from solo.kernels.fused_mla import AttendLaunch, FusedMLA  # noqa: E402


def best(report: dict, several: bool) -> AttendLaunch | None:
    """The fastest configuration for one token (several=False) or several, or None if none was run."""
    total: dict[str, float] = defaultdict(float)
    cells: dict[str, int] = defaultdict(int)
    bad = set()
    for row in report["rows"]:
        if (row["tokens"] > 1) != several:
            continue
        key = json.dumps(row["config"], sort_keys=True)
        if "error" in row or row["rel_err"] > 1e-2:
            bad.add(key)
            continue
        total[key] += row["us"]
        cells[key] += 1
    if not cells:
        return None
    full = max(cells.values())
    choice = min((k for k in total if k not in bad and cells[k] == full), key=total.__getitem__)
    return AttendLaunch(**json.loads(choice))


def main() -> None:
    if len(sys.argv) < 4 or sys.argv[2] != "-m":
        raise SystemExit("usage: with_mla_config.py REPORT.json -m MODULE [ARGS...]")
    report = json.loads(Path(sys.argv[1]).read_text())
    for attr, several in (("ONE_TOKEN", False), ("WINDOW", True)):
        choice = best(report, several)
        if choice is not None:
            setattr(FusedMLA, attr, choice)
        print(f"FusedMLA.{attr} = {getattr(FusedMLA, attr)}", flush=True)
    sys.argv = [sys.argv[3], *sys.argv[4:]]
    runpy.run_module(sys.argv[0], run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()

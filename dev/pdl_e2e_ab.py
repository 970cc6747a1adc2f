"""End-to-end A/B of programmatic dependent launch in the MoE (lent H200, bundled model, GSM8K).

    python dev/pdl_e2e_ab.py off|on

Runs `solo bench gsm8k` (20 questions, triton MoE, FP8 head, NEXTN, with the plain baseline) with
the MoE's PDL forced off, or as shipped. Run the two alternately in separate processes.
"""

from __future__ import annotations

import sys

import solo.kernels.triton_moe as triton_moe
from solo.cli import main

if __name__ == "__main__":
    if sys.argv[1:] == ["off"]:
        triton_moe.TritonMoE.uses_pdl = lambda self: False  # type: ignore[method-assign]
    elif sys.argv[1:] != ["on"]:
        raise SystemExit(__doc__)
    args = "bench gsm8k --device cuda --num-prompts 20 --output-len 160 --moe-backend triton --lm-head fp8"
    sys.exit(main([*args.split(), "--speculative-algorithm", "NEXTN", "--baseline"]))

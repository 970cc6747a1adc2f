#!/usr/bin/env bash
# The twelfth session's fourth device call: what the A/B's output check can tell. Its third call found the
# switches undone "differing" from the product (0.49) where, the other way round, they had been identical;
# at random weights one bf16 step can change an expert choice. In order:
# 1. the KDA test of 8 programs a head, to rounding now (it failed bit for bit on Triton 3.6);
# 2. dev/decode_launch_ab.py at 32K: the product twice, each switch undone alone, KDA with 8 value splits.
# Results under $OUT: gpu_tests.log, ab.{log,json}.
LAB_DEFAULT_SECONDS=430
source dev/lab_prelude.sh
timeout 120 python3 -m pytest -q -p no:cacheprovider tests/test_gpu_fused_step.py -k more_programs > "$OUT/gpu_tests.log" 2>&1
echo "[tests rc=$?]"; grep -E "^FAILED|^E  |passed|failed" "$OUT/gpu_tests.log" | head -12
# (a list with an apostrophe cannot be the default inside "${VARIANTS:-...}": bash reads the quote)
default="product again;full selection;MLA combine by the heads' value rows;KDA one token 8 value splits"
ab ab "product;${VARIANTS:-$default}"

#!/usr/bin/env bash
# Eighteenth session, second call: lab_session27.sh's A/B put the MoE kernel's L2 asks after its block's copies
# landed (l2_next_at 1) ahead (-13 us with the shared expert's weights, -44 with 8 MB of the next projection more)
# and the later points behind. Now the sizes after the copies, the fixed GPU test, and the product's bench.
# Results under $OUT: gpu_tests.log, ab.{log,json}, bench.{log,json}. Say which card ran it. timeout_s 600.
LAB_DEFAULT_SECONDS=585
source dev/lab_prelude.sh
timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_gpu_fused_step.py -k "l2_for_later" \
    > "$OUT/gpu_tests.log" 2>&1
echo "[GPU tests rc=$? at ${SECONDS}s]"; tail -2 "$OUT/gpu_tests.log"
n="L2 next:"
default="$n shared + 8 MB, after the copies;$n shared + 16 MB, after the copies;$n shared + 4 MB, after the copies"
default+=";product again;$n shared + 12 MB, after the copies;$n 8 MB, after the copies"
default+=";$n shared + 24 MB, after the copies"
ab ab "product;${VARIANTS:-$default}" --deadline "${AB_DEADLINE:-$(($(left) - 200))}"
if [ "$(left)" -gt 150 ]; then product_bench 32768 0 5; fi

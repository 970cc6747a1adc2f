#!/usr/bin/env bash
# Thirty-sixth session, the shortest call: verification's attention in the Gluon ring, its GPU test and the attention
# alone (dev/mla_probe.py: 4 tokens at 32K, the product's Triton attention, the ring of 64 rows and of 32), then, with
# time left, the GPU test of the KDA recurrence's splits of one warp. Results under $OUT: gpu_tests.log,
# mla_probe.log[, kda_tests.log]. timeout_s LAB_SECONDS + 20.
LAB_DEFAULT_SECONDS=200
source dev/lab_prelude.sh
gpu_tests 80 tests/test_gpu_fused_step.py -k "several_tokens"
grep -E "worst|FAILED" "$OUT/gpu_tests.log" | head -8
timeout 80 python3 dev/mla_probe.py --tokens 4 --contexts 32768 --changes \
    '[{}, {"gluon": true}, {"gluon": true, "rows_per_program": 32}]' > "$OUT/mla_probe.log" 2>&1
echo "[mla probe rc=$? at ${SECONDS}s]"; grep -E "^T=|copy bandwidth" "$OUT/mla_probe.log"
if [ "$(left)" -gt 40 ]; then
    timeout $(($(left) - 5)) python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_gpu_fused_step.py \
        -k more_programs_per_kda > "$OUT/kda_tests.log" 2>&1
    echo "[KDA tests rc=$? at ${SECONDS}s]"; tail -2 "$OUT/kda_tests.log"
fi

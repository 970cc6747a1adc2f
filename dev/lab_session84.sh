#!/usr/bin/env bash
# The fused KDA front as the H100's product (KDA_FRONT_CARDS): every GPU test of the fused step (the front now runs in
# them on the H100: each layer against the reference layer, greedy decoding and NEXTN rounds in graphs, the start-up
# check), then, time allowing, the product's bench at 32K beside the same step with the two kernels (nokdafront).
# Results under $OUT: gpu_tests.log, bench.{log,json}. timeout_s LAB_SECONDS + 30.
LAB_DEFAULT_SECONDS=560
source dev/lab_prelude.sh
if [ "${SKIP_TESTS:-0}" != 1 ]; then
    gpu_tests "${TEST_SECONDS:-330}" tests/test_gpu_fused_step.py -s
    grep -E "worst rel|passed|failed|Error" "$OUT/gpu_tests.log" | head -12
fi
if [ "$(left)" -gt 240 ]; then
    timeout $(($(left) - 5)) python3 -m solo bench decode --random-weights ling-3.0-flash \
        --configs cuda:fp8:fused+cuda+pdl,cuda:fp8:fused+cuda+pdl+nokdafront --context 32768 --prefill "" \
        --loop-tokens 128 --json "$OUT/bench.json" > "$OUT/bench.log" 2>&1
    echo "[bench rc=$? at ${SECONDS}s]"; grep -E "^\| cuda|kda_front" "$OUT/bench.log" | head -8
fi

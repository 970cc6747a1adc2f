#!/usr/bin/env bash
# Thirty-fifth session, its last call (little device time left). On an H200: the fused KDA front's GPU test and its
# A/B at 32K beside the product. On an H100: the sampling top-k's tests at the real vocabulary with its new chunking
# (chunks of 1,024 merged in groups of 8), then the product's bench at 32K (the sampled round's top-k cuts).
# Results under $OUT: [gpu_tests.log, ab.{log,json}] or [topk_tests.log, bench.{log,json}]. timeout_s LAB_SECONDS + 20.
LAB_DEFAULT_SECONDS=250
source dev/lab_prelude.sh
if nvidia-smi -L | grep -q H200; then
    gpu_tests 70 tests/test_gpu_fused_step.py -k fused_kda_front
    grep -E "worst rel" "$OUT/gpu_tests.log" | head -2
    ab ab "product;KDA front fused, ring of 3, g last;product again;KDA front fused, ring of 3, g last, again" \
        --deadline "$(($(left) - 20))"
else
    timeout 60 python3 -m pytest -q -p no:cacheprovider tests/test_topk_kernel.py > "$OUT/topk_tests.log" 2>&1
    echo "[top-k tests rc=$? at ${SECONDS}s]"; tail -1 "$OUT/topk_tests.log"
    PREFILL="" product_bench 32768 16
    grep -E "NEXTN round \(sampled|_top_k" "$OUT/bench.log" | head -3
fi

#!/usr/bin/env bash
# Twentieth session, sixth call: the product with its MoE kernels' gate_up window (3 tiles on the H100,
# GATE_UP_WINDOW_CARDS). The fused step's GPU tests against the reference layers, greedy decode and speculation in
# graphs, PDL and the start-up check (gpu_tests.log); the A/B at 32K against the tiles all at once (ab.{log,json});
# then the product's bench at 4K and 32K with the real loop (bench.{log,json}). timeout_s 600.
LAB_DEFAULT_SECONDS=585
source dev/lab_prelude.sh
timeout 170 python3 -m pytest -q -p no:cacheprovider tests/test_gpu_fused_step.py \
    -k "every_fused_layer or moe_kernels_asking or greedy_decode or speculation_on or pdl_launches" \
    > "$OUT/gpu_tests.log" 2>&1
echo "[GPU tests rc=$? at ${SECONDS}s]"; tail -2 "$OUT/gpu_tests.log"
ab ab "product;${VARIANTS:-MoE gate_up tiles all at once;product again}" --deadline 130
product_bench 4096,32768 128 5
grep -o '"gate_up_window": [0-9]*' "$OUT/bench.json" | head -1

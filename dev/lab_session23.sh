#!/usr/bin/env bash
# Sixteenth session, first call (meant for an H200; on an H100 it still answers the first question). The
# shared expert inside the MoE kernel (--moe-shared fused) lost 0.08 ms a step in the seventh session
# (h200_bench_decode_triton_carveout_ab.json), and was never measured again since the MoE kernel changed: its
# down copies now wait for the block's gate_up tiles (down_after 7), so the routed copies that land in the
# shared tail, which waited for the shared expert to be done, may no longer wait. First its GPU layer test,
# then one process at 32K: the product twice, the shared expert inside, the bulk ring of two blocks of 8 warps
# on the big projections (never run on an H200), both, two blocks of 10. Results under $OUT: gpu_tests.log,
# ab.{log,json}. Say which card ran it. timeout_s 420.
LAB_DEFAULT_SECONDS=410
source dev/lab_prelude.sh
timeout 120 python3 -m pytest -q -p no:cacheprovider tests/test_gpu_fused_step.py -k "shared_expert_inside" \
    > "$OUT/gpu_tests.log" 2>&1
echo "[shared-inside test rc=$? at ${SECONDS}s]"; tail -2 "$OUT/gpu_tests.log"
b="qkvfgb, q|kv_a|g, MLP"
default="shared expert inside;bulk, 2 blocks of 8 warps: $b;product again"
default+=";shared expert inside, bulk, 2 blocks of 8 warps: $b;bulk, 2 blocks of 10 warps: $b"
ab ab "product;${VARIANTS:-$default}" --deadline "${AB_DEADLINE:-$(($(left) - 60))}"

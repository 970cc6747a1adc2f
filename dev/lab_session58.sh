#!/usr/bin/env bash
# Written in the twenty-third session for the next first call: what matters most on each card comes first, because a
# session may get a single short window (the twenty-third got a machine in four of fifteen calls).
#   H200: the product's bench at 32K first. The H200 number is lab16's 2.406 ms, older than every H100 change since.
#     Then lab_session37.sh's A/B of the H200's own levers, then its steady probe.
#   H100: the GPU tests whose norm checks are now exact (solo/testing/rounding.py) and the norm probe with the 1 / rms
#     offsets. Then the product's bench at 4K and 32K (the last H100 bench, lab42, predates lean_select).
# Results under $OUT: bench.{log,json} on both; ab.{log,json} and steady.log (H200); gpu_tests.log and
# norm_rounding.log (H100). timeout_s 600.
LAB_DEFAULT_SECONDS=585
source dev/lab_prelude.sh
if nvidia-smi -L | grep -q H200; then
    PREFILL="" product_bench 32768 128 $(($(left) - 300))
    big="qkvfgb, q|kv_a|g, MLP"
    default="bulk, 2 blocks of 8 warps: $big;MLA one token: L2 asks for the first step early"
    default+=";L2 next: shared + 16 MB, after the copies;MoE gate_up window 3;L2 fetch 256 B;product again"
    ab ab "product;${VARIANTS:-$default}" --deadline "$(($(left) - 90))"
    steady_probe $(($(left) - 5))
else
    gpu_tests 200 tests/test_cuda_moe.py tests/test_gpu_cuda_step.py -k "chooses or norm_projection_and_residual"
    timeout 60 python3 dev/norm_rounding_probe.py --draws 1000 2>&1 | grep -v Warning > "$OUT/norm_rounding.log"
    echo "[norm probe rc=$? at ${SECONDS}s]"; tail -4 "$OUT/norm_rounding.log"
    PREFILL="" product_bench 4096,32768 128 5
fi

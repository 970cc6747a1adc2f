#!/usr/bin/env bash
# For the next session (written in the thirty-fourth, not yet run). On an H200: the fused KDA front (the H100's product,
# never run there): its GPU test, then its A/B at 32K beside the H200's product, with the producer warp's selection. On
# an H100: why the producer warp's selection (warp_select) wins alone and loses in the step (dev/lab_session87.sh): the
# MoE kernel alone with the step's gate_up window of 3 tiles, with and without it, then in the step without the window,
# with and without it. Results under $OUT: [gpu_tests.log,] ab.{log,json}[, moe_router.log].
# timeout_s LAB_SECONDS + 20.
LAB_DEFAULT_SECONDS=200
source dev/lab_prelude.sh
if nvidia-smi -L | grep -q H200; then
    gpu_tests 80 tests/test_gpu_fused_step.py tests/test_cuda_moe.py -k "fused_kda_front or warp_select" -s
    grep -E "worst rel" "$OUT/gpu_tests.log" | head -1
    ab ab "product;KDA front fused, ring of 3, g last;MoE warp selection;product again;KDA front fused, ring of 4, g last" \
        --deadline "$(($(left) - 20))"
else
    moe_router 90 "selection done|producer has|first gate_up|last gate_up|block end|router|checks" --rounds 3 \
        --configs "gate_up_window=3;gate_up_window=3,warp_select=1"
    ab ab "product;MoE warp selection, no gate_up window;MoE no gate_up window;MoE warp selection;product again" \
        --deadline "$(($(left) - 20))"
fi

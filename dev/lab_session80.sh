#!/usr/bin/env bash
# For the thirty-first session, when machines are scarce: dev/lab_session78.sh and 79.sh's first part in one call.
# On an H200 (once the H100 had measured the early experts as neutral: only the rings): the GPU test of verification
# through the window rings, their A/B at 32K (twice) and, time allowing, the L2 asks after the MoE copies (the H100's
# product, L2_NEXT_CARDS; -6.8 us once on the H200, h200_ab_lab70.log), then the product's bench at 32K with the H200
# added to WINDOW_RING_CARDS in this machine's copy of the tree. On an H100: the early experts' GPU tests, the MoE
# kernel alone traced with them, and their A/B. Results under $OUT: gpu_tests.log, [moe_router.log], ab.{log,json},
# [bench.{log,json}]. timeout_s LAB_SECONDS + 30.
LAB_DEFAULT_SECONDS=420
source dev/lab_prelude.sh
e="MoE experts before the weights"
if nvidia-smi -L | grep -q H200; then
    gpu_tests 170 tests/test_gpu_fused_step.py -k window_rings
    w="window ring: qkvfgb, q|kv_a|g, MLP"
    l="L2 next: shared + 16 MB, after the copies"
    ab ab "product;$w;product again;$w, again;$l;L2 next: shared + 32 MB, after the copies;$l, again" \
        --deadline "$(($(left) - 130))"
    sed -i 's/^WINDOW_RING_CARDS = ("NVIDIA H100 80GB HBM3",)$/WINDOW_RING_CARDS = ("NVIDIA H100 80GB HBM3", "NVIDIA H200")/' \
        solo/kernels/cuda_step.py
    grep -n "^WINDOW_RING_CARDS" solo/kernels/cuda_step.py
    PREFILL="" product_bench 32768 128
else
    gpu_tests 120 tests/test_cuda_moe.py -k early_ids
    moe_router 90 "^  router inside|selection done|producer has|first gate_up tile landed|block end|checks" \
        --rounds 3 --calls 16 --configs "gate_up_window=3;gate_up_window=3,early_ids=1"
    ab ab "product;$e;product again;$e, again" --deadline "$(($(left) - 20))"
fi

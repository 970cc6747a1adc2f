#!/usr/bin/env bash
# For the thirty-first session, on an H200: should verification's big projections stream through the window rings
# there too (solo.kernels.cuda_step.WINDOW_RING_CARDS, the H100's since the seventeenth session)? The thirtieth
# session's A/B put them at -182 us on the H200's verification at 32K (decode +1.6; h200_ab_lab77.log; lab70 -159), but
# their GPU test failed there once, 0.17 off the reference and 3.8e-3 off the register path (h200_gpu_tests_lab77.log);
# the test now draws a layer again where the reference came within LAYER_TIE_MARGIN of an expert tie. So: the fused
# step's and the CUDA step kernels' GPU tests on the H200, then the A/B of the rings twice, then (on this machine's
# copy of the tree only) the H200 added to WINDOW_RING_CARDS and the product's bench at 32K with them. On an H100:
# nothing (its product has the rings). Results under $OUT: gpu_tests.log, ab.{log,json}, bench.{log,json}.
# timeout_s LAB_SECONDS + 30.
LAB_DEFAULT_SECONDS=560
source dev/lab_prelude.sh
if ! nvidia-smi -L | grep -q H200; then
    echo "not an H200: nothing to run"
    exit 0
fi
gpu_tests 260 tests/test_gpu_fused_step.py tests/test_gpu_cuda_step.py
w="window ring: qkvfgb, q|kv_a|g, MLP"
ab ab "product;$w;product again;$w, again" --deadline "$(($(left) - 200))"
sed -i 's/^WINDOW_RING_CARDS = ("NVIDIA H100 80GB HBM3",)$/WINDOW_RING_CARDS = ("NVIDIA H100 80GB HBM3", "NVIDIA H200")/' \
    solo/kernels/cuda_step.py
grep -n "^WINDOW_RING_CARDS" solo/kernels/cuda_step.py
PREFILL="" product_bench 32768 128

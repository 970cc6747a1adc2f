#!/usr/bin/env bash
# The fused KDA front with the layer's output projection inside the same launch (kda_front.cu OPROJ,
# FusedDecodeStep.fuse_kda_front(o_proj=True)): its GPU test (the same bits as the front followed by the output
# projection's GEMV, rings of 4 and 2; then the front's own builds against the two kernels), then its A/B in the decode
# step at 32K beside the product and the ring builds without it. Any card. Results under $OUT: gpu_tests.log, ab.{log,json}.
# timeout_s LAB_SECONDS + 30.
LAB_DEFAULT_SECONDS=540
source dev/lab_prelude.sh
gpu_tests 200 tests/test_gpu_fused_step.py -k fused_kda_front -s
grep -E "worst rel|Error|assert" "$OUT/gpu_tests.log" | head -5
f="KDA front fused, global exchange"
ab ab "product;$f, ring of 4;$f, ring of 4, o_proj inside;product again;$f, ring of 3, o_proj inside;$f, ring of 2, o_proj inside;$f, ring of 4, o_proj inside" \
    --deadline "$(($(left) - 120))"

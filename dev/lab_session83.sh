#!/usr/bin/env bash
# The fused KDA front's ring builds with the layer's output projection inside the same launch (kda_front.cu OPROJ) and
# with the g rows streamed after the recurrence (GLAST): the GPU test (the same bits as the front followed by the output
# projection's GEMV, rings of 4 and 3; the front's builds against the two kernels), then the A/B in the decode step at
# 32K beside the product. Any card. Results under $OUT: gpu_tests.log, ab.{log,json}. timeout_s LAB_SECONDS + 30.
LAB_DEFAULT_SECONDS=540
source dev/lab_prelude.sh
gpu_tests 200 tests/test_gpu_fused_step.py -k fused_kda_front -s
grep -E "worst rel|Error|assert" "$OUT/gpu_tests.log" | head -5
f="KDA front fused"
ab ab "product;$f, ring of 4, again;$f, ring of 4, g last;$f, ring of 3, g last;product again;$f, ring of 3, g last, o_proj inside;$f, ring of 4, g last, again" \
    --deadline "$(($(left) - 100))"

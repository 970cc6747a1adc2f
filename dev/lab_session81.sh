#!/usr/bin/env bash
# For the thirty-second session: one token's KDA front as one launch (solo/kernels/cuda/kda_front.cu, a cluster a head):
# its GPU test against the CUDA GEMV + Triton recurrence, then its A/B in the decode step at 32K (2 and 1 tasks'
# loads in flight, the product twice). Any card. Results under $OUT: gpu_tests.log, ab.{log,json}.
# timeout_s LAB_SECONDS + 30.
LAB_DEFAULT_SECONDS=540
source dev/lab_prelude.sh
gpu_tests 200 tests/test_gpu_fused_step.py -k fused_kda_front -s
grep -E "worst rel|passed|failed|Error" "$OUT/gpu_tests.log" | head -5
f="KDA front fused"
ab ab "product;$f;product again;$f, 1 task ahead;$f, again" --deadline "$(($(left) - 120))"

#!/usr/bin/env bash
# For the thirty-second session: one token's KDA front as one launch (solo/kernels/cuda/kda_front.cu): its GPU test
# against the CUDA GEMV + Triton recurrence (three builds, both exchanges), the front alone against the pair
# (dev/kda_front_probe.py: registers, resident clusters, us a layer over 35 layers of distinct weights), then its A/B
# in the decode step at 32K against the product. Any card. Results under $OUT: gpu_tests.log, probe.log, ab.{log,json}.
# timeout_s LAB_SECONDS + 30. (The session ran these parts in separate calls; the variants below are the ones that
# measured best there, each beside the product once.)
LAB_DEFAULT_SECONDS=540
source dev/lab_prelude.sh
gpu_tests 150 tests/test_gpu_fused_step.py -k fused_kda_front -s
grep -E "worst rel" "$OUT/gpu_tests.log" | head -1
timeout 150 python3 dev/kda_front_probe.py --builds 2:1:10:0:g,1:2:10 > "$OUT/probe.log" 2>&1
grep -v Warning "$OUT/probe.log"
f="KDA front fused"
ab ab "product;$f, global exchange;product again;$f, 1 task ahead, 2 blocks/SM build" --deadline "$(($(left) - 120))"

#!/usr/bin/env bash
# The fused KDA front (solo/kernels/cuda/kda_front.cu, FusedDecodeStep.fuse_kda_front): its GPU test against the CUDA
# GEMV + Triton recurrence (four builds: both exchanges, the register path and the shared-memory ring), the front
# alone against the pair (dev/kda_front_probe.py: registers, resident clusters, us a layer over 35 layers of distinct
# weights; its default builds: the global exchange's register path and rings of 4, 3 and 2 slots), then its A/B in the
# decode step at 32K beside the product. Any card. Results under $OUT: gpu_tests.log, probe.log, ab.{log,json}.
# timeout_s LAB_SECONDS + 30. The thirty-second session ran the register builds' parts in separate H100 calls
# (docs/results/h100_kda_front_lab82.log); the ring builds are new and have not run on a GPU.
LAB_DEFAULT_SECONDS=540
source dev/lab_prelude.sh
gpu_tests 170 tests/test_gpu_fused_step.py -k fused_kda_front -s
grep -E "worst rel" "$OUT/gpu_tests.log" | head -1
timeout 150 python3 dev/kda_front_probe.py > "$OUT/probe.log" 2>&1
grep -v Warning "$OUT/probe.log"
f="KDA front fused, global exchange"
ab ab "product;$f;$f, ring of 4;product again;$f, ring of 3" --deadline "$(($(left) - 120))"

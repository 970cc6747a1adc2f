#!/usr/bin/env bash
# Twenty-ninth session, after the experts-ahead switch was taken out: on an H200 lab_session72 (the product's bench at
# 4K and 32K with the Gluon ring and the gate_up window, then its A/B); on an H100 the fused step's and the CUDA step
# kernels' GPU tests on the tree without the switch. Results under $OUT: bench.{log,json}, ab.{log,json} or
# gpu_tests.log. timeout_s LAB_SECONDS + 30.
LAB_DEFAULT_SECONDS=300
if nvidia-smi -L | grep -q H200; then
    source dev/lab_session72.sh
    exit 0
fi
source dev/lab_prelude.sh
gpu_tests $(($(left) - 5)) tests/test_gpu_fused_step.py tests/test_gpu_cuda_step.py -rfE

#!/usr/bin/env bash
# Twenty-second session, sixth H100 call (an H200 runs dev/lab_session37.sh instead): the lean selection as the
# product's (DecodeKernelConfig.lean_select and CudaRouter.lean_select on). Every GPU test of the persistent MoE
# kernel, the CUDA router and the fused step, then one process at 32K against the selection as before (the MoE
# kernel's alone, and with the verification router's). Results under $OUT: gpu_tests.log, ab.{log,json}.
# timeout_s 600.
nvidia-smi -L | grep -q H200 && exec bash dev/lab_session37.sh
LAB_DEFAULT_SECONDS=585
source dev/lab_prelude.sh
gpu_tests 240 tests/test_cuda_moe.py tests/test_gpu_fused_step.py \
    "tests/test_gpu_cuda_step.py::test_the_router_chooses_as_the_reference"
default="product;MoE selection as before;MoE and router selection as before;product again"
ab ab "${VARIANTS:-$default}" --deadline "${AB_DEADLINE:-$(($(left) - 10))}"

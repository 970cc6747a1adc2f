#!/usr/bin/env bash
# Twenty-second session, fifth H100 call (an H200 runs dev/lab_session37.sh instead): lab52's clock stamps put 1.7 us
# (3,150 cycles) of the selection's 3.2 in ranking the 8 groups, a step of about 190 instructions that the compiler
# builds with its predicates spilled to a register; with its instructions cached (select_twice) 0.7 us. Under
# fast_select only the ballot of the kept groups is used: DecodeKernelConfig.lean_select ranks them once (87
# instructions). The router-inside GPU tests (lean_select among them), the kernel alone with its trace, then one
# process at 32K. Results under $OUT: gpu_tests.log, moe_router.log, ab.{log,json}. timeout_s 600.
nvidia-smi -L | grep -q H200 && exec bash dev/lab_session37.sh
LAB_DEFAULT_SECONDS=585
source dev/lab_prelude.sh
gpu_tests 150 tests/test_cuda_moe.py -k "router_inside_the_kernel_chooses"
moe_router 110 "checks|^  router|groups ranked" --rounds 3 --configs "gate_up_window=3;gate_up_window=3,lean_select=1"
default="product;MoE lean selection;product again;MoE lean selection, again"
ab ab "${VARIANTS:-$default}" --deadline "${AB_DEADLINE:-$(($(left) - 10))}"

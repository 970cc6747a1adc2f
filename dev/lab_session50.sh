#!/usr/bin/env bash
# Twenty-second session, second H100 call (an H200 runs dev/lab_session37.sh instead): the MoE kernel's score
# exchange. Lab43's trace put 1.5 us between a block's first score in hand and every score seen, though the last
# block published 0.1 us after the median one. New trace stamps say when each block's first and last selection
# warp had all its scores and how many loads its slowest lane issued; DecodeKernelConfig.score_stagger keeps four
# loads of a score in flight instead of one round trip after another. The router-inside GPU tests (the staggered
# polls choose as the reference, bit for bit the kernel given that routing), the kernel alone with its trace, then
# one process at 32K. Results under $OUT: gpu_tests.log, moe_router.log, ab.{log,json}. timeout_s 600.
nvidia-smi -L | grep -q H200 && exec bash dev/lab_session37.sh
LAB_DEFAULT_SECONDS=585
source dev/lab_prelude.sh
gpu_tests 150 tests/test_cuda_moe.py -k "router_inside_the_kernel_chooses"
moe_router 110 "^  router|checks|score" --rounds 2 \
    --configs "gate_up_window=3;gate_up_window=3,score_stagger=128;gate_up_window=3,score_stagger=64"
default="product;MoE scores: 4 loads in flight, 128 ns apart;MoE scores: 4 loads in flight, 64 ns apart;product again"
default+=";MoE scores: 4 loads in flight, 128 ns apart, again"
ab ab "${VARIANTS:-$default}" --deadline "${AB_DEADLINE:-$(($(left) - 10))}"

#!/usr/bin/env bash
# For the thirty-fourth session: the producer warp's selection (DecodeKernelConfig.warp_select, moe_decode.cu
# WARP_SELECT). Its GPU tests (the router test's row against the fp32 reference at four router shapes, and exact ties
# against the selection warps' choice), the MoE kernel alone with its router, checked bit for bit against the product's
# and traced (dev/moe_router_ab.py), then its A/B in the decode step at 32K. On an H200 the A/B also runs the fused
# KDA front (the H100's product, never run there: its GPU test first); on an H100 the A/B also runs two variants of
# dev/lab_session86.sh (the front asking the L2 for the output projection's weight, the MoE kernels asking for all of
# the next front's q and k rows). Results under $OUT: gpu_tests.log, moe_router.log, ab.{log,json}.
# timeout_s LAB_SECONDS + 20.
LAB_DEFAULT_SECONDS=480
source dev/lab_prelude.sh
w="MoE warp selection"
if nvidia-smi -L | grep -q H200; then
    gpu_tests 150 tests/test_cuda_moe.py tests/test_gpu_fused_step.py -k "warp_select or fused_kda_front"
    moe_router 90 "selection done|every score|producer has|first gate_up|block end|router|checks" --rounds 3 \
        --configs "warp_select=1"
    ab ab "product;$w;KDA front fused, ring of 3, g last;product again;$w, again" --deadline "$(($(left) - 40))"
else
    gpu_tests 120 tests/test_cuda_moe.py -k "warp_select"
    moe_router 90 "selection done|every score|producer has|first gate_up|block end|router|checks" --rounds 3 \
        --configs "warp_select=1"
    f="KDA front, o_proj weights asked of the L2 after the b task"
    ab ab "product;$w;$f;product again;$w, again;L2 next: shared + 21 MB, after the copies" --deadline "$(($(left) - 40))"
fi

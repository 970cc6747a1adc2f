#!/usr/bin/env bash
# (Ran at 55b3da2, whose DecodeKernelConfig.joint_pairs and select_sub and their A/B variants were taken out again after
# they lost: check that commit out to run it again.)
# Twenty-third session, first H100 call (an H200 runs dev/lab_session37.sh instead): the last slot pairs' down products
# in one pass (DecodeKernelConfig.joint_pairs, moe_decode.cu JOINT_PAIRS). Lab43's trace: after the first pair, a pair
# about every 1 us, 0.2-0.35 us of it the poll round's barrier and the rows' wait, and every activation in soon after
# the last gate_up tile anywhere. Also each selection candidate ranked by 8 threads, not 4 (select_sub). The
# persistent kernel's variant tests (bit for bit against the product's) and the router-inside tests, one process at 32K,
# then the kernel alone with its trace. Results under $OUT: gpu_tests.log, moe_router.log, ab.{log,json}.
# timeout_s 600.
nvidia-smi -L | grep -q H200 && exec bash dev/lab_session37.sh
LAB_DEFAULT_SECONDS=585
source dev/lab_prelude.sh
gpu_tests 150 tests/test_cuda_moe.py -k "window_balance or (chooses and True-True-True-0-True)"
default="product;MoE joint pairs 3;MoE joint pairs 4;product again;MoE candidates ranked by 8 threads;MoE joint pairs 2"
ab ab "${VARIANTS:-$default}" --deadline "${AB_DEADLINE:-$(($(left) - ${ROUTER_SECONDS:-120}))}"
moe_router $(($(left) - 5)) "checks|^  router|down products done|block end" --rounds 3 \
    --configs "gate_up_window=3;gate_up_window=3,joint_pairs=3;gate_up_window=3,joint_pairs=4;gate_up_window=3,select_sub=8"


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
timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_cuda_moe.py -m gpu -k "router_inside_the_kernel_chooses" \
    > "$OUT/gpu_tests.log" 2>&1
echo "[GPU tests rc=$? at ${SECONDS}s]"; tail -3 "$OUT/gpu_tests.log"
timeout 110 python3 dev/moe_router_ab.py --rounds 2 \
    --configs "gate_up_window=3;gate_up_window=3,score_stagger=128;gate_up_window=3,score_stagger=64" \
    > "$OUT/moe_router.log" 2>&1
echo "[moe_router rc=$? at ${SECONDS}s]"; grep -v Warning "$OUT/moe_router.log" | grep -E "^  router|checks|score" | head -20
default="product;MoE scores: 4 loads in flight, 128 ns apart;MoE scores: 4 loads in flight, 64 ns apart;product again"
default+=";MoE scores: 4 loads in flight, 128 ns apart, again"
ab ab "${VARIANTS:-$default}" --deadline "${AB_DEADLINE:-$(($(left) - 10))}"

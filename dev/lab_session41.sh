#!/usr/bin/env bash
# Twentieth session, fifth call: the MoE kernel's copy window over the down copies too. lab40: with 3 gate_up tiles in
# flight the tiles land one after another and the kernel takes 18.6 against 19.2 us alone (-8 to -11 us a decode step
# at 32K), but the down copies, issued once all of a block's gate_up tiles have landed (down_after 7), land at 14-16 us
# and the down products wait for them. DecodeKernelConfig.window_downs: one window over every copy group in issue order
# (the downs follow the last gate_up tiles by the window), in the product's order and in need order. GPU tests, the
# routing's trace (moe_router.log), one process at 32K. Results under $OUT: gpu_tests.log, moe_router.log,
# ab.{log,json}. timeout_s 600.
LAB_DEFAULT_SECONDS=585
source dev/lab_prelude.sh
timeout 120 python3 -m pytest -q -p no:cacheprovider tests/test_cuda_moe.py -k "gate_up_window" \
    > "$OUT/gpu_tests.log" 2>&1
echo "[GPU tests rc=$? at ${SECONDS}s]"; tail -2 "$OUT/gpu_tests.log"
a="gate_up_window=3,window_downs=1,down_after=0"
timeout 110 python3 dev/moe_router_ab.py --rounds 3 --per-block \
    --configs "gate_up_window=3;$a;$a,order=need;gate_up_window=2,window_downs=1,down_after=0;gate_up_window=4,window_downs=1,down_after=0" \
    > "$OUT/moe_router.log" 2>&1
echo "[moe_router rc=$? at ${SECONDS}s]"; grep -v Warning "$OUT/moe_router.log" | grep -E "^  router|^trace|last gate_up tile landed  |down products done|block end" | head -40
w="MoE window"
mine="MoE gate_up window 3;$w 3 over all copies;$w 3 over all copies in need order;$w 4 over all copies"
mine+=";$w 2 over all copies;$w 4 over all copies in need order;product again;$w 3 over all copies, again"
ab ab "product;${VARIANTS:-$mine}" --deadline "${AB_DEADLINE:-$(($(left) - 15))}"

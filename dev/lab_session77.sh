#!/usr/bin/env bash
# Thirtieth session, for an H200: its MoE kernel's copy schedule. The H200 streams the MoE kernel's 25 MB at about half
# its copy bandwidth (the twelfth session's trace: 11 us from the selection to the block's end), where the H100 is near
# its own; of the copy-schedule switches tuned on the H100 (the down copies after every gate_up tile, the window over
# all copies, the need order) the H200 has run only the gate_up window. So: the A/B at 32K of those switches (each
# bit for bit the product's results), then the product's bench at 4K and 32K (the Gluon ring and the gate_up window
# never benched on the H200), then the MoE kernel alone traced with the schedules where time is left. On an H100 (its
# history has these A/Bs): the MoE kernel alone traced with them. (The copies-only probe waits forever with the router
# inside, which has no gate_up warps to route with there: moe_decode.cu now refuses to build it.) Results under $OUT:
# ab.{log,json}, bench.{log,json}, moe.log. timeout_s LAB_SECONDS + 30.
LAB_DEFAULT_SECONDS=470
source dev/lab_prelude.sh
moe_alone() {  # CONFIGS: the MoE kernel alone (16 calls; the product and CONFIGS) into $OUT/moe.log, 90 s at most
    timeout 90 python3 dev/moe_router_ab.py --rounds 3 --calls 16 --configs "$1" > "$OUT/moe.log" 2>&1
    echo "[moe rc=$? at ${SECONDS}s]"
    grep -E "^  [a-z]|^checks|^trace" "$OUT/moe.log" | grep -E "checks|trace|router|tile landed|selection done|block end"
}
if ! nvidia-smi -L | grep -q H200; then
    echo "not an H200: the MoE kernel alone with the down copies at once and in the window"
    moe_alone "gate_up_window=3;gate_up_window=3,down_after=0;gate_up_window=3,window_downs=1,down_after=0"
    exit 0
fi
w="window ring: qkvfgb, q|kv_a|g, MLP"  # (verification's big projections through the ring: -159 us there in lab70)
ab ab "product;MoE downs at once;MoE window 3 over all copies;MoE gate_up window 3, downs after 2 tiles;\
MoE gate_up window 4;product again;$w" --deadline "$(($(left) - 230))"
PREFILL="" product_bench 4096,32768 128
[ "$(left)" -gt 100 ] && moe_alone "gate_up_window=3;gate_up_window=3,down_after=0;\
gate_up_window=3,window_downs=1,down_after=0"

#!/usr/bin/env bash
# Twentieth session, seventh call. The MoE kernel's down phase, slot pair by slot pair (moe_router_ab.py --per-block
# now prints when warp 0 entered each pair, had its activations staged, its down rows there, its products done), for
# the tiles all at once and the window of 3 (the H100's product since e96d007): with the window, the down copies land
# last (14-16 us) and the down products follow. Then one process at 32K: with the window, the down copies at once,
# the MoE kernels' L2 asks (8 / 32 MB instead of 16). Results under $OUT: moe_router.log, ab.{log,json}.
# timeout_s 600.
LAB_DEFAULT_SECONDS=585
source dev/lab_prelude.sh
timeout 100 python3 dev/moe_router_ab.py --rounds 1 --per-block --configs "gate_up_window=3" > "$OUT/moe_router.log" 2>&1
echo "[moe_router rc=$? at ${SECONDS}s]"; grep -v Warning "$OUT/moe_router.log" | grep -E -A6 "down phase|^trace" | head -60
v="MoE downs at once;L2 next: shared + 8 MB, after the copies;L2 next: shared + 32 MB, after the copies;product again"
ab ab "product;${VARIANTS:-$v}" --deadline "${AB_DEADLINE:-$(($(left) - 15))}"

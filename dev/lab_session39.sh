#!/usr/bin/env bash
# Twentieth session, third call. Any card: the MoE kernel's routing traced block by block (moe_router.log, the product
# and the gate_up-balanced schedule): lab38 found that the last gate_up tile lands 11 to 15 us into the call whether a
# block holds 7 tiles or 6, so what do the late blocks have in common (SM, tiles, when they issued, when their first
# tile landed)? Then on an H200 only, dev/lab_session37.sh's runs (steady probe, A/B, bench with prefills).
# Results under $OUT: moe_router.log (+ on an H200: steady.log, ab.{log,json}, bench.{log,json}). timeout_s 600.
LAB_DEFAULT_SECONDS=585
source dev/lab_prelude.sh
timeout 100 python3 dev/moe_router_ab.py --rounds 1 --per-block --configs "balance=gate_up,x_in_tiles=1" \
    > "$OUT/moe_router.log" 2>&1
echo "[moe_router rc=$? at ${SECONDS}s]"; grep -v Warning "$OUT/moe_router.log" | grep -A30 "per block" | head -70
nvidia-smi -L | grep -q H200 || exit 0
LAB_SECONDS=$(left) bash dev/lab_session37.sh

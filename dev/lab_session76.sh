#!/usr/bin/env bash
# For the thirtieth session: on an H200 first lab_session72 (the product's bench at 4K and 32K with the Gluon ring and
# the gate_up window, then its A/B) in all but the last 70 s; then, on any Hopper card, the MoE kernel alone traced
# with one call replayed against 16, each also with its weight copies' L2 evict-first policy off (`evict_first=0`):
# do the gate_up tiles land sooner when the experts are in the L2? (the twenty-ninth session's trace could not say,
# as the evict-first copies need not leave a call's experts there). Results under $OUT: bench.{log,json},
# ab.{log,json} (H200), moe_warm.log, moe_cold.log. timeout_s LAB_SECONDS + 30.
LAB_DEFAULT_SECONDS=300
total=${LAB_SECONDS:-$LAB_DEFAULT_SECONDS}
if nvidia-smi -L | grep -q H200 && [ "$total" -gt 200 ]; then
    LAB_SECONDS=$((total - 70)) bash dev/lab_session72.sh
    total=70
fi
LAB_SECONDS=$total
source dev/lab_prelude.sh
for side in warm:1 cold:16; do
    [ "$(left)" -lt 20 ] && break
    timeout $((($(left) - 5) / 2)) python3 dev/moe_router_ab.py --rounds 3 --calls "${side#*:}" \
        --configs "evict_first=0" > "$OUT/moe_${side%:*}.log" 2>&1
    echo "[moe ${side%:*} rc=$? at ${SECONDS}s]"
    grep -E "^  [a-z]|^checks|^trace" "$OUT/moe_${side%:*}.log" | grep -E "checks|trace|router|tile landed|selection done|block end"
done

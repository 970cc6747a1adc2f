#!/usr/bin/env bash
# Twenty-eighth session: how much naming a MoE layer's experts early could give (any Hopper card; after
# lab_session72.sh on an H200, on the same warm machine). Two measurements, about 200 s:
# 1. dev/routing_prediction_probe.py at full shape (42 layers, random weights as the bench): the fraction of each
#    layer's chosen experts that its router names from the layer's input (before the attention) and from the
#    previous token's choice;
# 2. dev/moe_router_ab.py with one token replayed (--calls 1: its experts in the L2 from the replay before) against
#    16 tokens (most experts not in the L2): what the MoE kernel gains when its experts are in the L2, with the
#    per-block trace (first and last gate_up tile, slot pairs). The upper bound of an L2 prefetch of the layer's
#    experts, before any cost of predicting them.
# Results under $OUT: routing_prediction.log, moe_warm.log, moe_cold.log. timeout_s LAB_SECONDS + 30.
LAB_DEFAULT_SECONDS=240
source dev/lab_prelude.sh
timeout $(($(left) - 100)) python3 dev/routing_prediction_probe.py --tokens 32 --prompt 16 \
    > "$OUT/routing_prediction.log" 2>&1
echo "[routing prediction rc=$? at ${SECONDS}s]"; grep -v Warning "$OUT/routing_prediction.log" | tail -4
for side in warm:1 cold:16; do
    timeout $((($(left) - 5) / 2)) python3 dev/moe_router_ab.py --rounds 3 --calls "${side#*:}" \
        > "$OUT/moe_${side%:*}.log" 2>&1
    echo "[moe ${side%:*} rc=$? at ${SECONDS}s]"
    grep -E "^  |^checks" "$OUT/moe_${side%:*}.log" | grep -v Warning | head -40
done

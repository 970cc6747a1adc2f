#!/usr/bin/env bash
# (Run in the twenty-ninth session on an H100; the experts-ahead switch lost and was taken out after it, so its variants
# and GPU test named here no longer exist: docs/kernels-history.md, twenty-ninth session.)
# Twenty-eighth session: what naming a MoE layer's experts before its routing could give (any Hopper card).
# 1. the A/B at 32K: the output projections asking for the experts the layer's MoE kernel chose at the replay before
#    (one token at one position: nearly the replay's own experts, so an upper bound of any prediction; on random
#    weights the layer's input names 0.84 of them, docs/results/cpu_routing_prediction.log), gate_up with and without
#    its scales, and with the down weights; then, in a process of its own, the same with the experts the output
#    projection chooses itself from the router's logits on the layer's input (source "predicted": the prediction,
#    with the cost of the router's 512 rows in the input projection);
# 2. the GPU test of FusedDecodeStep.ask_experts_ahead (gemv_decode.cu EXPERT_ASK: each layer's output projection
#    asks the L2 for its MoE kernel's experts before its wait), results bit for bit;
# 3. as time allows, the MoE kernel alone with one token replayed (its experts in the L2) against 16
#    (dev/moe_router_ab.py --calls 1 / 16).
# Results under $OUT: ab.{log,json}, ab_predicted.{log,json}, gpu_tests.log, moe_warm.log, moe_cold.log.
# timeout_s LAB_SECONDS + 30.
LAB_DEFAULT_SECONDS=560
source dev/lab_prelude.sh
x="experts ahead: the last step's gate_up"
p="experts ahead: predicted gate_up"
if [ "$(left)" -lt 350 ]; then  # (a short call: the A/B alone, whose output checks are bit for bit)
    ab ab "product;$x;product again;$p;$x, again" --deadline "$(($(left) - 70))"
    exit 0
fi
ab ab "product;$x;product again;$x and down" --deadline "$(($(left) - 350))"
# (the prediction in a process of its own: a fault there loses only its own numbers)
ab ab_predicted "product;$p;product again;$p and down;$p, again" --deadline "$(($(left) - 180))"
gpu_tests $(($(left) - 5)) tests/test_gpu_fused_step.py -k "experts or l2" -rfE
for side in warm:1 cold:16; do
    [ "$(left)" -lt 40 ] && break
    timeout $((($(left) - 5) / 2)) python3 dev/moe_router_ab.py --rounds 3 --calls "${side#*:}" \
        > "$OUT/moe_${side%:*}.log" 2>&1
    echo "[moe ${side%:*} rc=$? at ${SECONDS}s]"
    grep -E "^  [a-z]|^checks" "$OUT/moe_${side%:*}.log" | head -30
done

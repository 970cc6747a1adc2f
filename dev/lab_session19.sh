#!/usr/bin/env bash
# Fifteenth session. The MoE kernel's down copies after the block's gate_up tiles (DOWN_AFTER 7) and its
# expert biases read before the wait (BIAS_EARLY) are the product's now (-26.5 and -28.0 us at 32K on the
# H100, h100_ab_lab18.log), and its gate_up warps load x before the inputs' barrier (x and the launch number
# were two L2 round trips in a row). New lab switches: a grid-wide gate on the down copies (DOWN_GATE: a block
# issues them once that share of the blocks have all their gate_up tiles landed) and the output projections
# at more blocks an SM (GemvLaunch.min_blocks: at 16 warps they build to 74 registers, one block an SM, so 56
# of their 132 blocks run a third task). First the GPU tests of all that, then the routing trace of the
# product and the gates, then one process at 32K, every variant's logits against the product's.
# Results under $OUT: gpu_tests.log, moe_router.log, ab.{log,json}. Say which card ran it. timeout_s 600.
LAB_DEFAULT_SECONDS=560
source dev/lab_prelude.sh
timeout 100 python3 -m pytest -q -p no:cacheprovider tests/test_cuda_moe.py > "$OUT/gpu_tests.log" 2>&1
echo "[MoE tests rc=$? at ${SECONDS}s]"; tail -2 "$OUT/gpu_tests.log"
timeout 80 python3 -m pytest -q -p no:cacheprovider tests/test_gpu_cuda_step.py -k "more_blocks or SM" \
    >> "$OUT/gpu_tests.log" 2>&1
echo "[GEMV tests rc=$? at ${SECONDS}s]"; tail -2 "$OUT/gpu_tests.log"
if [ "$(left)" -gt 330 ]; then  # the routing and the copies step by step: the product, the gates, the fourteenth session's
    timeout 60 python3 dev/moe_router_ab.py --configs "down_gate=100;down_gate=50;bias_early=0,down_after=0" \
        > "$OUT/moe_router.log" 2>&1
    echo "[moe_router rc=$? at ${SECONDS}s]"; grep -v Warning "$OUT/moe_router.log" | grep -E "^ |^checks|^one" | head -90
fi
# (in order of interest: the deadline leaves out the last ones first)
default="MoE as in the fourteenth session;MoE down gate 100%;o_proj, dense: 2 blocks an SM"
default+=";o_proj, dense: 8 warps, 4 in flight, 3 blocks an SM;MoE down gate 50%;product again;MoE down gate 75%"
default+=";o_proj, dense: 8 warps, 4 in flight;MoE bias late;MoE downs at once"
ab ab "product;${VARIANTS:-$default}" --deadline "${AB_DEADLINE:-$(($(left) - 90))}"

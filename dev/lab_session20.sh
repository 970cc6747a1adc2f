#!/usr/bin/env bash
# Fifteenth session, second call. lab_session19.sh (H100): the product with the MoE kernel's biases read early
# and its down copies after the block's gate_up tiles, 2.761 ms at 32K against 2.798 for the fourteenth
# session's MoE kernel (-37.2 us); the output projections at more blocks an SM lost (+27.7 to +52.7 us); the
# grid-wide down gate lost 1.4 ms (its first version: a compare-and-swap count, and a non-router build that did
# not compile). Now: the gate counted with one atomic increment a block, with the trace stamping when a block
# counted in and when its gate opened; and two or three loads of a selection lane's score in flight (SCORE_POLLS);
# and the x loads before the inputs' barrier, not yet measured alone (X_EARLY, variant "MoE x late").
# GPU tests first, then the routing traced step by step, then one process at 32K, then (where 250 s are left)
# the product bench at 4K and 32K with the real loop and prefill. Results under $OUT: gpu_tests.log,
# moe_router.log, ab.{log,json}, bench.{log,json}. Say which card ran it. timeout_s 600.
LAB_DEFAULT_SECONDS=585
source dev/lab_prelude.sh
timeout 100 python3 -m pytest -q -p no:cacheprovider tests/test_cuda_moe.py > "$OUT/gpu_tests.log" 2>&1
echo "[MoE tests rc=$? at ${SECONDS}s]"; tail -2 "$OUT/gpu_tests.log"
if [ "$(left)" -gt 330 ]; then
    timeout 60 python3 dev/moe_router_ab.py --configs "score_polls=2;score_polls=3;down_gate=100;down_gate=50;x_early=0" \
        > "$OUT/moe_router.log" 2>&1
    echo "[moe_router rc=$? at ${SECONDS}s]"; grep -v Warning "$OUT/moe_router.log" | grep -E "^ |^checks|^one|^trace" | head -120
fi
default="MoE 2 score polls in flight;MoE 3 score polls in flight;MoE down gate 100%;MoE x late"
default+=";MoE as in the fourteenth session;MoE down gate 75%;MoE down gate 50%;product again"
ab ab "product;${VARIANTS:-$default}" --deadline "${AB_DEADLINE:-$(($(left) - 330))}"
if [ "$(left)" -gt 250 ]; then
    PREFILL=${PREFILL-1024,8192,32768} product_bench 4096,32768 128
else
    echo "no time left for the bench ($(left) s)"
fi

#!/usr/bin/env bash
# Thirty-seventh session, after dev/lab_session91.sh's H100 half (h100_ab_lab91.log): verification's attention in the
# Gluon ring and its shared gate_up beside its router are now the H100's product (GLUON_WINDOW_CARDS,
# SHARED_BESIDE_CARDS). On either card: the GPU tests of the shared gate_up beside the router and of NEXTN rounds in
# graphs under PDL (which run with the card's product); the product's bench at 32K; with time left the A/B at 32K of
# the product against each turned off, twice (under 300 s: the bench first, then the PDL test only). Results under
# $OUT: gpu_tests.log, bench.{log,json}[, ab.{log,json}].
# timeout_s LAB_SECONDS + 20.
LAB_DEFAULT_SECONDS=330
source dev/lab_prelude.sh
if [ "$(left)" -lt 300 ]; then  # (a short call: the product's bench, then NEXTN rounds in graphs under PDL)
    product_bench 32768 16 70
    [ "$(left)" -gt 60 ] && gpu_tests $(($(left) - 5)) tests/test_gpu_fused_step.py -k "pdl_launches"
    exit 0
fi
gpu_tests 100 tests/test_gpu_fused_step.py -k "beside or pdl_launches"
grep -E "worst|FAILED|passed|failed" "$OUT/gpu_tests.log" | head -12
[ "$(left)" -gt 140 ] && product_bench 32768 16 "$( [ "$(left)" -gt 330 ] && echo 150 || echo 5 )"
if [ "$(left)" -gt 140 ]; then
    t="MLA verification: Triton"
    a="shared gate_up after the router"
    ab ab "product;$t;$a;product again;$t, again;$a, again" --deadline "$(($(left) - 80))"
fi

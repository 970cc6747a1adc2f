#!/usr/bin/env bash
# Thirty-seventh session, after dev/lab_session91.sh's H100 half (h100_ab_lab91.log): verification's attention in the
# Gluon ring and its shared gate_up beside its router are now the H100's product (GLUON_WINDOW_CARDS,
# SHARED_BESIDE_CARDS). On either card: the GPU tests of both and of NEXTN rounds in graphs under PDL (which run with
# the card's product); the A/B at 32K of the product against each turned off, twice; then the product's bench at 32K.
# Results under $OUT: gpu_tests.log, ab.{log,json}, bench.{log,json}. timeout_s LAB_SECONDS + 20.
LAB_DEFAULT_SECONDS=420
source dev/lab_prelude.sh
gpu_tests 130 tests/test_gpu_fused_step.py -k "beside or several_tokens or pdl_launches or speculation_on_the_fused"
grep -E "worst|FAILED|passed|failed" "$OUT/gpu_tests.log" | head -12
t="MLA verification: Triton"
a="shared gate_up after the router"
ab ab "product;$t;$a;product again;$t, again;$a, again" --deadline "$(($(left) - 170))"
[ "$(left)" -gt 120 ] && product_bench 32768 16

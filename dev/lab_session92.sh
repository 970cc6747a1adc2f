#!/usr/bin/env bash
# Thirty-sixth session, short calls (little device time left after failed starts): the GPU tests of verification's
# attention in the Gluon ring and of the KDA recurrence's splits of one warp, then the A/B at 32K of both beside the
# product, twice (on an H200 or an H100 alike). Results under $OUT: gpu_tests.log, ab.{log,json}. timeout_s
# LAB_SECONDS + 20.
LAB_DEFAULT_SECONDS=300
source dev/lab_prelude.sh
v="MLA verification: Gluon ring"
k="KDA verification: 16 splits of 1 warp"
s="shared gate_up beside the router"  # (thirty-seventh session)
gpu_tests 90 tests/test_gpu_fused_step.py -k "several_tokens or more_programs_per_kda or beside"
grep -E "worst|FAILED" "$OUT/gpu_tests.log" | head -12
ab ab "product;$v;$k;$s;product again;$v, again;$k, again;$s, again" --deadline "$(($(left) - 60))"

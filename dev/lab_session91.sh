#!/usr/bin/env bash
# Thirty-sixth session: verification's MLA attention as the Gluon ring (several tokens' rows in programs of 64 or 32)
# and the KDA recurrence's programs on one warp (more value splits), both new, beside the H200's agenda of
# dev/lab_session89.sh. On an H200: the GPU tests of the fused KDA front, the window rings, both Gluon rings and the
# KDA splits; the A/B at 32K of the front (ring of 3, g last), the window rings, the Gluon ring for verification and
# verification's KDA in 16 programs of one warp a head beside the product, twice. On an H100: the Gluon rings' and
# the KDA splits' GPU tests; verification's attention alone (dev/mla_probe.py, 4 tokens at 32K: the product's Triton
# attention, the ring of 64 rows, of 32 rows); the A/B at 32K of both beside the product, twice. (Thirty-seventh
# session, on both cards) the GPU test and the A/B of verification's shared gate_up on a side stream beside its router.
# Results under $OUT: gpu_tests.log, [mla_probe.log,] ab.{log,json}. timeout_s LAB_SECONDS + 20.
LAB_DEFAULT_SECONDS=560
source dev/lab_prelude.sh
v="MLA verification: Gluon ring"
k="KDA verification: 16 splits of 1 warp"
s="shared gate_up beside the router"
if nvidia-smi -L | grep -q H200; then
    gpu_tests 150 tests/test_gpu_fused_step.py -k "fused_kda_front or window_rings or gluon_ring or more_programs_per_kda or beside"
    grep -E "worst|FAILED" "$OUT/gpu_tests.log" | head -16
    f="KDA front fused, ring of 3, g last"
    w="window ring: qkvfgb, q|kv_a|g, MLP"
    ab ab "product;$f;$w;$v;$k;$s;product again;$f, again;$w, again;$v, again;$s, again;KDA one token: 16 splits of 1 warp" \
        --deadline "$(($(left) - 100))"
else
    gpu_tests 150 tests/test_gpu_fused_step.py -k "gluon_ring or more_programs_per_kda or beside"
    grep -E "worst|FAILED" "$OUT/gpu_tests.log" | head -16
    if [ "$(left)" -gt 450 ]; then
        timeout 90 python3 dev/mla_probe.py --tokens 4 --contexts 32768 --changes \
            '[{}, {"gluon": true}, {"gluon": true, "rows_per_program": 32}]' > "$OUT/mla_probe.log" 2>&1
        echo "[mla probe rc=$? at ${SECONDS}s]"; grep -E "^T=" "$OUT/mla_probe.log"
    fi
    ab ab "product;$v;$k;$s;KDA verification: 8 splits of 1 warp;product again;$v, again;$k, again;$s, again;$v, 32 rows" \
        --deadline "$(($(left) - 100))"
fi

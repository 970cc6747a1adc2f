#!/usr/bin/env bash
# Thirty-sixth session: verification's MLA attention as the Gluon ring (several tokens' rows in programs of 64 or 32,
# new), beside the H200's agenda of dev/lab_session89.sh. On an H200: the GPU tests of the fused KDA front, the window
# rings and both Gluon rings; the A/B at 32K of the front (ring of 3, g last), the window rings and the Gluon ring for
# verification beside the product, twice. On an H100: the Gluon rings' GPU tests; verification's attention alone
# (dev/mla_probe.py, 4 tokens at 4K and 32K: the product's Triton attention, the ring of 64 rows, of 32 rows, of 32
# rows at 32 splits); the A/B at 32K of the ring for verification beside the product, twice.
# Results under $OUT: gpu_tests.log, [mla_probe.log,] ab.{log,json}. timeout_s LAB_SECONDS + 20.
LAB_DEFAULT_SECONDS=560
source dev/lab_prelude.sh
v="MLA verification: Gluon ring"
if nvidia-smi -L | grep -q H200; then
    gpu_tests 150 tests/test_gpu_fused_step.py -k "fused_kda_front or window_rings or gluon_ring"
    grep -E "worst" "$OUT/gpu_tests.log" | head -12
    f="KDA front fused, ring of 3, g last"
    w="window ring: qkvfgb, q|kv_a|g, MLP"
    ab ab "product;$f;$w;$v;product again;$f, again;$w, again;$v, again;$v, 32 rows" --deadline "$(($(left) - 100))"
else
    gpu_tests 120 tests/test_gpu_fused_step.py -k "gluon_ring"
    grep -E "worst" "$OUT/gpu_tests.log" | head -12
    timeout 120 python3 dev/mla_probe.py --tokens 4 --contexts 4096,32768 --changes \
        '[{}, {"gluon": true}, {"gluon": true, "rows_per_program": 32}, {"gluon": true, "rows_per_program": 32, "splits": 32}]' \
        > "$OUT/mla_probe.log" 2>&1
    echo "[mla probe rc=$? at ${SECONDS}s]"; grep -E "^T=" "$OUT/mla_probe.log"
    ab ab "product;$v;$v, 32 rows;$v, 2 early;product again;$v, again;$v, 32 rows, 32 splits" \
        --deadline "$(($(left) - 100))"
fi

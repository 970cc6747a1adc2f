#!/usr/bin/env bash
# Twenty-sixth session: one token's MLA attention in Gluon (solo.kernels.gluon_mla, AttendLaunch.gluon): TMA copies
# into a ring of 64-position buffers, each refilled as soon as its products are done, on the warpgroup MMA. First
# alone against the product's Triton attention (outputs compared, 4K and 32K), then its GPU test against the
# reference, then the whole decode step at 32K (A/B in one process). On an H200 the A/B then goes on with what
# lab_session59.sh's H200 branch measures, as far as the time allows.
# Results under $OUT: mla_probe.log, gpu_tests.log, ab.{log,json}. timeout_s LAB_SECONDS + 30.
LAB_DEFAULT_SECONDS=570
source dev/lab_prelude.sh
one='[{}, {"gluon": true}, {"gluon": true, "early_chunks": 0}, {"gluon": true, "ring_buffers": 1}'
one+=', {"gluon": true, "early_chunks": 4}, {"gluon": true, "early_chunks": 4, "ahead_steps": 2}'
one+=', {"gluon": true, "early_chunks": 4, "splits": 64}]'
timeout 150 python3 dev/mla_probe.py --contexts 4096,32768 --tokens 1 --changes "$one" > "$OUT/mla_probe.log" 2>&1
echo "[mla_probe rc=$? at ${SECONDS}s]"; grep -E "^T=|Error|error" "$OUT/mla_probe.log" | head -20
g="MLA one token: Gluon ring"
if grep -Eq "^T=1 ctx= 32768 {'gluon': True}: .* rel err (0\.0e\+00|[0-9.]*e-0[2-9])" "$OUT/mla_probe.log"; then
    gpu_tests 200 tests/test_gpu_fused_step.py -k "gluon" -rfE
    default="$g;$g, 4 early;$g, 4 early, L2 2 ahead;product again;$g, again;$g, 4 early, 64 splits"
    default+=";$g, no early copies"
else  # (the Gluon attention failed or differs alone: the step's A/B without it)
    echo "the Gluon attention did not match alone: no GPU test, no A/B of it"
    default="product again"
fi
if nvidia-smi -L | grep -q H200; then
    big="qkvfgb, q|kv_a|g, MLP"
    default+=";bulk, 2 blocks of 8 warps: $big;8 warps: $big;L2 next: shared + 16 MB, after the copies;L2 fetch 256 B"
    default+=";10 warps: $big"
fi
ab ab "product;${VARIANTS:-$default}" --deadline "$(($(left) - 20))"

#!/usr/bin/env bash
# Twenty-seventh session: the combine inside the Gluon ring's launch (AttendLaunch.merge, new) and the lazy rescale
# (lab_session67.sh's, never run), on an H100: alone at 4K and 32K (dev/mla_probe.py), then in the whole decode step
# at 32K and at 4K (A/B in one process each), then the GPU tests of the Gluon attention (the combine inside against
# the reference, 4 and 8 warps) and of the whole step in graphs (PDL, greedy, speculation).
# On an H200: lab_session69.sh's H200 branch (the product's bench at 32K, the levers' A/B), the Gluon ring and the
# combine inside among its variants.
# Results under $OUT: mla_probe.log, ab.{log,json}, ab4k.{log,json}, gpu_tests.log (H100); bench.{log,json},
# ab.{log,json}, steady.log (H200). timeout_s LAB_SECONDS + 30.
if nvidia-smi -L | grep -q H200; then
    big="qkvfgb, q|kv_a|g, MLP"
    VARIANTS="MLA one token: Gluon ring;MLA one token: Gluon ring, combine inside;bulk, 2 blocks of 8 warps: $big"
    VARIANTS+=";8 warps: $big;L2 next: shared + 16 MB, after the copies;L2 fetch 256 B;product again"
    VARIANTS+=";MoE gate_up window 3;MLA one token: L2 asks for the first step early"
    export VARIANTS LAB_SECONDS=${LAB_SECONDS:-585}
    source dev/lab_session59.sh
    exit 0
fi
LAB_DEFAULT_SECONDS=420
source dev/lab_prelude.sh
one='[{}, {"merge": true}, {"merge": true, "warps": 8}, {"lazy_rescale": true}, {"gluon": false}]'
timeout 100 python3 dev/mla_probe.py --contexts 4096,32768 --tokens 1 --changes "$one" > "$OUT/mla_probe.log" 2>&1
echo "[mla_probe rc=$? at ${SECONDS}s]"; grep -E "^T=" "$OUT/mla_probe.log" | cut -c1-170
g="MLA one token: Gluon ring"
if grep -q "'merge': True}: .*us per layer" "$OUT/mla_probe.log"; then
    default="$g, combine inside;product again;$g, combine inside, again;$g, lazy rescale;$g, 8 warps, combine inside"
    ab ab "product;${VARIANTS:-$default}" --deadline "$(($(left) - 170))"
    ab ab4k "product;$g, combine inside;product again;$g, combine inside, again" --context 4096 \
        --deadline "$(($(left) - 50))"
else  # (the combine inside did not run alone: a hang there would take the whole call)
    echo "the combine inside did not run alone: left out of the A/B"
    ab ab "product;$g, lazy rescale;product again;$g, lazy rescale, again" --deadline "$(($(left) - 60))"
fi
gpu_tests $(($(left) - 5)) tests/test_gpu_fused_step.py -k "gluon or pdl or greedy or speculation" -rfE

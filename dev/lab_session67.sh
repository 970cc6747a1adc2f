#!/usr/bin/env bash
# Twenty-sixth session, third call: one token's MLA attention is the Gluon ring on the H100 since lab_session66
# (GLUON_RING_CARDS). Alone (4K, 32K) and in the whole decode step at 32K (A/B in one process): the Gluon ring, the
# Triton attention it replaced, and the ring with the lazy rescale (the maxima moved only when one grows by more
# than 8); on an H200 (not on GLUON_RING_CARDS) the same list measures the ring there. Then the fused step's GPU
# tests of the Gluon ring and of the product's whole step in graphs (PDL, greedy, speculation).
# Results under $OUT: mla_probe.log, ab.{log,json}, gpu_tests.log. timeout_s LAB_SECONDS + 30.
LAB_DEFAULT_SECONDS=280
source dev/lab_prelude.sh
one='[{}, {"gluon": false}, {"gluon": true}, {"gluon": true, "lazy_rescale": true}]'
timeout 90 python3 dev/mla_probe.py --contexts 4096,32768 --tokens 1 --changes "$one" > "$OUT/mla_probe.log" 2>&1
echo "[mla_probe rc=$? at ${SECONDS}s]"; grep -E "^T=" "$OUT/mla_probe.log" | cut -c1-150
t="MLA one token: Triton attention"
g="MLA one token: Gluon ring"
default="$t;$g, lazy rescale;product again;$t, again;$g, lazy rescale, again"
ab ab "product;${VARIANTS:-$default}" --deadline "$(($(left) - 100))"
gpu_tests $(($(left) - 5)) tests/test_gpu_fused_step.py -k "gluon or pdl or greedy or speculation" -rfE

#!/usr/bin/env bash
# Twenty-sixth session, the last call, fitted to the little device time left (LAB_SECONDS about 150):
# lab_session67.sh's first two parts cut short. The Gluon ring (the product on the H100), the Triton attention and
# the ring with the lazy rescale alone (32K), then the product, the Triton attention and the lazy rescale in the
# whole decode step at 32K (A/B in one process). Results under $OUT: mla_probe.log, ab.{log,json}.
# timeout_s LAB_SECONDS + 30.
LAB_DEFAULT_SECONDS=150
source dev/lab_prelude.sh
one='[{}, {"gluon": false}, {"gluon": true}, {"gluon": true, "lazy_rescale": true}]'
timeout 40 python3 dev/mla_probe.py --contexts 32768 --tokens 1 --changes "$one" > "$OUT/mla_probe.log" 2>&1
echo "[mla_probe rc=$? at ${SECONDS}s]"; grep -E "^T=" "$OUT/mla_probe.log" | cut -c1-150
default="MLA one token: Triton attention;MLA one token: Gluon ring, lazy rescale"
ab ab "product;${VARIANTS:-$default}" --deadline "$(($(left) - 20))"

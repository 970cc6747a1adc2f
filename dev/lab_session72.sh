#!/usr/bin/env bash
# Twenty-seventh session, the last call (about 500 s of device time left): on an H200 only, lab_session71.sh's H200
# part cut to fit: the product's bench at 4K and 32K (the Gluon ring and the gate_up window of 3 now the H200's
# product), then the A/B at 32K of both undone and of verification's big projections through the window ring, as far
# as the time goes. On an H100 nothing (its product did not change; lab_session71 ran its GPU suite).
# Results under $OUT: bench.{log,json}, ab.{log,json}. timeout_s LAB_SECONDS + 30.
LAB_DEFAULT_SECONDS=300
source dev/lab_prelude.sh
if ! nvidia-smi -L | grep -q H200; then
    echo "not an H200: nothing to run"
    exit 0
fi
PREFILL="" product_bench 4096,32768 128 $(($(left) - 150))
t="MLA one token: Triton attention"
w="window ring: qkvfgb, q|kv_a|g, MLP"
ab ab "product;$t;MoE gate_up tiles all at once;$w;product again;$w, again" --deadline "$(($(left) - 60))"

#!/usr/bin/env bash
# Twenty-seventh session's last call (not run: no device time was left), for the next H200: lab_session71.sh's H200
# part cut to about 300 s: the product's bench at 4K and 32K (the Gluon ring and the gate_up window of 3 now the
# H200's product), then the A/B at 32K of both undone, of the ring's early copies (the H100's) and of verification's
# big projections through the window ring (2 blocks of 10 warps, the H100's, and of 8) and of the big projections'
# 256-byte L2 fetch, as far as the time goes.
# On an H100 nothing (its product did not change; lab_session71 ran its GPU suite).
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
e="MLA one token: L2 asks for the first step early"  # (on the ring, the product's now: its first two steps copied early)
w8="window ring, 2 blocks of 8 warps: qkvfgb, q|kv_a|g, MLP"
f="L2 fetch 256 B: qkvfgb, q|kv_a|g, MLP"
l="L2 next: shared + 16 MB, after the copies"  # (-6.8 us once, lab70)
ab ab "product;$t;MoE gate_up tiles all at once;$w;product again;$e;$f;$l;$w, again;$w8" --deadline "$(($(left) - 60))"

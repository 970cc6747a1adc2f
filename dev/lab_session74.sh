#!/usr/bin/env bash
# (Run in the twenty-ninth session on an H100; the experts-ahead switch lost and was taken out after it, so its variants
# and GPU test named here no longer exist: docs/kernels-history.md, twenty-ninth session.)
# Twenty-ninth session's first call, on whatever Hopper card comes. On an H200: the product's bench at 4K and 32K
# (lab_session72's, not yet measured: the Gluon ring and the gate_up window), then one A/B at 32K of the output
# projections asking the L2 for the MoE experts ahead (lab_session73's two sources, and lab70's L2 next). On an
# H100: lab_session73 as written. Results under $OUT: bench.{log,json}, ab.{log,json} (+ lab73's on an H100).
# timeout_s LAB_SECONDS + 30.
LAB_DEFAULT_SECONDS=560
if ! nvidia-smi -L | grep -q H200; then
    source dev/lab_session73.sh
    exit 0
fi
source dev/lab_prelude.sh
PREFILL="" product_bench 4096,32768 128 $(($(left) - 330))
x="experts ahead: the last step's gate_up"
p="experts ahead: predicted gate_up"
l="L2 next: shared + 16 MB, after the copies"
ab ab "product;$x;product again;$p;$x and down;$l;$x, again" --deadline "$(($(left) - 40))"

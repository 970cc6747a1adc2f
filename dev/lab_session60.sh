#!/usr/bin/env bash
# Twenty-fifth session: on an H200 what lab_session59.sh's H200 branch runs (never yet run: no H200 came in the
# twenty-fourth session), fitted to what device time is left (LAB_SECONDS). On an H100 (a call of kind nvidia-h200
# may get one), whose whole GPU suite ran in the twenty-fourth session (h100_gpu_suite_lab59.log), the same launch
# candidates in the step: the big projections' register path at 8 and 10 warps a block and their bulk rings, never
# run in the step since NVRTC 13.0 built them; the 24 MB L2 ask against the product's 16 MB (-44.0 against -36.4 in
# one older A/B, lab28/29). Then the steady probe with what is left.
# Results under $OUT: bench.{log,json} (H200, if time), ab.{log,json}, steady.log. timeout_s 600.
LAB_DEFAULT_SECONDS=585
if nvidia-smi -L | grep -q H200; then
    source dev/lab_session59.sh
    exit 0
fi
source dev/lab_prelude.sh
big="qkvfgb, q|kv_a|g, MLP"
default="8 warps: $big;L2 next: shared + 24 MB, after the copies;bulk, 2 blocks of 8 warps: $big;product again"
default+=";10 warps: $big;L2 next: shared + 32 MB, after the copies;L2 next: shared + 24 MB, after the copies, again"
ab ab "product;${VARIANTS:-$default}" --deadline "$(($(left) - 80))"
steady_probe $(($(left) - 5))

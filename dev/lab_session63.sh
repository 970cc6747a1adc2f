#!/usr/bin/env bash
# Twenty-fifth session, the last call: on an H200 what lab_session59.sh's H200 branch runs, fitted to the device time
# left (LAB_SECONDS). On an H100: the A/B of the MoE kernels' 32 MB L2 ask against the product's 16 (-15.7 us in
# h100_ab_lab60.log, where 24 MB gave -7.3 and +0.7), twice, and one token's MLA attention asking the L2 for the
# step after at each step's top (ahead_steps 1; lab62's Nsight Compute: 46% of its stalls on the copies).
# Results under $OUT: ab.{log,json} (and on an H200 steady.log, bench.{log,json} if time). timeout_s LAB_SECONDS + 30.
LAB_DEFAULT_SECONDS=300
if nvidia-smi -L | grep -q H200; then
    source dev/lab_session59.sh
    exit 0
fi
source dev/lab_prelude.sh
l2="L2 next: shared + 32 MB, after the copies"
default="$l2;MLA one token: L2 asks 1 step ahead in the loop;product again;$l2, again"
ab ab "product;${VARIANTS:-$default}" --deadline "$(($(left) - 20))"

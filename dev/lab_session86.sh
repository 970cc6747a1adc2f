#!/usr/bin/env bash
# For the thirty-fourth session. On an H200: the fused KDA front (the H100's product, KDA_FRONT_BUILD) there for the
# first time: its GPU test (every bit-exact build, the L2 asks included), then its A/B at 32K beside the H200's product
# (the two kernels), with the front's blocks asking the L2 for the output projection's weight (KDA front L2O). On an
# H100: those L2 asks beside the product (the front), and the shared expert's down before the front with both preferring
# all of the shared memory (so that a front block may become resident beside its blocks), and the MoE kernels asking the
# L2 for all of the next front's q and k rows (21 MB) instead of the first 16 MB. Results under $OUT: [gpu_tests.log], ab.{log,json}.
# timeout_s LAB_SECONDS + 20.
LAB_DEFAULT_SECONDS=300
source dev/lab_prelude.sh
f="KDA front, o_proj weights asked of the L2"
if nvidia-smi -L | grep -q H200; then
    gpu_tests 100 tests/test_gpu_fused_step.py -k fused_kda_front -s
    grep -E "worst rel" "$OUT/gpu_tests.log" | head -1
    ab ab "product;KDA front fused, ring of 3, g last;$f after the b task;product again;KDA front fused, ring of 4, g last" \
        --deadline "$(($(left) - 70))"
else
    c="shared down carveout 100"
    ab ab "product;$f after the b task;$c, KDA front carveout 100;product again;$f before the wait;$c;L2 next: shared + 21 MB, after the copies" \
        --deadline "$(($(left) - 70))"
fi

#!/usr/bin/env bash
# One short call. On an H200: the fused KDA front (the H100's product, KDA_FRONT_BUILD) there for the first time: its
# GPU test, then its A/B at 32K beside the H200's product (the two kernels). On an H100: the output projection at 8 warps
# beside the front with both preferring all of the shared memory (carveout 100), so that it may become resident beside
# the front's blocks under PDL. Results under $OUT: [gpu_tests.log], ab.{log,json}. timeout_s LAB_SECONDS + 20.
LAB_DEFAULT_SECONDS=250
source dev/lab_prelude.sh
if nvidia-smi -L | grep -q H200; then
    gpu_tests 90 tests/test_gpu_fused_step.py -k fused_kda_front -s
    grep -E "worst rel" "$OUT/gpu_tests.log" | head -1
    f="KDA front fused"
    ab ab "product;$f, ring of 3, g last;$f, ring of 4, g last;product again;$f, ring of 4, g last, again" \
        --deadline "$(($(left) - 70))"
else
    ab ab "product;KDA front ring of 3, g last, carveout 100, o_proj 8 warps, carveout 100;KDA front ring of 3, g last, carveout 100;o_proj: 8 warps, carveout 100;product again;o_proj: carveout 100" \
        --deadline "$(($(left) - 70))"
fi

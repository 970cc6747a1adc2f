#!/usr/bin/env bash
# Thirty-ninth session. On an H200: the GPU tests of the H100's products and lab switches the H200 has not run (the
# fused KDA front, the window rings, both Gluon rings, the shared expert beside the router, the NEXTN rounds in graphs
# under PDL with it after 07a0866's fix), then the A/B at 32K of each beside the H200's product, twice. On an H100:
# those NEXTN rounds and the beside tests (the fix's first run on a GPU), then the MoE kernels' L2 asks for more of the
# fused KDA front's weights (its first tasks are the q rows, 10 MB; the product asks for 16, chosen for the CUDA GEMV's
# order, and 10 measured +10 us in lab95), 24 and 32 MB, twice. Results under $OUT: gpu_tests.log, ab.{log,json}.
# timeout_s LAB_SECONDS + 20.
LAB_DEFAULT_SECONDS=560
source dev/lab_prelude.sh
if nvidia-smi -L | grep -q H200; then
    gpu_tests 190 tests/test_gpu_fused_step.py -k "fused_kda_front or window_rings or gluon_ring or beside or pdl_launches"
    grep -E "worst|FAILED" "$OUT/gpu_tests.log" | head -16
    f="KDA front fused, ring of 3, g last"
    w="window ring: qkvfgb, q|kv_a|g, MLP"
    v="MLA verification: Gluon ring"
    s="shared gate_up beside the router"
    ab ab "product;$f;$w;$v;$s;product again;$f, again;$w, again;$v, again;$s, again" --deadline "$(($(left) - 60))"
    exit 0
fi
gpu_tests 200 tests/test_gpu_fused_step.py -k "beside or pdl_launches"
grep -E "worst|FAILED" "$OUT/gpu_tests.log" | head -16
a="L2 next: shared + 24 MB, after the copies"
b="L2 next: shared + 32 MB, after the copies"
ab ab "product;$a;$b;product again;$a, again;$b, again" --deadline "$(($(left) - 60))"

#!/usr/bin/env bash
# Thirty-eighth session. New: verification's whole shared expert beside its router (the shared down on the side stream
# too, the routed experts' GEMV down kernel adding both onto x: FusedDecodeStep.shared_down_beside). On an H200:
# dev/lab_session91.sh's agenda with it (the GPU tests of the fused KDA front, the window rings, both Gluon rings, the
# KDA splits and the shared expert beside the router; the A/B at 32K of each beside the H200's product, twice). On an
# H100: its GPU tests and A/B, with questions the fused KDA front (the H100's product since the thirty-third session)
# may have changed: the shared expert inside the MoE kernel (+131 us in lab49, when its successor was the CUDA GEMV of
# q|k|v|f|g|b), the MoE kernels' L2 asks (chosen for that GEMV's reading order; the front's first tasks are every q
# row, 10 MB), and the warp selection that won alone but lost in the step, without those asks. Results under $OUT:
# gpu_tests.log, ab.{log,json}. timeout_s LAB_SECONDS + 20.
LAB_DEFAULT_SECONDS=560
source dev/lab_prelude.sh
v="MLA verification: Gluon ring"
s="shared gate_up beside the router"
e="shared expert beside the router"
if nvidia-smi -L | grep -q H200; then
    gpu_tests 150 tests/test_gpu_fused_step.py -k "fused_kda_front or window_rings or gluon_ring or beside"
    grep -E "worst|FAILED" "$OUT/gpu_tests.log" | head -16
    f="KDA front fused, ring of 3, g last"
    w="window ring: qkvfgb, q|kv_a|g, MLP"
    ab ab "product;$f;$w;$v;$s;$e;product again;$f, again;$w, again;$v, again;$s, again;$e, again" \
        --deadline "$(($(left) - 100))"
    exit 0
fi
gpu_tests 200 tests/test_gpu_fused_step.py -k "beside or pdl_launches"
grep -E "worst|FAILED" "$OUT/gpu_tests.log" | head -16
i="shared expert inside"
o="L2 next off"
q="L2 next: shared + 10 MB, after the copies"
w="MoE warp selection, L2 next off"
ab ab "product;$e;$i;$o;$q;$w;product again;$e, again;$i, again;$o, again;$q, again;MoE warp selection" \
    --deadline "$(($(left) - 100))"

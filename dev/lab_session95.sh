#!/usr/bin/env bash
# Thirty-eighth session. On an H200: dev/lab_session91.sh's agenda (the GPU tests of the fused KDA front, the window
# rings, both Gluon rings, the KDA splits and the shared gate_up beside the router; the A/B at 32K of each beside the
# H200's product, twice). On an H100, questions the fused KDA front (the H100's product since the thirty-third
# session) may have changed: the shared expert inside the MoE kernel (+131 us in lab49, when its successor was the
# CUDA GEMV of q|k|v|f|g|b), the MoE kernels' L2 asks (chosen for that GEMV's reading order; the front's first tasks
# are every q row, 10 MB), and the warp selection that won alone but lost in the step, without those asks. Results
# under $OUT: gpu_tests.log (H200), ab.{log,json}. timeout_s LAB_SECONDS + 20.
LAB_DEFAULT_SECONDS=560
source dev/lab_prelude.sh
if nvidia-smi -L | grep -q H200; then
    exec env LAB_SECONDS="$(left)" bash dev/lab_session91.sh
fi
i="shared expert inside"
o="L2 next off"
q="L2 next: shared + 10 MB, after the copies"
w="MoE warp selection, L2 next off"
ab ab "product;$i;$o;$q;$w;product again;$i, again;$o, again;$q, again;MoE warp selection" \
    --deadline "$(($(left) - 100))"

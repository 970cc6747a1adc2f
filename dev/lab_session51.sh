#!/usr/bin/env bash
# Twenty-second session, third H100 call (an H200 runs dev/lab_session37.sh instead): lab50's trace put 1.4 us between
# the last selection warp having all its scores and "every score seen", and 0.8 more before the candidates' ranks,
# for a few hundred instructions. Is it fetching them? DecodeKernelConfig.select_twice (a probe of the traced kernel)
# runs the selection twice, one copy of its code, and stamps the second run. The kernel alone with its trace.
# Results under $OUT: moe_router.log. timeout_s 300.
nvidia-smi -L | grep -q H200 && exec bash dev/lab_session37.sh
LAB_DEFAULT_SECONDS=285
source dev/lab_prelude.sh
moe_router 200 "checks|^  router" --rounds 1 --configs "gate_up_window=3;gate_up_window=3,select_twice=1"

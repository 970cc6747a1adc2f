#!/usr/bin/env bash
# Twenty-second session, fourth H100 call (an H200 runs dev/lab_session37.sh instead): lab51's select_twice probe
# showed the selection as slow with its instructions cached (2.44 us from the second run's start to the experts in
# shared memory, against 2.49 us the first time), so it is not fetching them. Thread 0's clock64 at each of the
# selection's steps (moe_decode.cu SEL_CLOCK) says which ones take the time, once and with select_twice.
# Results under $OUT: moe_router.log. timeout_s 300.
nvidia-smi -L | grep -q H200 && exec bash dev/lab_session37.sh
LAB_DEFAULT_SECONDS=285
source dev/lab_prelude.sh
moe_router 200 "checks|^  router" --rounds 1 --configs "gate_up_window=3;gate_up_window=3,select_twice=1"

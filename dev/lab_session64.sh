#!/usr/bin/env bash
# Twenty-sixth session, first call: on an H200 what lab_session59.sh's H200 branch runs (the product's bench at 32K
# if time, the A/B of the H100's levers and the big projections' launch candidates, the steady probe), fitted to the
# device time left (LAB_SECONDS). On an H100 nothing: its branches of lab_session59-63 have all run, so it only
# records the card and hands the time back.
# Results under $OUT: gpu.txt; on an H200 bench.{log,json} (if time), ab.{log,json}, steady.log. timeout_s LAB_SECONDS + 30.
LAB_DEFAULT_SECONDS=570
if nvidia-smi -L | grep -q H200; then
    source dev/lab_session59.sh
    exit 0
fi
source dev/lab_prelude.sh
echo "not an H200: nothing to run"

#!/usr/bin/env bash
# Twenty-second session, last call: on an H200 only (an H100 runs nothing), the product's bench at 32K (the lean
# selection's first H200 number), within what the session's device time has left. Results under $OUT: bench.{log,json}.
# timeout_s 300.
LAB_DEFAULT_SECONDS=280
source dev/lab_prelude.sh
nvidia-smi -L | grep -q H200 || { echo "not an H200: nothing run"; exit 0; }
PREFILL="" product_bench 32768 64 5

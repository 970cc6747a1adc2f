#!/usr/bin/env bash
# Twenty-second session: on an H200, dev/lab_session37.sh (the H200's own questions and the product's bench); on an
# H100, one process at 32K: the KDA and MLA input projections built for 7 blocks an SM (GemvLaunch.min_blocks 7:
# NVRTC 13.0 gives 72 registers and 96 bytes of spills inside the task loop, against the product's 80 registers and
# 6 blocks; a sixth more loads in flight), and the shared expert inside the MoE kernel measured again on today's
# product (the gate_up window, the L2 asks after the copies; last measured +30 to +60 us in lab23 and lab25).
# Results under $OUT: ab.{log,json} (an H200: steady.log, ab.{log,json}, bench.{log,json}). timeout_s 600.
nvidia-smi -L | grep -q H200 && exec bash dev/lab_session37.sh
LAB_DEFAULT_SECONDS=585
source dev/lab_prelude.sh
default="product;qkvfgb, q|kv_a|g: 7 blocks an SM;shared expert inside;product again"
default+=";qkvfgb, q|kv_a|g: 7 blocks an SM, again"
ab ab "${VARIANTS:-$default}" --deadline "${AB_DEADLINE:-$(($(left) - 10))}"

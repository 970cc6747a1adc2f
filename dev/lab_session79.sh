#!/usr/bin/env bash
# For the thirty-first session, on an H200 (after dev/lab_session78.sh, on the same warm machine): the decode step's
# launch variants that were chosen on H100s and never (or not since the H200's step reached 2.35 ms) measured in the
# H200's step at 32K. The L2 asks after the MoE copies (L2_NEXT_CARDS: the H100's only; on the H200 -6.8 us once,
# h200_ab_lab70.log), blocks an SM, the early down pairs, the shared gate_up's late wait, the output projections'
# launches. On an H100: nothing (these were measured there). Results under $OUT: sweep.{log,json}.
# timeout_s LAB_SECONDS + 30.
LAB_DEFAULT_SECONDS=560
source dev/lab_prelude.sh
if ! nvidia-smi -L | grep -q H200; then
    echo "not an H200: nothing to run"
    exit 0
fi
v="product"
v+=";L2 next: shared + 16 MB, after the copies;L2 next: shared + 32 MB, after the copies"
v+=";L2 next: shared + 8 MB, after the copies"
v+=";at most 2 blocks/SM;o_proj, dense: 2 blocks an SM;qkvfgb, q|kv_a|g: 7 blocks an SM"
v+=";MoE early pairs 1;shared gate_up late wait;MoE on 4 SMs fewer, shared gate_up late wait"
v+=";o_proj, dense: 8 warps, 4 in flight;L2: first 2 tasks;KDA asks the L2 for o_proj"
v+=";window ring: o_proj, dense, downs;product again"
ab sweep "$v" --deadline "$(($(left) - 20))"

#!/usr/bin/env bash
# Twenty-seventh session, first call. On an H200 (none came since the sixteenth session): lab_session59.sh's H200
# branch (the product's bench at 32K, the A/B of the H100's levers and of the big projections' launches), with the
# Gluon ring (the H100's MLA attention since lab_session66, not on GLUON_RING_CARDS there) first among the variants.
# On an H100: lab_session67.sh (the Gluon ring against the Triton attention and the lazy rescale, alone and in the
# step; the Gluon and whole-step GPU tests), which no device ran in the twenty-sixth session.
# Results under $OUT as those scripts write them. timeout_s 600.
if nvidia-smi -L | grep -q H200; then
    big="qkvfgb, q|kv_a|g, MLP"
    VARIANTS="MLA one token: Gluon ring;bulk, 2 blocks of 8 warps: $big;8 warps: $big;L2 next: shared + 16 MB, after the copies"
    VARIANTS+=";L2 fetch 256 B;product again;MoE gate_up window 3;MLA one token: L2 asks for the first step early"
    export VARIANTS LAB_SECONDS=${LAB_SECONDS:-585}
    source dev/lab_session59.sh
    exit 0
fi
export LAB_SECONDS=${LAB_SECONDS_H100:-300}
source dev/lab_session67.sh

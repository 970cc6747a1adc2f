#!/usr/bin/env bash
# Twentieth session, last try for an H200 (a short budget): on an H200 only, one process at 32K: the H100's MoE gate_up
# window, the big projections' bulk rings (2 blocks of 8 warps an SM), one token's MLA asking the L2 early, the H100's
# MoE asks, the product again. On an H100 it runs nothing. Results under $OUT: ab.{log,json}. timeout_s 300.
LAB_DEFAULT_SECONDS=285
source dev/lab_prelude.sh
nvidia-smi -L | grep -q H200 || { echo "not an H200: nothing run"; exit 0; }
big="qkvfgb, q|kv_a|g, MLP"
ab ab "product;MoE gate_up window 3;bulk, 2 blocks of 8 warps: $big;MLA one token: L2 asks for the first step early;L2 next: shared + 16 MB, after the copies;product again" \
    --deadline "${AB_DEADLINE:-$(($(left) - 15))}"

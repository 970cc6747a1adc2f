#!/usr/bin/env bash
# Twentieth session, first call: on an H200 only (an H100 runs nothing). First the projections with their rows
# scaled (steady.log: on the H100 the KDA projections reach 81% of the copy bandwidth alone and 95% at 16x the
# rows, so the H100 pays fixed costs a kernel; does the H200's 67% rise with the rows too, or is its stream bound?),
# then what never ran on an H200 in the whole step at 32K (the big projections' bulk rings and L2 hints, one token's
# MLA asking the L2 early, the H100's MoE asks and gate_up window), then the product's bench with prefills.
# Results under $OUT: steady.log, ab.{log,json}, bench.{log,json}. timeout_s 600.
LAB_DEFAULT_SECONDS=585
source dev/lab_prelude.sh
nvidia-smi -L | grep -q H200 || { echo "not an H200: nothing run"; exit 0; }
steady_probe 75
big="qkvfgb, q|kv_a|g, MLP"
default="bulk, 2 blocks of 8 warps: $big;MLA one token: L2 asks for the first step early"
default+=";L2 next: shared + 16 MB, after the copies;MoE gate_up window 3;L2 fetch 256 B;bulk, 2 blocks of 10 warps: $big"
default+=";product again"
ab ab "product;${VARIANTS:-$default}" --deadline "${AB_DEADLINE:-$(($(left) - 300))}"
PREFILL=${PREFILL-1024,8192,32768} product_bench 4096,32768 128 5

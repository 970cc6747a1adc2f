#!/usr/bin/env bash
# Nineteenth session, third lab: on the H100 one token's MLA attention now asks the L2 for each split's first step
# of old cache rows before its wait (EARLY_CHUNK_CARDS; lab32: -10.7 us at 32K, -8.8 at 4K). Next: the prep's query
# programs load their block of w_uk (4 MB a layer) before their wait (AttendLaunch.prep_weights_early). The GPU
# tests (the MLA against the reference with both, the fused layers, greedy decode and speculation in graphs), then
# the A/B at 32K and at 4K, one process each. On an H200 instead what never ran there first (the big projections'
# bulk rings and L2 hints, the MLA's early asks and prep, the H100's MoE asks); then the bench with prefills.
# Results under $OUT: gpu_tests.log, ab.{log,json}, ab4k.{log,json} (H200: bench.{log,json}). timeout_s 600.
LAB_DEFAULT_SECONDS=585
source dev/lab_prelude.sh
timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_gpu_fused_step.py \
    -k "splits_of_several or every_fused_layer or speculation_on_the_fused_step or greedy_decode_in_graphs" \
    > "$OUT/gpu_tests.log" 2>&1
echo "[GPU tests rc=$? at ${SECONDS}s]"; tail -2 "$OUT/gpu_tests.log"
p="MLA prep: w_uk before the wait"
if nvidia-smi -L | grep -q H200; then
    big="qkvfgb, q|kv_a|g, MLP"
    default="bulk, 2 blocks of 8 warps: $big;MLA one token: L2 asks for the first step early;$p"
    default+=";L2 next: shared + 16 MB, after the copies;bulk, 2 blocks of 10 warps: $big;L2 ahead 2: $big"
    default+=";product again"
    ab ab "product;${VARIANTS:-$default}" --deadline "${AB_DEADLINE:-$(($(left) - 300))}"
    PREFILL=${PREFILL-1024,8192,32768} product_bench 4096,32768 128 5
else
    variants="product;$p;$p, one token;MLA one token: no early asks;product again;$p, again"
    ab ab "$variants" --deadline $(($(left) - 200))
    timeout $(($(left) - 5)) python3 dev/decode_launch_ab.py --context 4096 --variants "$variants" \
        --json "$OUT/ab4k.json" > "$OUT/ab4k.log" 2>&1
    echo "[A/B 4K rc=$? at ${SECONDS}s]"; grep -E "^@|FAULT|FAILED|Error|outputs" "$OUT/ab4k.log"
fi

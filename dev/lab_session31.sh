#!/usr/bin/env bash
# Nineteenth session, second lab: one token's MLA attention asks the L2 for each split's first steps of the cache
# rows earlier steps wrote before it waits for the prep (AttendLaunch.early_chunks; the prep writes only q and this
# call's rows): the GPU test against the reference (the rows at this call's positions hold other random values
# until the prep writes them), then the A/B at 32K and at 4K, one process each. On an H200 first what never ran
# there (the big projections' bulk rings and L2 hints, the H100's product asks). Results under $OUT:
# gpu_tests.log, ab.{log,json}, ab4k.{log,json}. timeout_s 600.
LAB_DEFAULT_SECONDS=585
source dev/lab_prelude.sh
timeout 120 python3 -m pytest -q -p no:cacheprovider tests/test_gpu_fused_step.py -k "splits_of_several" \
    > "$OUT/gpu_tests.log" 2>&1
echo "[GPU tests rc=$? at ${SECONDS}s]"; tail -2 "$OUT/gpu_tests.log"
m="MLA one token: L2 asks for"
mla="$m the first step early;$m 2 steps early;$m 4 steps early"
if nvidia-smi -L | grep -q H200; then
    big="qkvfgb, q|kv_a|g, MLP"
    default="bulk, 2 blocks of 8 warps: $big;$mla;L2 next: shared + 16 MB, after the copies"
    default+=";bulk, 2 blocks of 10 warps: $big;L2 ahead 2: $big;product again"
    ab ab "product;${VARIANTS:-$default}" --deadline "${AB_DEADLINE:-$(($(left) - 150))}"
else
    ab ab "product;$mla;product again" --deadline $(($(left) - 150))
fi
timeout $(($(left) - 5)) python3 dev/decode_launch_ab.py --context 4096 --variants "product;$mla;product again" \
    --json "$OUT/ab4k.json" > "$OUT/ab4k.log" 2>&1
echo "[A/B 4K rc=$? at ${SECONDS}s]"; grep -E "^@|FAULT|FAILED|Error|outputs" "$OUT/ab4k.log"

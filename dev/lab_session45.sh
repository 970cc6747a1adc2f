#!/usr/bin/env bash
# Twentieth session, a short call. On an H200: the A/B at 32K of what never ran there (the big projections' bulk rings,
# one token's MLA asking the L2 early, the H100's MoE asks and gate_up window). On an H100: the gate_up window at 4K
# (the product against the tiles all at once; lab40-42 measured 32K). Results under $OUT: ab.{log,json} (H200) or
# ab4k.{log,json} (H100). timeout_s 300.
LAB_DEFAULT_SECONDS=285
source dev/lab_prelude.sh
if nvidia-smi -L | grep -q H200; then
    big="qkvfgb, q|kv_a|g, MLP"
    ab ab "product;MoE gate_up window 3;bulk, 2 blocks of 8 warps: $big;MLA one token: L2 asks for the first step early;L2 next: shared + 16 MB, after the copies;product again" \
        --deadline "${AB_DEADLINE:-$(($(left) - 15))}"
    exit 0
fi
timeout $(($(left) - 10)) python3 dev/decode_launch_ab.py --context 4096 \
    --variants "product;MoE gate_up tiles all at once;product again;MoE gate_up tiles all at once, again" \
    --json "$OUT/ab4k.json" > "$OUT/ab4k.log" 2>&1
echo "[A/B rc=$? at ${SECONDS}s]"; grep -E "^@|FAULT|FAILED|Error|outputs" "$OUT/ab4k.log"

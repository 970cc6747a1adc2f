#!/usr/bin/env bash
# Twentieth session, fourth call: the MoE kernel's gate_up tiles in a window. lab39's per-block trace: a block's first
# gate_up tile lands at about 8 us, the other five or six together at 11.5-12.7 us (asked all at once, the memory
# serves the GPU's 16 MB in its own order), and the gate_up warps, about 0.5 us a tile, reach the last one at 14-16 us.
# DecodeKernelConfig.gate_up_window N: the producer issues tile i once tile i - N has landed. First the GPU tests (bit
# for bit the product's), then the routing's trace of windows 2, 3, 4 block by block (moe_router.log), then one
# process at 32K (on an H200 with what never ran there). Results under $OUT: gpu_tests.log, moe_router.log,
# ab.{log,json}. timeout_s 600.
LAB_DEFAULT_SECONDS=585
source dev/lab_prelude.sh
timeout 120 python3 -m pytest -q -p no:cacheprovider tests/test_cuda_moe.py -k "gate_up_window" \
    > "$OUT/gpu_tests.log" 2>&1
echo "[GPU tests rc=$? at ${SECONDS}s]"; tail -2 "$OUT/gpu_tests.log"
timeout 100 python3 dev/moe_router_ab.py --rounds 3 --per-block \
    --configs "gate_up_window=2;gate_up_window=3;gate_up_window=4" > "$OUT/moe_router.log" 2>&1
echo "[moe_router rc=$? at ${SECONDS}s]"; grep -v Warning "$OUT/moe_router.log" | grep -E "^  router|^round|rank corr|gate_up tiles  |last gate_up tile landed  " | head -40
w="MoE gate_up window"
mine="$w 3;$w 2;$w 4;product again;$w 3, again;$w 3, downs after 2 tiles"
if nvidia-smi -L | grep -q H200; then
    big="qkvfgb, q|kv_a|g, MLP"
    mine+=";bulk, 2 blocks of 8 warps: $big;MLA one token: L2 asks for the first step early"
fi
ab ab "product;${VARIANTS:-$mine}" --deadline "${AB_DEADLINE:-$(($(left) - 15))}"

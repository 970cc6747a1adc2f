#!/usr/bin/env bash
# Twentieth session, second call: the MoE kernel's tiles spread by gate_up tiles first. Balanced by bytes (the
# product), 32 of 132 blocks take 7 gate_up tiles where the others take 5 or 6 (at Ling shapes the only nine-tile
# share that fits beside the Smem struct), and the activation exchange waits for the last gate_up tile anywhere
# (the trace: median block's last landed 12.7 us, the slowest 14.9). DecodeKernelConfig.balance "gate_up" gives
# every block 5 or 6 and the lighter ones a third down tile; that fits with x kept in the block's down area of the
# tile memory until the gate_up warps hold it (x_in_tiles, moe_decode.cu X_IN_TILES). First the GPU tests (bit for
# bit the product's), then the routing's trace of both against the product (moe_router.log), then one process at
# 32K (on an H200 with what never ran there). Results under $OUT: gpu_tests.log, moe_router.log, ab.{log,json}.
# timeout_s 600.
LAB_DEFAULT_SECONDS=585
source dev/lab_prelude.sh
timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_cuda_moe.py \
    -k "gate_up_balance or late_down or persistent_matches" > "$OUT/gpu_tests.log" 2>&1
echo "[GPU tests rc=$? at ${SECONDS}s]"; tail -2 "$OUT/gpu_tests.log"
timeout 110 python3 dev/moe_router_ab.py --rounds 3 --configs "balance=gate_up,x_in_tiles=1;x_in_tiles=1" \
    > "$OUT/moe_router.log" 2>&1
echo "[moe_router rc=$? at ${SECONDS}s]"; grep -v Warning "$OUT/moe_router.log" | grep -E "us|landed|exchange|ended|^#|config" | tail -60
mine="MoE gate_up balanced;MoE x in tiles;product again;MoE gate_up balanced, again"
if nvidia-smi -L | grep -q H200; then
    big="qkvfgb, q|kv_a|g, MLP"
    mine+=";bulk, 2 blocks of 8 warps: $big;MLA one token: L2 asks for the first step early"
    mine+=";L2 next: shared + 16 MB, after the copies"
fi
ab ab "product;${VARIANTS:-$mine}" --deadline "${AB_DEADLINE:-$(($(left) - 15))}"

#!/usr/bin/env bash
# Seventeenth session: verification's big projections through bulk rings of 2 blocks of 10 warps (GemvLaunch.window,
# WINDOW_RING), the product's on an H100 since this session (WINDOW_RING_CARDS), where three A/B runs gave
# verification 4.86-4.92 ms at 32K against 4.97-5.07 on the register path, the decode step unchanged. First the GPU
# tests (the window rings against the reference layers, the fused layers, speculation in graphs, the CUDA GEMV's
# rings), then one process at 32K: on an H100 the product against its windows on the register path; on an H200
# (never measured with any ring) the window ring, the bulk ring on the decode step's big projections, the shared
# expert inside beside it. Then the product's bench (prefill 1K, 8K, 32K where the GPU has the memory: an H200).
# Results under $OUT: gpu_tests.log, ab.{log,json}, bench.{log,json}. Say which card ran it. timeout_s 600.
LAB_DEFAULT_SECONDS=585
source dev/lab_prelude.sh
timeout 170 python3 -m pytest -q -p no:cacheprovider tests/test_gpu_fused_step.py tests/test_gpu_cuda_step.py \
    -k "window_rings or every_fused_layer or speculation_on_the_fused_step or bulk_ring" > "$OUT/gpu_tests.log" 2>&1
echo "[GPU tests rc=$? at ${SECONDS}s]"; tail -2 "$OUT/gpu_tests.log"
b="qkvfgb, q|kv_a|g, MLP"
if nvidia-smi -L | grep -q H200; then
    default="window ring: $b;bulk, 2 blocks of 8 warps: $b;product again"
    default+=";shared expert inside, bulk, 2 blocks of 8 warps: $b;bulk, 2 blocks of 10 warps: $b"
else
    default="windows on the register path;product again;window ring, 2 blocks of 8 warps: $b"
fi
ab ab "product;${VARIANTS:-$default}" --deadline "${AB_DEADLINE:-$(($(left) - 330))}"
mem=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)
if [ "${mem:-0}" -gt 100000 ]; then PREFILL=${PREFILL-1024,8192,32768}; else PREFILL=${PREFILL-}; fi
PREFILL=$PREFILL product_bench 4096,32768 128 5
grep -o '"window_rings": [0-9]*' "$OUT/bench.json" | head -1

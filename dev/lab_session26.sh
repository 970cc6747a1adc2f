#!/usr/bin/env bash
# Seventeenth session, second call. On an H200 (never measured with any ring): the product (its verification on the
# register path there) against the window ring (GemvLaunch.window = WINDOW_RING on the big projections, the H100's
# product since 25806be), the bulk ring on the decode step's big projections, the shared expert inside beside it;
# then the product's bench with the 1K, 8K and 32K prefills. On an H100: the window ring on every GEMV and on the
# 2,560-row ones (o_proj, MLA dense, the downs) beside the product's, then the product's bench again. On an H200, with
# time left, the bench of the bulk ring on the decode step's big projections (bench modifier bulk), for its profile.
# Results under $OUT: ab.{log,json}, bench.{log,json} (bench_bulk.{log,json}). Say which card ran it. timeout_s 600.
LAB_DEFAULT_SECONDS=585
source dev/lab_prelude.sh
b="qkvfgb, q|kv_a|g, MLP"
if nvidia-smi -L | grep -q H200; then
    default="window ring: $b;bulk, 2 blocks of 8 warps: $b;product again"
    default+=";shared expert inside, bulk, 2 blocks of 8 warps: $b;bulk, 2 blocks of 10 warps: $b"
else
    default="window ring: every GEMV;window ring: o_proj, dense, downs;product again;windows on the register path"
fi
ab ab "product;${VARIANTS:-$default}" --deadline "${AB_DEADLINE:-$(($(left) - 330))}"
mem=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)
if [ "${mem:-0}" -gt 100000 ]; then PREFILL=${PREFILL-1024,8192,32768}; else PREFILL=${PREFILL-}; fi
PREFILL=$PREFILL product_bench 4096,32768 128 5
grep -o '"window_rings": [0-9]*' "$OUT/bench.json" | head -1
if nvidia-smi -L | grep -q H200 && [ "$(left)" -gt 90 ]; then
    timeout $(($(left) - 5)) python3 -m solo bench decode --random-weights ling-3.0-flash \
        --configs cuda:fp8:fused+cuda+pdl+bulk --context 4096,32768 --prefill "" --loop-tokens 0 \
        --json "$OUT/bench_bulk.json" > "$OUT/bench_bulk.log" 2>&1
    echo "[bench of the bulk ring rc=$? at ${SECONDS}s]"; grep -E "^\| cuda" "$OUT/bench_bulk.log" | head -4
fi

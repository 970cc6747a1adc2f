#!/usr/bin/env bash
# The next device call (written at the end of the twelfth session). The product's one-token MLA attention is
# transposed on one warpgroup since 3527eab (H200: 2.402 ms a decode step at 32K); its launch was never
# tuned in that form, and verification's attention never tried transposed alone. One process, 32K, every
# variant's logits compared with the product's (a difference needs its GPU layer test: random routing can
# carry one bf16 step into everything after it):
#   the product twice (the spread), one token transposed on 8 warps, in two programs of heads, 256 splits,
#   3 stages, 32 positions a step; verification transposed, verification in 128 splits.
# Then, where time is left, the product bench at 4K and 32K. Results under $OUT: ab.{log,json},
# bench.{log,json}. LAB_SECONDS bounds the whole.
set -uo pipefail
export PYTHONPATH=$PWD SOLO_CACHE_DIR=/tmp/solo_cache PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}
DEADLINE=$((SECONDS + ${LAB_SECONDS:-500}))
left() { echo $((DEADLINE - SECONDS)); }
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,driver_version,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
t="MLA one token transposed"
default="product again;$t: 8 warps;$t: heads in two programs;$t: 256 splits;$t: 3 stages;$t: 32 positions a step;MLA verification transposed;MLA verification: 128 splits"
variants="product;${VARIANTS:-$default}"
timeout $(($(left) - 10)) python3 dev/decode_launch_ab.py --context 32768 --deadline "${AB_DEADLINE:-240}" \
    --variants "$variants" --json "$OUT/ab.json" > "$OUT/ab.log" 2>&1
echo "[A/B rc=$? at ${SECONDS}s]"; grep -E "^@|FAULT|FAILED|left out|Error|outputs|unknown" "$OUT/ab.log"
if [ "$(left)" -gt 120 ]; then
    timeout $(($(left) - 5)) python3 -m solo bench decode --random-weights ling-3.0-flash \
        --configs cuda:fp8:fused+cuda+pdl --context 4096,32768 --prefill "" --loop-tokens 128 \
        --json "$OUT/bench.json" > "$OUT/bench.log" 2>&1
    echo "[bench rc=$? at ${SECONDS}s]"; grep -E "^\| cuda" "$OUT/bench.log" | head -4
else
    echo "no time left for the bench ($(left) s)"
fi

#!/usr/bin/env bash
# The tenth session's device call: the lab switches and the MLA and selection variants in the whole decode
# step at 32K in one process (dev/decode_launch_ab.py), at the full shape, or, where it does not fit (80 GB
# cards before the packing in slices), with 256 experts (the same 8 a token, so the same bytes a step but
# for the router's rows); then the GPU tests of what the ninth session's H100 run found (tl.topk of 1 on
# Triton 3.6, the hand-off GEMV's blocks per SM, two test mistakes). Logs and JSON under $OUT.
set -uo pipefail
export PYTHONPATH=$PWD SOLO_CACHE_DIR=/tmp/solo_cache PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,driver_version,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
git log --oneline | head -1 | tee -a "$OUT/gpu.txt"
variants="${VARIANTS:-product;hand-off;hand-off + shared gate_up late wait;shared gate_up late wait;MLA combine in 4 latent slices;MLA one token: heads in two programs;fast selection;bulk}"
ab() {  # ab NAME TIMEOUT DEADLINE [--num-experts N]
    local name=$1 limit=$2 deadline=$3; shift 3
    timeout "$limit" python3 dev/decode_launch_ab.py --context 32768 --deadline "$deadline" "$@" \
        --json "$OUT/launch_ab_$name.json" --variants "$variants" 2>&1 | tee "$OUT/launch_ab_$name.log" | grep -v "^  "
}
ab full "${AB_TIMEOUT:-330}" "${AB_DEADLINE:-190}"
if [ ! -s "$OUT/launch_ab_full.json" ] && grep -q "out of memory" "$OUT/launch_ab_full.log"; then
    echo "the full shape does not fit: 256 experts"
    ab e256 "${AB_TIMEOUT:-330}" "${AB_DEADLINE:-150}" --num-experts 256
fi
timeout "${TEST_TIMEOUT:-220}" python3 -m pytest -q -p no:cacheprovider tests/test_topk_kernel.py tests/test_gpu_cuda_step.py \
    -k "top_k or dispatch or custom_op or handoff or router_chooses or late_wait" > "$OUT/gpu_tests.log" 2>&1
echo "tests rc=$?"; grep -E "^FAILED|passed|failed" "$OUT/gpu_tests.log" | tail -12

#!/usr/bin/env bash
# The tenth session's device call: the fixes of what the ninth session's H100 call found (tl.topk of 1 on
# Triton 3.6, the hand-off GEMV's registers, two test mistakes), then the lab switches and the MLA and
# selection variants in the whole decode step at 32K, one process. --num-experts 256 when the card has
# 80 GB (the full 512 do not fit there): the same 8 experts a token, so the same bytes a step but for
# the router's rows. Logs and JSON under $OUT.
set -uo pipefail
export PYTHONPATH=$PWD SOLO_CACHE_DIR=/tmp/solo_cache PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,driver_version,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
git log --oneline | head -1 | tee -a "$OUT/gpu.txt"
experts=""
if [ "$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)" -lt 100000 ]; then
    experts="--num-experts 256"
fi
timeout 100 python3 -m pytest -q -p no:cacheprovider tests/test_topk_kernel.py tests/test_gpu_cuda_step.py \
    -k "top_k or dispatch or custom_op or handoff or router_chooses or late_wait" > "$OUT/gpu_tests.log" 2>&1
echo "tests rc=$?"; grep -E "^FAILED|passed|failed" "$OUT/gpu_tests.log" | tail -12
timeout ${AB_TIMEOUT:-420} python3 dev/decode_launch_ab.py --context 32768 $experts --deadline ${AB_DEADLINE:-240} \
    --json "$OUT/launch_ab.json" --variants "${VARIANTS:-product;hand-off;hand-off + shared gate_up late wait;shared gate_up late wait;MLA combine in 4 latent slices;MLA one token: heads in two programs;fast selection;bulk}" \
    2>&1 | tee "$OUT/launch_ab.log" | grep -v "^  "
timeout 45 python3 -m pytest -q -p no:cacheprovider tests/test_gpu_fused_step.py -k "handoff" > "$OUT/gpu_tests_fused.log" 2>&1
echo "fused-step hand-off tests rc=$?"; grep -E "^FAILED|passed|failed" "$OUT/gpu_tests_fused.log" | tail -5

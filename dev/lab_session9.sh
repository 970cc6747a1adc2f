#!/usr/bin/env bash
# The ninth session's device calls (the seventh's and eighth's variants, still unmeasured, and the KDA
# hand-off), each under the 10-minute limit; chain them while the machine is warm. Logs and JSON under $OUT.
#   part 1: GPU tests of the 7th-9th sessions' changes (bulk ring, MLA combine cut, lazy KDA rollback,
#           one-launch greedy picks and top-k, fp32 logits, the hand-offs), then the hand-off and the bulk
#           GEMV in the whole decode step at 32K, one process (dev/decode_launch_ab.py)
#   part 2: the product's bench at 32K (the eighth session's verification and round changes) beside the
#           same with both lab switches (bench modifiers handoff, latewait), each in its own process
#   part 3: the MLA and selection variants in the whole step
set -uo pipefail
export PYTHONPATH=$PWD SOLO_CACHE_DIR=/tmp/solo_cache PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}
part=${1:-1}
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,driver_version --format=csv,noheader | tee "$OUT/gpu_$part.txt"
git log --oneline | head -1 | tee -a "$OUT/gpu_$part.txt"
if [ "$part" = 1 ]; then
    timeout 230 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_gpu_cuda_step.py \
        tests/test_gpu_fused_step.py tests/test_cuda_moe.py -k "handoff or late_wait or norm_projection or swiglu or gated or router or lazy or speculation or greedy or pdl" \
        > "$OUT/gpu_tests.log" 2>&1
    echo "tests rc=$?"; tail -5 "$OUT/gpu_tests.log"
    timeout 60 python3 -m pytest -q -p no:cacheprovider tests/test_kda_handoff.py tests/test_greedy_kernel.py tests/test_topk_kernel.py tests/test_kernels.py \
        -k "handoff or greedy or argmax or accept or counter or lm_head or top_k or dispatch or custom_op" >> "$OUT/gpu_tests.log" 2>&1
    echo "tests (kernels) rc=$?"; tail -3 "$OUT/gpu_tests.log"
    timeout 70 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_gpu_engine.py \
        -k "compiled_distribution or speculation" >> "$OUT/gpu_tests.log" 2>&1
    echo "tests (engine) rc=$?"; tail -3 "$OUT/gpu_tests.log"
    timeout 225 python3 dev/decode_launch_ab.py --context 32768 --json "$OUT/launch_ab_handoff_bulk.json" --variants \
        "product;hand-off;shared gate_up late wait;hand-off + shared gate_up late wait;bulk + hand-off" 2>&1 | tee "$OUT/launch_ab_handoff_bulk.log" | grep -v "^  "
elif [ "$part" = 1s ]; then  # part 1 for a short device window: fewer tests and variants
    timeout 200 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_gpu_cuda_step.py tests/test_gpu_fused_step.py \
        tests/test_gpu_engine.py -k "handoff or late_wait or lazy or speculation or greedy or compiled_distribution" \
        > "$OUT/gpu_tests.log" 2>&1
    echo "tests rc=$?"; tail -5 "$OUT/gpu_tests.log"
    timeout 50 python3 -m pytest -q -p no:cacheprovider tests/test_kda_handoff.py tests/test_greedy_kernel.py \
        tests/test_topk_kernel.py >> "$OUT/gpu_tests.log" 2>&1
    echo "tests (kernels) rc=$?"; tail -3 "$OUT/gpu_tests.log"
    timeout 200 python3 dev/decode_launch_ab.py --context 32768 --json "$OUT/launch_ab_handoff.json" --variants \
        "product;hand-off;hand-off + shared gate_up late wait" 2>&1 | tee "$OUT/launch_ab_handoff.log" | grep -v "^  "
elif [ "$part" = 2 ]; then  # the product and the lab switches side by side in the product's bench
    timeout 570 python3 -m solo bench decode --random-weights ling-3.0-flash \
        --configs cuda:fp8:fused+cuda+pdl,cuda:fp8:fused+cuda+pdl+handoff+latewait \
        --context 32768 --prefill "" --loop-tokens 0 --json "$OUT/bench_32k.json" > "$OUT/bench_32k.log" 2>&1
    echo "bench rc=$?"; grep -v "^  " "$OUT/bench_32k.log" | tail -40
else
    timeout 560 python3 dev/decode_launch_ab.py --context 32768 --json "$OUT/launch_ab_mla_select.json" --variants \
        "product;MLA combine in 4 latent slices;MLA one token: heads in two programs;MLA attention transposed;fast selection" \
        2>&1 | tee "$OUT/launch_ab_mla_select.log" | grep -v "^  "
fi

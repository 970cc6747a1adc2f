#!/usr/bin/env bash
# The seventh and eighth sessions' lab variants, measured on the lent H200 in five calls (each under the
# 10-minute limit; chain them while the machine is warm). Writes logs and JSON under $OUT.
#   part 0: GPU tests of the variants and of the eighth session's changes (lazy KDA rollback, one-launch
#           greedy picks and top-k cut, fp32 logits)
#   part 1: each variant alone (dev/moe_router_ab.py --fast-select, dev/step_kernels_probe.py --bulk,
#           dev/mla_probe.py)
#   part 2: the bulk GEMV variants inside the whole decode step at 32K, one process (dev/decode_launch_ab.py)
#   part 3: the MLA and selection variants (and the bulk ring with them) the same way
#   part 4: (eighth session) 8 programs per KDA head instead of 4 for one token
# With 30 device minutes: parts 0 and 2 first, then `solo bench decode --random-weights ling-3.0-flash
# --configs cuda:fp8:fused+cuda+pdl --context 32768 --prefill "" --loop-tokens 0` (the eighth session's
# changes are in verification and the rounds), then parts 1, 3 and 4.
# Variants: gemv_decode.cu BULK (GemvLaunch.bulk: the weights through a ring of shared-memory slots filled
# by bulk copies), the MLA combine cut by latent columns (AttendLaunch.combine_rank_parts), one token's MLA
# heads in two programs, the selection over the kept groups (FAST_SELECT, MoE kernel and CUDA router).
set -uo pipefail
export PYTHONPATH=$PWD SOLO_CACHE_DIR=/tmp/solo_cache PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}
part=${1:-0}
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,driver_version --format=csv,noheader | tee "$OUT/gpu_$part.txt"
if [ "$part" = 0 ]; then
    timeout 200 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_gpu_cuda_step.py \
        tests/test_gpu_fused_step.py tests/test_cuda_moe.py -k "bulk or combine_cut or several_steps or norm_projection or swiglu or gated or router or lazy or speculation or greedy or kda_head" \
        > "$OUT/gpu_tests_lab7.log" 2>&1
    echo "tests rc=$?"; tail -5 "$OUT/gpu_tests_lab7.log"
    # the eighth session's: the one-launch greedy picks and top-k cut (compiled), the FP8 head's fp32 logits
    timeout 60 python3 -m pytest -q -p no:cacheprovider tests/test_greedy_kernel.py tests/test_topk_kernel.py tests/test_kernels.py \
        -k "greedy or argmax or accept or counter or lm_head or top_k or dispatch or custom_op" >> "$OUT/gpu_tests_lab7.log" 2>&1
    echo "tests (8th) rc=$?"; tail -3 "$OUT/gpu_tests_lab7.log"
    timeout 90 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_gpu_engine.py \
        -k "compiled_distribution or speculation" >> "$OUT/gpu_tests_lab7.log" 2>&1
    echo "tests (8th, sampling) rc=$?"; tail -3 "$OUT/gpu_tests_lab7.log"
elif [ "$part" = 1 ]; then
    timeout 130 python3 dev/step_kernels_probe.py --bulk --json "$OUT/probe_bulk.json" \
        --shapes qkvfgb,o_proj,mla_proj,mla_dense,shared_gate_up,shared_down,dense_gate_up,dense_down \
        2>&1 | tee "$OUT/probe_bulk.log" | grep -v "^  "
    timeout 80 python3 dev/moe_router_ab.py --fast-select 2>&1 | tee "$OUT/moe_router_fast_select.log"
    timeout 130 python3 dev/mla_probe.py --contexts 32768 --pick 0,5,6,7,8,9,10,11,12 --json "$OUT/mla_probe_combine.json" 2>&1 \
        | tee "$OUT/mla_probe_combine.log"
elif [ "$part" = 2 ]; then
    timeout 560 python3 dev/decode_launch_ab.py --context 32768 --json "$OUT/launch_ab_lab7_bulk.json" --variants \
        "product;bulk;bulk, 8 warps;bulk, at most 8 slots;bulk, at most 5 slots;bulk: qkvfgb, q|kv_a|g, MLP;bulk: o_proj, dense, downs" \
        2>&1 | tee "$OUT/launch_ab_lab7_bulk.log"
elif [ "$part" = 4 ]; then  # (eighth session) programs per KDA head, in the whole step
    timeout 300 python3 dev/decode_launch_ab.py --context 32768 --json "$OUT/launch_ab_lab8_kda.json" --variants \
        "product;KDA one token 8 value splits" 2>&1 | tee "$OUT/launch_ab_lab8_kda.log"
else
    timeout 560 python3 dev/decode_launch_ab.py --context 32768 --json "$OUT/launch_ab_lab7_other.json" --variants \
        "product;MLA combine in 4 latent slices;MLA one token: heads in two programs;MLA attention transposed;fast selection;bulk + MLA combine in 4 latent slices;bulk + fast selection" \
        2>&1 | tee "$OUT/launch_ab_lab7_other.log"
fi

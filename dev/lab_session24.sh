#!/usr/bin/env bash
# Sixteenth session, second call (meant for an H200; on an H100 it gives the profiles' timelines). On the H100
# (lab_session23.sh, h100_ab_lab23.log) the shared expert inside the MoE kernel lost +60.1 us alone but tied the
# product beside the bulk ring of 2 blocks of 8 warps on the big projections (+4.3 us; the ring alone +4.5), with
# 187 kernels a step instead of 267. First the GPU layer tests of both (against the reference modules), then one
# process at 32K (the product twice, each alone, both, the ring of 2 blocks of 10, the ring and both at 4 slots: room
# for the KDA recurrence's programs), then the product's bench
# (prefill 1K, 8K, 32K where the GPU has the memory for the 32K prompt beside the model, an H200) and the bench of
# both switches (bench modifiers inshared+bulk, no prefill), each with its profile's timeline. Results under
# $OUT: gpu_tests.log, ab.{log,json}, bench.{log,json}, bench_both.{log,json}. Say which card ran it. timeout_s 600.
LAB_DEFAULT_SECONDS=590
source dev/lab_prelude.sh
timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_gpu_fused_step.py \
    -k "shared_expert_inside or bulk_rings" > "$OUT/gpu_tests.log" 2>&1
echo "[layer tests rc=$? at ${SECONDS}s]"; tail -2 "$OUT/gpu_tests.log"
b="qkvfgb, q|kv_a|g, MLP"
default="shared expert inside;bulk, 2 blocks of 8 warps: $b;product again"
default+=";shared expert inside, bulk, 2 blocks of 8 warps: $b;bulk, 2 blocks of 10 warps: $b"
default+=";bulk, 2 blocks of 8 warps, at most 4 slots: $b;shared expert inside, bulk, 2 blocks of 8 warps, at most 4 slots: $b"
ab ab "product;${VARIANTS:-$default}" --deadline "${AB_DEADLINE:-$(($(left) - 380))}"
mem=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)
if [ "${mem:-0}" -gt 100000 ]; then PREFILL=${PREFILL-1024,8192,32768}; else PREFILL=${PREFILL-}; fi
PREFILL=$PREFILL product_bench 4096,32768 128 150
timeout $(($(left) - 5)) python3 -m solo bench decode --random-weights ling-3.0-flash \
    --configs cuda:fp8:fused+cuda+pdl+inshared+bulk --context 4096,32768 --prefill "" --loop-tokens 0 \
    --json "$OUT/bench_both.json" > "$OUT/bench_both.log" 2>&1
echo "[bench of both rc=$? at ${SECONDS}s]"; grep -E "^\| cuda" "$OUT/bench_both.log" | head -4

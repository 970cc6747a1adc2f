#!/usr/bin/env bash
# Fifteenth session, third call (meant for an H200; on an H100 it still tells the trend). The GEMVs' bulk
# ring on the big projections (q|k|v|f|g|b, MLA q|kv_a|g, the dense MLP's gate_up) lost 245 us a step at 4
# warps and 111 at 8 on the H100 (h100_ab_lab18.log): a block of 4 warps is an SM's only consumer of its ring.
# Here 10 and 20 warps, and two blocks of 8 an SM. First the GEMV's GPU tests of the bulk ring (against the
# reference: more warps sum K in another order, so the A/B's logits differ from the product's), then one
# process at 32K, then the product bench at 4K and 32K (prefill 1K, 8K, 32K where the GPU has the memory for
# the 32K prompt beside the model, an H200; none on an H100). Results under $OUT: gpu_tests.log,
# ab.{log,json}, bench.{log,json}. Say which card ran it. timeout_s 600.
LAB_DEFAULT_SECONDS=585
source dev/lab_prelude.sh
timeout 120 python3 -m pytest -q -p no:cacheprovider tests/test_gpu_cuda_step.py -k "bulk" > "$OUT/gpu_tests.log" 2>&1
echo "[GEMV bulk tests rc=$? at ${SECONDS}s]"; tail -2 "$OUT/gpu_tests.log"
b="qkvfgb, q|kv_a|g, MLP"
default="bulk, 8 warps: $b;bulk, 10 warps: $b;bulk, 20 warps: $b;bulk, 2 blocks of 8 warps: $b;product again"
ab ab "product;${VARIANTS:-$default}" --deadline "${AB_DEADLINE:-$(($(left) - 330))}"
mem=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)
if [ "$(left)" -gt 250 ]; then
    if [ "${mem:-0}" -gt 100000 ]; then PREFILL=${PREFILL-1024,8192,32768}; else PREFILL=${PREFILL-}; fi
    PREFILL=$PREFILL product_bench 4096,32768 128
else
    echo "no time left for the bench ($(left) s)"
fi

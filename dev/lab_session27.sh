#!/usr/bin/env bash
# Eighteenth session: the MoE kernel asking the L2 for the weights the step reads after it (moe_decode.cu L2_NEXT,
# FusedDecodeStep.prefetch_next_weights, DecodeKernelConfig.l2_next_at), while HBM idles in its tail and in the
# shared expert's two short kernels: the shared expert's weights and the next layer's input projection's first MB.
# First the GPU tests (the MoE kernel with regions bit for bit against the plain one; whole decode steps with each
# l2_next_at bit for bit), then one process at 32K: the product, the variants, the product again. On an H200 also
# the window ring (seventeenth session's H100 product for verification) and the bulk ring of 2 blocks of 8 warps on
# the decode step's big projections. Then, with time left, the product's bench.
# Results under $OUT: gpu_tests.log, ab.{log,json} (bench.{log,json}). Say which card ran it. timeout_s 600.
LAB_DEFAULT_SECONDS=585
source dev/lab_prelude.sh
timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_cuda_moe.py tests/test_gpu_fused_step.py \
    -k "l2_for_later or asking_the_l2" > "$OUT/gpu_tests.log" 2>&1
echo "[GPU tests rc=$? at ${SECONDS}s]"; tail -2 "$OUT/gpu_tests.log"
n="L2 next:"
default="$n shared + 8 MB, after the exchange;$n shared expert, after the copies;$n shared + 8 MB, after the copies"
default+=";$n shared + 8 MB, at the end;product again;$n shared + 16 MB, after the exchange"
default+=";$n 8 MB, after the exchange;$n shared + 4 MB, after the exchange;$n shared expert, after the exchange"
if nvidia-smi -L | grep -q H200; then
    b="qkvfgb, q|kv_a|g, MLP"
    default+=";window ring: $b;bulk, 2 blocks of 8 warps: $b"
fi
ab ab "product;${VARIANTS:-$default}" --deadline "${AB_DEADLINE:-$(($(left) - 200))}"
if [ "$(left)" -gt 150 ]; then product_bench 32768 0 5; fi

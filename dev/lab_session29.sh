#!/usr/bin/env bash
# Eighteenth session, third call: on the H100 each MoE kernel now asks the L2 for the shared expert's weights and
# the next input projection's first 16 MB once its block's copies landed (L2_NEXT_CARDS; lab28 and lab29 gave
# -28 to -44 us at 32K). The GPU tests of the product with it (the fused layers, graphs, speculation, PDL, the
# rebuilt kernels' graphs, and the asks bit for bit), then one process at 32K: the product against it turned off
# and at 24 MB, and (the table now in shared memory) after the exchange, at the end, at the wait, and the KDA kernels
# asking for their output projection's weight (FusedDecodeStep.kda_l2_ahead); then the product's bench at 4K and 32K with the real loop. On an H200 (none of this measured
# there) the same sizes turned on, and verification's window ring.
# Results under $OUT: gpu_tests.log, ab.{log,json}, bench.{log,json}. Say which card ran it. timeout_s 600.
LAB_DEFAULT_SECONDS=585
source dev/lab_prelude.sh
timeout 170 python3 -m pytest -q -p no:cacheprovider tests/test_gpu_fused_step.py tests/test_cuda_moe.py \
    -k "l2_for_later or asking_the_l2 or every_fused_layer or speculation_on_the_fused_step or greedy_decode_in_graphs or pdl_launches or built_again" \
    > "$OUT/gpu_tests.log" 2>&1
echo "[GPU tests rc=$? at ${SECONDS}s]"; tail -2 "$OUT/gpu_tests.log"
n="L2 next:"
if nvidia-smi -L | grep -q H200; then
    default="$n shared + 16 MB, after the copies;$n shared + 8 MB, after the copies;product again"
    default+=";$n shared + 24 MB, after the copies;window ring: qkvfgb, q|kv_a|g, MLP;KDA asks the L2 for o_proj"
else
    default="L2 next off;KDA asks the L2 for o_proj;$n shared + 24 MB, after the copies;product again"
    default+=";$n shared + 16 MB, after the exchange"
    default+=";$n shared + 16 MB, at the end;$n shared + 8 MB, at the wait;L2 next off, again"
fi
ab ab "product;${VARIANTS:-$default}" --deadline "${AB_DEADLINE:-$(($(left) - 300))}"
mem=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)
if [ "${mem:-0}" -gt 100000 ]; then PREFILL=${PREFILL-1024,8192,32768}; else PREFILL=${PREFILL-}; fi
PREFILL=$PREFILL product_bench 4096,32768 128 5
grep -o '"l2_next": {[^}]*}' "$OUT/bench.json" | head -1

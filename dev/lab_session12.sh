#!/usr/bin/env bash
# The next device call (written in the eleventh session, for the twelfth). The eleventh's A/B of decode
# variants faulted, then hung, because kernels built again freed what the graphs captured before read (the
# MoE kernel's schedule table, the CUDA router's counters); fixed since, not yet run on a GPU. In order:
# 1. the GPU test that replays graphs captured before and after kernels are built again, beside the fused
#    step's other GPU tests of lab switches (hand-offs, late wait, combine slices, lazy rollback), and the
#    MoE kernel's scales after the products (DecodeKernelConfig.post_scale, written in the eleventh session);
# 2. dev/decode_launch_ab.py at 32K, the full shape, every variant in one process (interleaved timing);
# 3. where time is left, the product bench at 32K (the issue's number; the H200's last was 2.472 ms).
# Results under $OUT: gpu_tests.log, ab_all.{log,json}, bench.{log,json}. LAB_SECONDS bounds the whole.
LAB_DEFAULT_SECONDS=560
source dev/lab_prelude.sh
timeout "${TEST_TIMEOUT:-170}" python3 -m pytest -q -p no:cacheprovider tests/test_gpu_fused_step.py tests/test_cuda_moe.py \
    -k "built_again or handoff or late or combine or lazy or scales_after or persistent_matches_reference" > "$OUT/gpu_tests.log" 2>&1
echo "[tests rc=$? at ${SECONDS}s]"; grep -E "^FAILED|passed|failed" "$OUT/gpu_tests.log" | tail -8
ab ab_all "product;${VARIANTS:-hand-off;shared gate_up late wait;hand-off + shared gate_up late wait;fast selection;MoE scales after the products;MoE scales after the products + fast selection;MLA combine in 4 latent slices;MLA one token: heads in two programs;bulk}" \
    --deadline "${AB_DEADLINE:-260}"
if [ "$(left)" -gt 150 ]; then
    product_bench 32768 0
else
    echo "no time left for the bench ($(left) s)"
fi

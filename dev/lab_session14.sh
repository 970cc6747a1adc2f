#!/usr/bin/env bash
# The twelfth session's third device call: the product with the MLA switches and the fast selection on
# (one token's heads in two programs, the combine in 4 latent slices, the routers' selection over the kept
# groups). In order:
# 1. the GPU tests that run those defaults: the whole fused step file, the routers against the reference;
# 2. the product bench at 4K and 32K with the real loop (the numbers);
# 3. dev/decode_launch_ab.py at 32K where time is left: the product against the switches undone and the
#    one-token transposed attention on one warpgroup.
# Results under $OUT: gpu_tests.log, bench.{log,json}, ab.{log,json}. LAB_SECONDS bounds the whole.
LAB_DEFAULT_SECONDS=570
source dev/lab_prelude.sh
timeout "${TEST_TIMEOUT:-200}" python3 -m pytest -q -p no:cacheprovider tests/test_gpu_fused_step.py \
    tests/test_gpu_cuda_step.py::test_the_router_chooses_as_the_reference \
    tests/test_cuda_moe.py::test_gpu_router_inside_the_kernel_chooses_as_the_reference > "$OUT/gpu_tests.log" 2>&1
echo "[tests rc=$? at ${SECONDS}s]"; grep -E "^FAILED|passed|failed" "$OUT/gpu_tests.log" | tail -8
product_bench "${CONTEXTS:-4096,32768}" 128 60
if [ "$(left)" -gt 100 ]; then
    ab ab "product;${VARIANTS:-MLA and selection as before the twelfth session;MLA one token transposed, 4 warps;MLA one token transposed, 4 warps, heads in one program}" \
        --deadline $(($(left) - 70))
else
    echo "no time left for the A/B ($(left) s)"
fi

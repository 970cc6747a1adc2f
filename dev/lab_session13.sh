#!/usr/bin/env bash
# The twelfth session's second device call. Its first (dev/lab_session12.sh) confirmed the fix of kernels
# built again (every variant captured and timed in one process) and showed the MoE kernel's scales after the
# products wrong by design (removed); the MLA switches each won 9-13 us alone. In order:
# 1. the fused step's MLA GPU tests: long contexts, several steps a split (plain and transposed), the
#    combine cut by latent columns;
# 2. dev/decode_launch_ab.py at 32K: the MLA switches alone and together, the transposed attention's
#    launches, fast selection, KDA with 8 value splits; every variant's logits checked against the
#    product's before timing;
# 3. where time is left, the product bench at 32K.
# Results under $OUT: gpu_tests.log, ab.{log,json}, bench.{log,json}. LAB_SECONDS bounds the whole.
LAB_DEFAULT_SECONDS=420
source dev/lab_prelude.sh
timeout "${TEST_TIMEOUT:-150}" python3 -m pytest -q -p no:cacheprovider tests/test_gpu_fused_step.py \
    -k "mla or combine" > "$OUT/gpu_tests.log" 2>&1
echo "[tests rc=$? at ${SECONDS}s]"; grep -E "^FAILED|passed|failed" "$OUT/gpu_tests.log" | tail -8
mla="MLA combine in 4 latent slices"
ab ab "product;${VARIANTS:-$mla;MLA one token: heads in two programs;MLA attention transposed;MLA attention transposed, 4 warps;MLA attention transposed, 128 positions a step;$mla + heads in two programs;$mla + transposed;$mla + heads in two programs + fast selection;fast selection;KDA one token 8 value splits}" \
    --deadline "${AB_DEADLINE:-200}"
if [ "${BENCH:-1}" = 1 ] && [ "$(left)" -gt 120 ]; then
    product_bench 32768 0
else
    echo "no time left for the bench ($(left) s)"
fi

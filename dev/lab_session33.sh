#!/usr/bin/env bash
# Nineteenth session, fourth lab. On an H200: what never ran there (the big projections' bulk rings and L2 hints,
# one token's MLA asking the L2 for its first step of old rows early, the H100's MoE asks), one process at 32K,
# then the product's bench with prefills. On an H100: the MLA test with the asks in the loop (each step asking for
# the step 2 later: AttendLaunch.ahead_steps), their A/B at 32K, then the product's bench at 4K and 32K with the
# real loop (the MLA's early asks are its product since lab32/lab33). Results under $OUT: (H100: gpu_tests.log)
# ab.{log,json}, bench.{log,json}.
# timeout_s 600.
LAB_DEFAULT_SECONDS=585
source dev/lab_prelude.sh
if nvidia-smi -L | grep -q H200; then
    big="qkvfgb, q|kv_a|g, MLP"
    default="bulk, 2 blocks of 8 warps: $big;MLA one token: L2 asks for the first step early"
    default+=";L2 next: shared + 16 MB, after the copies;bulk, 2 blocks of 10 warps: $big;L2 ahead 2: $big"
    default+=";product again;MLA one token: L2 asks for the first step early, again"
    ab ab "product;${VARIANTS:-$default}" --deadline "${AB_DEADLINE:-$(($(left) - 330))}"
    PREFILL=${PREFILL-1024,8192,32768} product_bench 4096,32768 128 5
else
    timeout 100 python3 -m pytest -q -p no:cacheprovider tests/test_gpu_fused_step.py -k "splits_of_several" \
        > "$OUT/gpu_tests.log" 2>&1
    echo "[GPU tests rc=$? at ${SECONDS}s]"; tail -2 "$OUT/gpu_tests.log"
    a="MLA one token: L2 asks"
    ab ab "product;$a 2 steps ahead in the loop;$a 3 steps ahead in the loop;product again" --deadline 120
    product_bench 4096,32768 128 5
fi
grep -o '"mla_early_chunks": [0-9]*' "$OUT/bench.json" | head -1

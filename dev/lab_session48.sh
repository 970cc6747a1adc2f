#!/usr/bin/env bash
# Twenty-first session, first H100 call: the down warps do the first slot pairs' down products while the gate_up warps
# still work (DecodeKernelConfig.early_pairs, moe_decode.cu EARLY_PAIRS; lab43's trace: after the last activation the
# down phase took about 1 us a pair, 0.6-0.85 us of it products, while the six down warps had idled since the
# selection). The GPU tests of the persistent kernel (the early pairs bit for bit the product's, with and without the
# router inside), the kernel alone with its trace, then one process at 32K. Results under $OUT: gpu_tests.log,
# moe_router.log, ab.{log,json}. timeout_s 600.
LAB_DEFAULT_SECONDS=585
source dev/lab_prelude.sh
timeout 120 python3 -m pytest -q -p no:cacheprovider tests/test_cuda_moe.py -m gpu > "$OUT/gpu_tests.log" 2>&1
echo "[GPU tests rc=$? at ${SECONDS}s]"; tail -3 "$OUT/gpu_tests.log"
timeout 110 python3 dev/moe_router_ab.py --rounds 2 --per-block \
    --configs "gate_up_window=3;gate_up_window=3,early_pairs=1;gate_up_window=3,early_pairs=2" > "$OUT/moe_router.log" 2>&1
echo "[moe_router rc=$? at ${SECONDS}s]"; grep -v Warning "$OUT/moe_router.log" | grep -E "^  router|checks" | head -12
ab ab "product;${VARIANTS:-MoE early pairs 1;MoE early pairs 2;product again;MoE early pairs 1, again}" \
    --deadline "${AB_DEADLINE:-$(($(left) - 10))}"

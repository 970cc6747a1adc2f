#!/usr/bin/env bash
# (Ran at beb8d80, whose DecodeKernelConfig.pair_step and its A/B variants were taken out again after it lost: check that
# commit out to run it again.)
# Twentieth session, last H100 call (a short budget): the MoE kernel's down phase two or four slot pairs a step
# (DecodeKernelConfig.pair_step, moe_decode.cu PAIR_STEP; lab43's trace: with the gate_up window each pair took about
# 1 us, of which 0.45-0.6 us products). The GPU test (bit for bit the product's, with and without the router inside),
# then one process at 32K. Results under $OUT: gpu_tests.log, ab.{log,json}. timeout_s 280.
LAB_DEFAULT_SECONDS=265
source dev/lab_prelude.sh
timeout 80 python3 -m pytest -q -p no:cacheprovider tests/test_cuda_moe.py -k "pair_step" > "$OUT/gpu_tests.log" 2>&1
echo "[GPU tests rc=$? at ${SECONDS}s]"; tail -2 "$OUT/gpu_tests.log"
ab ab "product;${VARIANTS:-MoE pair step 4;MoE pair step 2;product again;MoE pair step 4, again}" \
    --deadline "${AB_DEADLINE:-$(($(left) - 10))}"

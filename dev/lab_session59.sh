#!/usr/bin/env bash
# Twenty-fourth session: what lab_session58.sh's H200 branch runs, fitted to what device time is left (LAB_SECONDS),
# since every try at an H200 costs 90-180 s of it. The product's bench at 32K only where at least 480 s are left (it
# needs about 150 s on a fresh machine), then the A/B of the H200's levers (its product row is the step's time too):
# the big projections' bulk rings, also with the L2 asks, and their register path at 8 and 10 warps a block (the
# H200's big projections stop near 2.9 TB/s, dev/gemv_stream_fit.py). Then the steady probe with what is left (its
# launches now with the bulk rings and 8 warps).
# An H100 (a call of kind nvidia-h200 may get one) runs the whole GPU suite instead: lab_session58.sh's H100 branch
# ran this session (h100_*_lab58.log).
# Results under $OUT: bench.{log,json} (H200, if time), ab.{log,json}, steady.log; gpu_tests.log (H100). timeout_s 600.
LAB_DEFAULT_SECONDS=585
source dev/lab_prelude.sh
if nvidia-smi -L | grep -q H200; then
    if [ "$(left)" -ge 480 ]; then PREFILL="" product_bench 32768 128 $(($(left) - 330)); fi
    big="qkvfgb, q|kv_a|g, MLP"
    # most telling first (the A/B leaves out what its deadline does not reach): the launches that might lift the big
    # projections' stream, the H100's levers, a second capture of the product for the spread, then the rest
    default="bulk, 2 blocks of 8 warps: $big;8 warps: $big;L2 next: shared + 16 MB, after the copies;L2 fetch 256 B"
    default+=";product again;MoE gate_up window 3;MLA one token: L2 asks for the first step early"
    default+=";bulk, 2 blocks of 8 warps: $big + L2 next: shared + 16 MB, after the copies;10 warps: $big"
    ab ab "product;${VARIANTS:-$default}" --deadline "$(($(left) - 80))"
    steady_probe $(($(left) - 5))
else
    # (the device has no uvicorn or openai: the modules importing them are left out)
    gpu_tests $(($(left) - 5)) tests/ --ignore=tests/test_lm_eval.py --ignore=tests/test_server.py \
        --ignore=tests/test_server_api.py -rfE
fi

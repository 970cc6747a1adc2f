#!/usr/bin/env bash
# Twenty-seventh session, third call. On an H200: the product as lab_session70's two H200 calls made it there (the
# Gluon ring for one token's MLA attention and the MoE kernels' gate_up window of 3, both now on its card lists):
# its bench at 4K and 32K, then the A/B at 32K of both undone, of the L2 asks for the next weights (-6.8 us once) and
# of verification's big projections through the window ring (the H100's; "bulk, 2 blocks of 8 warps" on all calls
# gave verification -159 us there), then the whole GPU suite. On an H100 (whose product did not change): the GPU
# suite only. Results under $OUT: bench.{log,json}, ab.{log,json}, gpu_tests.log. timeout_s LAB_SECONDS + 30.
LAB_DEFAULT_SECONDS=560
source dev/lab_prelude.sh
if nvidia-smi -L | grep -q H200; then
    PREFILL="" product_bench 4096,32768 128 $(($(left) - 200))
    t="MLA one token: Triton attention"
    w="window ring: qkvfgb, q|kv_a|g, MLP"
    l="L2 next: shared + 16 MB, after the copies"
    default="$t;MoE gate_up tiles all at once;$l;$w;product again;$l, again;$w, again;$t, again"
    ab ab "product;${VARIANTS:-$default}" --deadline "$(($(left) - 150))"
fi
# (the device has no uvicorn or openai: the modules importing them are left out)
gpu_tests $(($(left) - 5)) tests/ --ignore=tests/test_lm_eval.py --ignore=tests/test_server.py \
    --ignore=tests/test_server_api.py -rfE

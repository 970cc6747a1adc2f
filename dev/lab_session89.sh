#!/usr/bin/env bash
# Thirty-fifth session: the H200's agenda in one call, since machines come seldom. On an H200: the GPU tests of the
# fused KDA front and of verification through the window rings; the A/B at 32K of the front (rings of 3 and 4, g last)
# and of the window rings beside the product (twice), and the L2 asks after the MoE copies (the H100's; -6.8 us once
# on an H200, h200_ab_lab70.log); with time left (LAB_SECONDS 560) the bench at 32K of the product with the front
# forced on (kdafront) beside the product; then the sampling top-k's tests and sweep. On an H100 (the session's first
# two ran dev/lab_session88.sh's H100 half, h100_warp_select_lab89.log, and the product's bench, h100_bench_lab89.log):
# the top-k's tests and sweep only. Results under $OUT: [gpu_tests.log, ab.{log,json}, bench.{log,json},]
# topk_tests.log, topk.log. timeout_s LAB_SECONDS + 20.
LAB_DEFAULT_SECONDS=560
source dev/lab_prelude.sh
# topk: the sampling top-k (per-row merges since the thirty-fifth session): its tests at the real vocabulary, then its
# chunking (dev/topk_sweep.py: two levels with a group), within SECONDS
topk() {
    timeout 60 python3 -m pytest -q -p no:cacheprovider tests/test_topk_kernel.py > "$OUT/topk_tests.log" 2>&1
    echo "[top-k tests rc=$? at ${SECONDS}s]"; tail -1 "$OUT/topk_tests.log"
    timeout "$1" python3 dev/topk_sweep.py > "$OUT/topk.log" 2>&1
    echo "[top-k sweep rc=$? at ${SECONDS}s]"; grep -E "torch.topk [0-9]|fastest|product|not the" "$OUT/topk.log"
}
if nvidia-smi -L | grep -q H200; then
    gpu_tests 120 tests/test_gpu_fused_step.py -k "fused_kda_front or window_rings"
    grep -E "worst rel" "$OUT/gpu_tests.log" | head -4
    f="KDA front fused, ring of 3, g last"
    w="window ring: qkvfgb, q|kv_a|g, MLP"
    ab ab "product;$f;$w;KDA front fused, ring of 4, g last;product again;$f, again;$w, again;L2 next: shared + 16 MB, after the copies" \
        --deadline "$(($(left) - 130))"
    if [ "$(left)" -gt 300 ]; then
        timeout $(($(left) - 60)) python3 -m solo bench decode --random-weights ling-3.0-flash \
            --configs cuda:fp8:fused+cuda+pdl+kdafront,cuda:fp8:fused+cuda+pdl --context 32768 --prefill "" \
            --loop-tokens 16 --json "$OUT/bench.json" > "$OUT/bench.log" 2>&1
        echo "[bench rc=$? at ${SECONDS}s]"; grep -E "^\| cuda|kda" "$OUT/bench.log" | head -8
    fi
    [ "$(left)" -gt 50 ] && topk $(($(left) - 70))
else
    # (the session's first H100 ran the warp selection's A/B, h100_warp_select_lab89.log; its second the product's
    # bench at 32K, h100_bench_lab89.log): the top-k only
    topk 120
fi

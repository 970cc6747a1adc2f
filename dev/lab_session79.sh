#!/usr/bin/env bash
# For the thirty-first session (on an H200 after dev/lab_session78.sh, on the same warm machine; or on an H100):
# 1. the MoE kernel's producer starting its copies from the ranking's own writes, before warp 0 sums and divides the
#    weights (DecodeKernelConfig.early_ids, new): its GPU tests (the router inside against the reference), the kernel
#    alone traced (dev/moe_router_ab.py), then the decode step at 32K, twice each;
# 2. on an H200 only, in the same A/B: the launch variants chosen on H100s and never (or not since the H200's step
#    reached 2.35 ms) measured in the H200's step: the L2 asks after the MoE copies (L2_NEXT_CARDS: the H100's only;
#    -6.8 us once on the H200, h200_ab_lab70.log), blocks an SM, the early down pairs, the shared gate_up's late wait,
#    the output projections' launches.
# Results under $OUT: gpu_tests.log, moe_router.log, ab.{log,json}. timeout_s LAB_SECONDS + 30.
LAB_DEFAULT_SECONDS=560
source dev/lab_prelude.sh
gpu_tests 150 tests/test_cuda_moe.py -k early_ids
moe_router 100 "^  router inside|selection done|producer has|first gate_up tile landed|block end|checks" \
    --rounds 3 --calls 16 --configs "gate_up_window=3;gate_up_window=3,early_ids=1"
e="MoE experts before the weights"
v="product;$e;product again;$e, again"
if nvidia-smi -L | grep -q H200; then
    v+=";L2 next: shared + 16 MB, after the copies;L2 next: shared + 32 MB, after the copies"
    v+=";L2 next: shared + 8 MB, after the copies"
    v+=";at most 2 blocks/SM;o_proj, dense: 2 blocks an SM;qkvfgb, q|kv_a|g: 7 blocks an SM"
    v+=";MoE early pairs 1;shared gate_up late wait;MoE on 4 SMs fewer, shared gate_up late wait"
    v+=";o_proj, dense: 8 warps, 4 in flight"
    v+=";window ring: o_proj, dense, downs;product, a third time"
fi
ab ab "$v" --deadline "$(($(left) - 20))"

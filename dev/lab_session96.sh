#!/usr/bin/env bash
# Thirty-eighth session, after dev/lab_session95.sh (h100_ab_lab95.log): the NEXTN rounds in graphs under PDL with
# verification's whole shared expert beside its router, after the fix that holds its activations until the join (in
# lab95 they were freed at once, their buffer went to the router's expert ids, and a graph replay faulted), and its
# layer test; on an H200 with time left the A/B at 32K of the H200's agenda (the fused KDA front, the window rings,
# verification's Gluon ring, the shared gate_up beside the router), once each. Results under $OUT: gpu_tests.log[,
# ab.{log,json}]. timeout_s LAB_SECONDS + 20.
LAB_DEFAULT_SECONDS=400
source dev/lab_prelude.sh
gpu_tests 170 tests/test_gpu_fused_step.py -k "shared_expert_beside or pdl_launches"
grep -E "worst|FAILED|passed|failed" "$OUT/gpu_tests.log" | head -8
if nvidia-smi -L | grep -q H200 && [ "$(left)" -gt 200 ]; then
    ab ab "product;KDA front fused, ring of 3, g last;window ring: qkvfgb, q|kv_a|g, MLP;MLA verification: Gluon ring;shared gate_up beside the router;product again" \
        --deadline "$(($(left) - 60))"
fi

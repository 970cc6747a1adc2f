#!/usr/bin/env bash
# Twentieth session, last call. On an H200: dev/lab_session37.sh (the steady probe, the A/B at 32K of what never ran
# there, the H100's MoE gate_up window among them, the bench with prefills). On an H100: the GPU tests of the persistent
# MoE kernel and of the fused step with the session's product (the gate_up window on every MoE kernel there), into
# gpu_tests.log. timeout_s 600.
LAB_DEFAULT_SECONDS=585
source dev/lab_prelude.sh
if nvidia-smi -L | grep -q H200; then
    LAB_SECONDS=$(left) bash dev/lab_session37.sh
    exit $?
fi
timeout $(($(left) - 10)) python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_cuda_moe.py \
    tests/test_gpu_fused_step.py tests/test_preflight.py > "$OUT/gpu_tests.log" 2>&1
echo "[GPU tests rc=$? at ${SECONDS}s]"; grep -E "passed|failed|FAILED|Error" "$OUT/gpu_tests.log" | tail -8

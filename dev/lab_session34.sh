#!/usr/bin/env bash
# Nineteenth session, fifth lab: the persistent MoE kernel fills every SM, so the shared expert's gate_up after it
# (3.9 MB, about 2.4 us on the critical path a layer) can start only as its blocks leave. At Ling shapes 128 blocks
# take the same most bytes a block as 132 (PersistentDecodeMoE.set_blocks), which leaves 4 SMs free: the shared
# gate_up, normalising x itself and waiting for the MoE kernel only at its end (shared_late_wait), on a grid cut to
# what fits there (GemvLaunch.max_grid), could then run beside it. The GPU tests (fewer blocks bit for bit with
# graphs of both counts in turn; the late-waiting gate_up against the reference layers), then one process at 32K.
# On an H200 the H200 branch of dev/lab_session33.sh's A/B first. Results under $OUT: gpu_tests.log, ab.{log,json}.
# timeout_s 600.
LAB_DEFAULT_SECONDS=585
source dev/lab_prelude.sh
timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_cuda_moe.py tests/test_gpu_fused_step.py \
    -k "fewer_blocks or shared_gate_up_waiting_late" > "$OUT/gpu_tests.log" 2>&1
echo "[GPU tests rc=$? at ${SECONDS}s]"; tail -2 "$OUT/gpu_tests.log"
f="MoE on 4 SMs fewer"
mine="$f;$f, shared gate_up late wait;$f, shared gate_up late wait on 8 blocks;$f, shared gate_up late wait on 4 blocks"
mine+=";shared gate_up late wait on 8 blocks;shared gate_up late wait"
if nvidia-smi -L | grep -q H200; then
    big="qkvfgb, q|kv_a|g, MLP"
    default="bulk, 2 blocks of 8 warps: $big;MLA one token: L2 asks for the first step early"
    default+=";L2 next: shared + 16 MB, after the copies;$f, shared gate_up late wait on 8 blocks;product again"
    default+=";bulk, 2 blocks of 10 warps: $big;L2 ahead 2: $big;$f, shared gate_up late wait"
    ab ab "product;${VARIANTS:-$default}" --deadline "${AB_DEADLINE:-$(($(left) - 60))}"
else
    ab ab "product;$mine;product again" --deadline $(($(left) - 60))
fi

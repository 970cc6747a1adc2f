#!/usr/bin/env bash
# Nineteenth session: two new questions, one process at 32K each card.
# 1. The MoE kernel's routing (about 6 us after its wait) leaves HBM idle; the producer's bulk prefetches asked
#    there lost (+117.6 us on the H100, lab30), perhaps because the expert copies then queue behind them on the
#    copy engine. The down warps, idle until the selection, ask a line a thread on the load path instead
#    (DecodeKernelConfig.l2_next_at 5 at the wait, 6 before it).
# 2. The output projections' bulk ring: their 10.5 MB fit in three slots a block, filled before the wait, while
#    the KDA recurrence runs beside them (never measured in the decode step).
# On an H200 instead what was never measured there: the big projections' bulk rings (their stream, latency-bound
# at 66% of the copy rate, needs more bytes in flight than a lane's registers hold), their L2 hints, the H100's
# product asks (after the copies, 8 and 16 MB), verification's window ring; then the bench with prefills. Results under $OUT: gpu_tests.log, ab.{log,json}(, bench.{log,json}). timeout_s 600.
LAB_DEFAULT_SECONDS=585
source dev/lab_prelude.sh
timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_gpu_fused_step.py tests/test_cuda_moe.py \
    -k "l2_for_later or asking_the_l2" > "$OUT/gpu_tests.log" 2>&1
echo "[GPU tests rc=$? at ${SECONDS}s]"; tail -2 "$OUT/gpu_tests.log"
n="L2 next:"
if nvidia-smi -L | grep -q H200; then
    big="qkvfgb, q|kv_a|g, MLP"
    default="bulk, 2 blocks of 8 warps: $big;$n shared + 16 MB, after the copies;bulk, 2 blocks of 10 warps: $big"
    default+=";L2 ahead 2: $big;bulk, 2 blocks of 8 warps: $big + $n shared + 16 MB, after the copies"
    default+=";product again;$n shared + 8 MB, after the copies;window ring: $big;bulk, 3 blocks of 8 warps: $big"
    ab ab "product;${VARIANTS:-$default}" --deadline "${AB_DEADLINE:-$(($(left) - 290))}"
    PREFILL=${PREFILL-1024,8192,32768} product_bench 4096,32768 128 5
else
    default="$n shared + 8 MB, lines at the wait;bulk: o_proj, dense;$n shared + 16 MB, lines at the wait"
    default+=";bulk: o_proj;$n shared + 8 MB, lines before the wait;L2 next off;bulk, 8 warps: o_proj, dense"
    default+=";$n shared expert, lines at the wait;bulk, 2 blocks of 8 warps: o_proj, dense;product again"
    ab ab "product;${VARIANTS:-$default}" --deadline "${AB_DEADLINE:-$(($(left) - 20))}"
fi

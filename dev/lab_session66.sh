#!/usr/bin/env bash
# Twenty-sixth session, second call: the Gluon attention (solo.kernels.gluon_mla) ran alone in lab_session65
# (h100_mla_probe_lab65.log: 21.9-23.0 us at 32K against the product's 26.0, outputs equal). Here: alone again
# with two warpgroups (8 warps), the whole decode step at 32K (A/B in one process), its GPU test against the
# reference, and Nsight Compute on it at 32K (what bounds it now).
# Results under $OUT: mla_probe.log, ab.{log,json}, gpu_tests.log, ncu_ring{4,8}.txt. timeout_s LAB_SECONDS + 30.
LAB_DEFAULT_SECONDS=540
source dev/lab_prelude.sh
one='[{}, {"gluon": true}, {"gluon": true, "early_chunks": 0}, {"gluon": true, "warps": 8}'
one+=', {"gluon": true, "warps": 8, "early_chunks": 0}, {"gluon": true, "warps": 8, "early_chunks": 4}]'
timeout 120 python3 dev/mla_probe.py --contexts 4096,32768 --tokens 1 --changes "$one" > "$OUT/mla_probe.log" 2>&1
echo "[mla_probe rc=$? at ${SECONDS}s]"; grep -E "^T=" "$OUT/mla_probe.log" | cut -c1-150
g="MLA one token: Gluon ring"
default="$g;$g, 8 warps;$g, no early copies;$g, 8 warps, no early copies;product again;$g, 8 warps, again"
default+=";$g, again;$g, 8 warps, 4 early;$g, 4 early"
ab ab "product;${VARIANTS:-$default}" --deadline "$(($(left) - 190))"
gpu_tests 100 tests/test_gpu_fused_step.py -k "gluon" -rfE
for w in 4 8; do
    timeout 40 ncu --clock-control none --section SpeedOfLight --section MemoryWorkloadAnalysis \
        --section WarpStateStats --section SchedulerStats --section Occupancy --section InstructionStats \
        -k regex:"_mla_attend_ring" -c 1 python3 dev/mla_probe.py --contexts 32768 --tokens 1 \
        --changes "[{\"gluon\": true, \"warps\": $w, \"early_chunks\": 0}]" > "$OUT/ncu_ring$w.txt" 2>&1
done
echo "[ncu rc=$? at ${SECONDS}s]"; grep -E "Duration|DRAM Throughput|Warp Cycles Per Issued|Issued Ipc|No Eligible" "$OUT"/ncu_ring*.txt | head -20

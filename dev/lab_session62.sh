#!/usr/bin/env bash
# Twenty-fifth session: what bounds one token's MLA attention (about 25 us a layer at 32K on the H100, 32% of the
# copy bandwidth). lab_session61.sh showed it is not the software pipeline's depth (32 positions a step at 4-6
# stages, 16 at 8: the same or slower). Here: two programs an SM (256 splits at shared memory that fits two: 32
# positions a step at 2-3 stages, 16 at 4), half the splits (64: is a program's time its positions'?), then
# Nsight Compute on the product's attention and combine at 32K (stall reasons, issue rate, memory, the top stall
# locations in the SASS).
# Results under $OUT: mla_probe1.log, ncu_mla.txt. timeout_s 330.
LAB_DEFAULT_SECONDS=300
source dev/lab_prelude.sh
one='[{}, {"splits": 256, "block_l": 32, "stages": 2}, {"splits": 256, "block_l": 32, "stages": 3}'
one+=', {"splits": 256, "block_l": 16, "stages": 4}, {"splits": 64}, {"splits": 256, "stages": 1}]'
timeout 120 python3 dev/mla_probe.py --contexts 4096,32768 --tokens 1 --changes "$one" > "$OUT/mla_probe1.log" 2>&1
echo "[mla_probe 1 rc=$? at ${SECONDS}s]"; grep "^T=" "$OUT/mla_probe1.log"
timeout $(($(left) - 5)) ncu --clock-control none --section SpeedOfLight --section MemoryWorkloadAnalysis \
    --section WarpStateStats --section SchedulerStats --section Occupancy --section LaunchStats \
    --section ComputeWorkloadAnalysis --section InstructionStats --section SourceCounters \
    -k regex:"_mla_attend_t|_mla_combine_ranks" -c 2 \
    python3 dev/mla_probe.py --contexts 32768 --tokens 1 --changes '[{}]' > "$OUT/ncu_mla.txt" 2>&1
echo "[ncu rc=$? at ${SECONDS}s]"; grep -E "Duration|Throughput|Warp Cycles Per Issued|Issued Ipc|No Eligible|stalled" "$OUT/ncu_mla.txt" | head -30

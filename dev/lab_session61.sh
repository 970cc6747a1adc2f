#!/usr/bin/env bash
# Twenty-fifth session: the MLA attention's software pipeline. At 2 stages (the product's, one token and several)
# Triton issues each step's cache copies at the end of the step before and waits for all of them at its top
# (cp.async.wait_group 0 in the PTX, Triton 3.6 offline), so no load overlaps the products: a split of 256
# positions is four serial rounds of a 73 KB load and its products. Steps of 32 positions fit 3-6 stages in an SM's
# shared memory, keeping 1-4 steps of copies in flight. First the MLA kernels alone (dev/mla_probe.py, 7 layers in
# a graph, plain launches), one token and four, 4K and 32K; then the same launches in the whole step (A/B at 32K).
# Results under $OUT: mla_probe1.log, mla_probe4.log, ab.{log,json}. timeout_s 600.
LAB_DEFAULT_SECONDS=585
source dev/lab_prelude.sh
one='[{}, {"block_l": 32, "stages": 4}, {"block_l": 32, "stages": 5}, {"block_l": 32, "stages": 6}'
one+=', {"block_l": 16, "stages": 8}, {"block_l": 32, "stages": 5, "transposed": false, "warps": 8}]'
timeout 170 python3 dev/mla_probe.py --contexts 4096,32768 --tokens 1 --changes "$one" > "$OUT/mla_probe1.log" 2>&1
echo "[mla_probe 1 rc=$? at ${SECONDS}s]"; grep "^T=" "$OUT/mla_probe1.log"
four='[{}, {"block_l": 32, "stages": 3}, {"block_l": 32, "stages": 4}]'
timeout 80 python3 dev/mla_probe.py --contexts 4096,32768 --tokens 4 --changes "$four" > "$OUT/mla_probe4.log" 2>&1
echo "[mla_probe 4 rc=$? at ${SECONDS}s]"; grep "^T=" "$OUT/mla_probe4.log"
m="MLA one token: 32 positions a step"
default="$m, 5 stages;MLA verification: 32 positions a step, 4 stages;$m, 4 stages;product again;$m, 6 stages"
default+=";$m, 5 stages, 2 early;MLA verification: 32 positions a step, 3 stages"
ab ab "product;${VARIANTS:-$default}" --deadline "$(($(left) - 30))"

#!/usr/bin/env bash
# The next device call (written at the end of the twelfth session). The product's one-token MLA attention is
# transposed on one warpgroup since 3527eab (H200: 2.402 ms a decode step at 32K); its launch was never
# tuned in that form, and verification's attention never tried transposed alone. One process, 32K, every
# variant's logits compared with the product's (a difference needs its GPU layer test: random routing can
# carry one bf16 step into everything after it):
#   the product twice (the spread), one token transposed on 8 warps, in two programs of heads, 256 splits,
#   3 stages, 32 positions a step; verification transposed, verification in 128 splits.
# Then, where time is left, the product bench at 4K and 32K. Results under $OUT: ab.{log,json},
# bench.{log,json}. LAB_SECONDS bounds the whole.
LAB_DEFAULT_SECONDS=500
source dev/lab_prelude.sh
t="MLA one token transposed"
default="product again;$t: 8 warps;$t: heads in two programs;$t: 256 splits;$t: 3 stages;$t: 32 positions a step;MLA verification transposed;MLA verification: 128 splits"
ab ab "product;${VARIANTS:-$default}" --deadline "${AB_DEADLINE:-240}"
if [ "$(left)" -gt 120 ]; then
    product_bench 4096,32768 128
else
    echo "no time left for the bench ($(left) s)"
fi

#!/usr/bin/env bash
# The next device call (written at the end of the thirteenth session, whose last two calls got no machine).
# On the H100 the GEMVs' weights through a ring of bulk copies (gemv_decode.cu BULK, up to 210 KB a SM in
# flight) lost 346 us a step. But on the H100 the KDA projections, chained under PDL, reach 79% of its copy
# bandwidth (docs/results/h100_gemv_chain_probe_teams.log), while on the H200 the same kernel alone reached
# 67% (h200_step_kernels_probe.log, without PDL), with the same 61 KB a SM in flight in registers: the
# H200, with 1.4x the bandwidth, may be bound by the bytes in flight where the H100 is not. The ring was
# never measured in the H200's step. One process, 32K, every variant's logits
# against the product's: the product twice, the ring on the big projections (KDA, MLA q|kv_a|g, the dense
# MLP) and on every GEMV, and the GEMV tasks taken from a counter on the big projections; then the
# persistent GEMV chain probe (dev/gemv_chain_probe.py), measured on the H100 only so far.
# Results under $OUT: ab.{log,json}, chain.log. LAB_SECONDS bounds the whole. Say which card ran it: on an
# H100 the A/B repeats the thirteenth session's measurements.
LAB_DEFAULT_SECONDS=420
source dev/lab_prelude.sh
default="product again;bulk: qkvfgb, q|kv_a|g, MLP;bulk;dynamic tasks: qkvfgb, q|kv_a|g, MLP"
ab ab "product;${VARIANTS:-$default}" --deadline "${AB_DEADLINE:-200}"
if [ "$(left)" -gt 60 ]; then
    timeout $(($(left) - 5)) python3 dev/gemv_chain_probe.py --variants 20x10g1.10.4,20x10g1.10.4n,20x8g2.10.4 \
        > "$OUT/chain.log" 2>&1
    echo "[chain rc=$? at ${SECONDS}s]"; grep -v Warning "$OUT/chain.log"
fi

#!/usr/bin/env bash
# The eleventh session's device call (second form: all variants in one process first). The tenth's dev/lab_session10.sh captured every variant in one process
# at the full shape on the H100, then the first timing replay hit an illegal memory access, with no way to
# tell whose. Here each variant runs in its own process beside the product (decode_launch_ab.py replays and
# synchronises each capture at once), so a fault names its variant and leaves the others measured. If the
# product alone faults, its steps run eagerly with CUDA_LAUNCH_BLOCKING=1 to name the kernel.
set -uo pipefail
export PYTHONPATH=$PWD SOLO_CACHE_DIR=/tmp/solo_cache PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}
CONTEXT=${CONTEXT:-32768}
DEADLINE=$((SECONDS + ${LAB_SECONDS:-500}))
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,driver_version,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
ab() {  # ab TAG VARIANTS [more options]
    local tag=$1 variants=$2; shift 2
    timeout $((DEADLINE - SECONDS)) python3 dev/decode_launch_ab.py --context "$CONTEXT" --variants "$variants" \
        --json "$OUT/ab_$tag.json" "$@" > "$OUT/ab_$tag.log" 2>&1
    local rc=$?
    echo "[$tag rc=$rc at ${SECONDS}s]"; grep -E "^@|FAULT|FAILED|Error" "$OUT/ab_$tag.log" | head -5
    return $rc
}
IFS=';' read -ra variants <<< "${VARIANTS:-hand-off;shared gate_up late wait;hand-off + shared gate_up late wait;fast selection;MLA combine in 4 latent slices;MLA one token: heads in two programs;bulk}"
# all in one process first (one load, interleaved timing); where that faults, one process a variant
all="product"; for v in "${variants[@]}"; do all="$all;$v"; done
if ! ab all "$all" --deadline 240; then
    base="product;"
    if ! ab product "product"; then
        base=""  # (the variants then run alone)
        CUDA_LAUNCH_BLOCKING=1 ab product_eager "product" --eager-only
        grep -B2 -A8 "Traceback" "$OUT/ab_product_eager.log" | grep -E "File|Error" | tail -8
    fi
    i=0
    for v in "${variants[@]}"; do
        i=$((i + 1))
        if [ $((DEADLINE - SECONDS)) -lt 45 ]; then echo "left out: $v"; continue; fi
        ab "v$i" "$base$v"
    done
fi
python3 - "$OUT" <<'PY'
import json, pathlib, sys
rows = []
for f in sorted(pathlib.Path(sys.argv[1]).glob("ab_*.json")):
    r = json.loads(f.read_text())
    for name, ms in r["decode_ms"].items():
        rows.append((f.stem, name, ms, r["verify_ms"][name], r["device"], r["copy_gbs"]))
pathlib.Path(sys.argv[1], "summary.json").write_text(json.dumps(rows, indent=1))
for row in rows:
    print(f"{row[0]:10s} {row[1]:40s} decode {row[2]:.3f} verify {row[3]:.3f}  ({row[4]}, copy {row[5]:.0f} GB/s)")
PY

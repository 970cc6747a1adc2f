# Sourced by dev/lab_session12.sh and later: the device's environment, the output folder ($OUT), the
# script's deadline (LAB_SECONDS, else the script's LAB_DEFAULT_SECONDS) and the calls they share (the A/B, the bench,
# the GPU tests, the MoE kernel alone, the steady probe).
set -uo pipefail
export PYTHONPATH=$PWD SOLO_CACHE_DIR=/tmp/solo_cache PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}
DEADLINE=$((SECONDS + ${LAB_SECONDS:-${LAB_DEFAULT_SECONDS:-560}}))
left() { echo $((DEADLINE - SECONDS)); }
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,driver_version,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"

# ab NAME VARIANTS [options of dev/decode_launch_ab.py]: the A/B at 32K into $OUT/NAME.{log,json}
ab() {
    local name=$1 variants=$2
    shift 2
    timeout $(($(left) - 10)) python3 dev/decode_launch_ab.py --context 32768 --variants "$variants" \
        --json "$OUT/$name.json" "$@" > "$OUT/$name.log" 2>&1
    echo "[A/B rc=$? at ${SECONDS}s]"; grep -E "^@|FAULT|FAILED|left out|Error|outputs|unknown" "$OUT/$name.log"
}

# product_bench CONTEXTS LOOP_TOKENS [SPARE]: the product's bench into $OUT/bench.{log,json}, ending SPARE
# seconds (5) before the deadline; PREFILL names prompt lengths to time (none by default)
product_bench() {
    timeout $(($(left) - ${3:-5})) python3 -m solo bench decode --random-weights ling-3.0-flash \
        --configs cuda:fp8:fused+cuda+pdl --context "$1" --prefill "${PREFILL:-}" --loop-tokens "$2" \
        --json "$OUT/bench.json" > "$OUT/bench.log" 2>&1
    echo "[bench rc=$? at ${SECONDS}s]"; grep -E "^\| cuda" "$OUT/bench.log" | head -4
}

# gpu_tests SECONDS PYTEST_ARGS...: GPU tests (-m gpu) into $OUT/gpu_tests.log
gpu_tests() {
    local seconds=$1
    shift
    timeout "$seconds" python3 -m pytest -q -p no:cacheprovider -m gpu "$@" > "$OUT/gpu_tests.log" 2>&1
    echo "[GPU tests rc=$? at ${SECONDS}s]"; tail -3 "$OUT/gpu_tests.log"
}

# moe_router SECONDS PATTERN [options of dev/moe_router_ab.py]: the MoE kernel alone, traced, into
# $OUT/moe_router.log; prints its lines matching PATTERN
moe_router() {
    local seconds=$1 pattern=$2
    shift 2
    timeout "$seconds" python3 dev/moe_router_ab.py "$@" > "$OUT/moe_router.log" 2>&1
    echo "[moe_router rc=$? at ${SECONDS}s]"; grep -v Warning "$OUT/moe_router.log" | grep -E "$pattern" | head -20
}

# steady_probe SECONDS: the projections with their rows scaled 1, 4 and 16 times (dev/step_kernels_probe.py --steady)
# into $OUT/steady.log
steady_probe() {
    timeout "$1" python3 dev/step_kernels_probe.py --steady qkvfgb,o_proj,shared_gate_up --scales 1,4,16 \
        > "$OUT/steady.log" 2>&1
    echo "[steady rc=$? at ${SECONDS}s]"; grep -v Warning "$OUT/steady.log" | tail -12
}

#!/usr/bin/env bash
# End-to-end GPU run of the engine on the bundled model (lent H200); GSM8K comes from the package.
set -uo pipefail
export PYTHONPATH=$PWD SOLO_CACHE_DIR=/tmp/solo_cache PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv | tee "$OUT/gpu.txt"
python3 -m pytest -q -s -p no:cacheprovider tests/test_gpu_engine.py 2>&1 | tee "$OUT/gpu_tests.log"
common=(--device cuda --num-prompts "${PROMPTS:-20}" --output-len 160)
python3 -m solo.cli bench gsm8k "${common[@]}" --moe-backend torch --lm-head bf16 --json "$OUT/gsm8k_base.json" 2>&1 | grep -v "^speculative decoding: accept"
python3 -m solo.cli bench gsm8k "${common[@]}" --moe-backend triton --lm-head fp8 --speculative-algorithm NEXTN --baseline --json "$OUT/gsm8k_opt.json" 2>&1 | grep -v "^speculative decoding: accept"
python3 -m solo.cli bench gsm8k "${common[@]}" --moe-backend triton --lm-head fp8 --speculative-algorithm NEXTN --baseline --temperature 0.6 --top-p 0.95 --top-k 20 --seed 0 --json "$OUT/gsm8k_t06.json" 2>&1 | grep -v "^speculative decoding: accept"
python3 -m solo.cli bench repeat --device cuda --num-prompts 10 --input-len 256 --output-len 512 --moe-backend triton --lm-head fp8 --speculative-algorithm NEXTN --baseline --json "$OUT/repeat.json" 2>&1 | grep -v "^speculative decoding: accept"

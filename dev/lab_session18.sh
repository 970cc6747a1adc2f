#!/usr/bin/env bash
# Fourteenth session: whole tasks' weights asked of the L2 by the CUDA GEMV (gemv_decode.cu L2_AHEAD,
# GemvLaunch.l2_ahead). The GEMVs hold 5 loads a lane in registers, about 61 KB an SM; on the H200 the KDA
# projections stream at 67% of the copy bandwidth, on the H100 at 79%. Bulk prefetches to the L2 take no
# registers: the block's first tasks before its wait, or a fixed distance ahead as it goes. And the MoE
# kernel's down copies issued only once the block's gate_up tiles have landed (moe_decode.cu DOWN_AFTER):
# the activation exchange waits for the last gate_up tile anywhere, which lands near the end of the 25 MB
# when every block asks for everything at once. With them the bulk ring on the big projections, never run
# on an H200 (on the H100: +251 us). First the GPU tests of both (bit for bit the product's), then
# (after a short routing trace) one process at 32K, every variant's logits against the product's.
# Results under $OUT: gpu_tests.log; the MoE kernel's routing traced step by step with and without the early bias reads
# (moe_router.log: where do the selection's 1.7-2.1 us go?); ab.{log,json}; then the projections with
# their rows scaled (steady.log: does the fraction of the copy bandwidth rise with the rows, or is the
# stream itself bound?). Say which card ran it. Call it with timeout_s 600.
LAB_DEFAULT_SECONDS=540
source dev/lab_prelude.sh
timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_gpu_cuda_step.py \
    tests/test_cuda_moe.py -k "l2_asks or late_down or persistent_matches or router_inside" > "$OUT/gpu_tests.log" 2>&1
echo "[tests rc=$? at ${SECONDS}s]"; tail -3 "$OUT/gpu_tests.log"
if [ "$(left)" -gt 300 ]; then  # the MoE kernel's routing phase step by step (trace), with the biases read early
    timeout 90 python3 dev/moe_router_ab.py --bias-early > "$OUT/moe_router.log" 2>&1
    echo "[moe_router rc=$? at ${SECONDS}s]"; grep -v Warning "$OUT/moe_router.log" | tail -45
fi
# (in order of interest: the deadline leaves out the last ones first)
default="product again;L2 fetch 256 B;L2 ahead 2: qkvfgb, q|kv_a|g, MLP;MoE downs after the gate_up tiles;MoE bias early"
default+=";L2: first 4 tasks: qkvfgb, q|kv_a|g, MLP;bulk: qkvfgb, q|kv_a|g, MLP;MoE downs after 2 gate_up tiles"
default+=";L2 ahead 2;L2: first 2 tasks;bulk, 8 warps: qkvfgb, q|kv_a|g, MLP;MoE copies in need order;L2 ahead 1"
default+=";L2: first 4 tasks"
ab ab "product;${VARIANTS:-$default}" --deadline "${AB_DEADLINE:-330}"
if [ "$(left)" -gt 60 ]; then  # ramp and tail or the stream itself: the projections with their rows scaled
    timeout $(($(left) - 5)) python3 dev/step_kernels_probe.py --steady qkvfgb,o_proj,shared_gate_up \
        --scales 1,4,16 > "$OUT/steady.log" 2>&1
    echo "[steady rc=$? at ${SECONDS}s]"; grep -v Warning "$OUT/steady.log"
fi

"""CUDA GEMV launch configurations A/B inside the whole decode step at full shape, in one process (lent GPU);
also where one token's shared expert runs (variant "shared expert inside").

    python3 dev/decode_launch_ab.py [--context 4096] [--variants 'product;8 warps'] [--json OUT.json]

(variants are separated by ';': their names hold commas)

`dev/step_kernels_probe.py` chose each projection's launch (warps, blocks per SM) alone. Inside the
step under PDL a kernel's successor can only become resident early, and stream its weights while
this one finishes, where this one leaves room on the SM: a grid that fills every SM's registers
hides nothing. This loads the full Ling-3.0-flash shape with random weights once (the default
configuration: fused step, CUDA step kernels, PDL), captures the decode step (and the verification
step) once per variant of every CUDA GEMV's `GemvLaunch`, and times the graphs interleaved
(A B C ... A B C ...): the variants share one load, one clock history and one L2 state.

Each variant's outputs are compared with the first variant's (the product's) before any timing: from the
same cache state (random KDA states and MLA rows, restored before each check), one decode step's and one
verification's logits, their relative L2 distance and whether the greedy tokens agree. Identical logits
confirm a variant that only moves work; differing ones are not proof of an error, since at random weights
one bf16 step in the residual can change an expert choice and with it everything after (the twelfth
session saw 0.4-1.0 from such variants, and exactly 0 from most of them), so a variant that differs
needs its GPU layer test before its time means anything. (The eleventh session timed a MoE variant that
was faster because it was wrong; only a GPU test caught it.)
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from verify_kernels_ab import load_full_shape  # noqa: E402

from solo.bench.decode import copy_bandwidth, environment, time_graph  # noqa: E402
from solo.engine.graphs import EagerStep, GraphCapture  # noqa: E402
from solo.kernels import fused_kda  # noqa: E402
from solo.kernels.cuda_moe_plan import DecodeKernelConfig  # noqa: E402
from solo.kernels.cuda_step import WINDOW_RING, CudaGemv, CudaRouter, GemvLaunch, choose_launch  # noqa: E402
from solo.model.cache import HybridCache  # noqa: E402

# the fused KDA front's ring builds as variant fields (one task ahead, the global exchange), and the H100's product
# build among them (solo.fastpath.decode_step.KDA_FRONT_BUILD)
RING_FRONT = {"kda_front": 1, "kda_front_exchange": "global"}
FRONT_PRODUCT = {**RING_FRONT, "kda_front_ring": 3, "kda_front_g_last": True}
VARIANTS = {  # name -> GemvLaunch fields for every CUDA GEMV (empty: the product's), and under "for" more
    # fields for the GEMVs whose names end with one of a tuple's suffixes
    "product": {},
    "product again": {},  # a second capture of the product: the output check's and the timing's own spread
    "product, a third time": {},
    # (thirty-second session) one token's KDA norm + q|k|v|f|g|b + recurrence as one launch, a thread-block
    # cluster a head (solo/kernels/cuda/kda_front.cu): no grid-wide boundary between the projection and the
    # recurrence; 2 or 1 tasks' loads in flight a lane
    "KDA front fused": {"kda_front": 2},
    "KDA front fused, 1 task ahead": {"kda_front": 1},
    "KDA front fused, again": {"kda_front": 2},
    "KDA front fused, 2 blocks/SM build": {"kda_front": 2, "kda_front_min_blocks": 2},
    "KDA front fused, 1 task ahead, 2 blocks/SM build": {"kda_front": 1, "kda_front_min_blocks": 2},
    "KDA front fused, 20 warps": {"kda_front": 2, "kda_front_warps": 20},
    # (the 2 blocks/SM build: 62 clusters resident against 30 of the 1/SM build's, which needs two waves for 32 heads)
    # (a head's 4 blocks exchanging through global memory: no cluster, so the 1/SM build's 128 blocks are one wave)
    "KDA front fused, global exchange": {"kda_front": 2, "kda_front_exchange": "global"},
    "KDA front fused, global exchange, 1 task ahead": {"kda_front": 1, "kda_front_exchange": "global"},
    # (thirty-second session; run in the thirty-third) the weights through 4 / 3 task slots of shared memory filled by
    # bulk copies
    "KDA front fused, global exchange, ring of 4": {**RING_FRONT, "kda_front_ring": 4},
    "KDA front fused, global exchange, ring of 3": {**RING_FRONT, "kda_front_ring": 3},
    # (thirty-third session) the layer's output projection inside the same launch, its weights into the ring's slots
    "KDA front fused, global exchange, ring of 4, o_proj inside": {
        **RING_FRONT,
        "kda_front_ring": 4,
        "kda_front_oproj": True,
    },
    "KDA front fused, global exchange, ring of 3, o_proj inside": {
        **RING_FRONT,
        "kda_front_ring": 3,
        "kda_front_oproj": True,
    },
    "KDA front fused, global exchange, ring of 2, o_proj inside": {
        **RING_FRONT,
        "kda_front_ring": 2,
        "kda_front_oproj": True,
    },
    # (thirty-third session) the g rows streamed after the exchange and the recurrence (their bytes land meanwhile)
    "KDA front fused, ring of 4, g last": {**RING_FRONT, "kda_front_ring": 4, "kda_front_g_last": True},
    "KDA front fused, ring of 3, g last": {**RING_FRONT, "kda_front_ring": 3, "kda_front_g_last": True},
    "KDA front fused, ring of 4, g last, again": {**RING_FRONT, "kda_front_ring": 4, "kda_front_g_last": True},
    "KDA front fused, ring of 3, g last, again": {**RING_FRONT, "kda_front_ring": 3, "kda_front_g_last": True},
    "KDA front fused, ring of 3, g last, o_proj inside": {
        **RING_FRONT,
        "kda_front_ring": 3,
        "kda_front_g_last": True,
        "kda_front_oproj": True,
    },
    "KDA front fused, ring of 4, again": {**RING_FRONT, "kda_front_ring": 4},
    # (thirty-third session) the KDA layers' output projection at 8 warps (18 K registers a block): beside a KDA front's
    # block (36 K) it fits on the SM, so under PDL it can load its first task's weights while the front ends
    "o_proj: 8 warps": {"for": {("o_proj",): {"warps": 8}}},
    "o_proj: 8 warps, again": {"for": {("o_proj",): {"warps": 8}}},
    "o_proj: 8 warps, 4 in flight": {"for": {("o_proj",): {"warps": 8, "max_in_flight": 4}}},
    # ... and both preferring all of the shared memory (an SM runs blocks of one shared-memory configuration at a time;
    # the GEMV prefers 50%, the front the driver's choice)
    "KDA front ring of 3, g last, carveout 100, o_proj 8 warps, carveout 100": {
        **FRONT_PRODUCT,
        "kda_front_carveout": 100,
        "for": {("o_proj",): {"warps": 8, "carveout": 100}},
    },
    "KDA front ring of 3, g last, carveout 100": {**FRONT_PRODUCT, "kda_front_carveout": 100},
    "o_proj: 8 warps, carveout 100": {"for": {("o_proj",): {"warps": 8, "carveout": 100}}},
    "o_proj: carveout 100": {"for": {("o_proj",): {"carveout": 100}}},
    # (thirty-third session) the front's blocks asking the L2 for the output projection's weights (after the b task:
    # +50.7 us at 32K on an H100, thirty-fourth session)
    "KDA front, o_proj weights asked of the L2 after the b task": {**FRONT_PRODUCT, "kda_front_l2_o_proj": 1},
    "KDA front, o_proj weights asked of the L2 before the wait": {**FRONT_PRODUCT, "kda_front_l2_o_proj": 2},
    # (not yet run) the shared expert's down before the front with both preferring all of the shared memory: a front
    # block (36 K registers, 153 KB) then fits beside two of its blocks (14 K registers each) and fills its ring while
    # they end; with the GEMV's 50% the SM's configuration cannot hold the front's 153 KB until they have left
    "shared down carveout 100, KDA front carveout 100": {
        **FRONT_PRODUCT,
        "kda_front_carveout": 100,
        "for": {("shared down",): {"carveout": 100}},
    },
    "shared down carveout 100": {"for": {("shared down",): {"carveout": 100}}},
    "KDA front off (the two kernels)": {"kda_front": 0},
    "KDA front off, again": {"kda_front": 0},
    "KDA front fused, 2/SM build, L2 2 tasks ahead": {"kda_front": 1, "kda_front_min_blocks": 2, "kda_front_l2": 2},
    "KDA front fused, 2/SM build, L2 4 tasks ahead": {"kda_front": 1, "kda_front_min_blocks": 2, "kda_front_l2": 4},
    "KDA front fused, 20 warps, 1 task ahead": {"kda_front": 1, "kda_front_warps": 20},
    "at most 2 blocks/SM": {"blocks_per_sm": 2},
    "at most 1 block/SM": {"blocks_per_sm": 1},
    "8 warps": {"warps": 8},
    "8 warps, 1 block/SM": {"warps": 8, "blocks_per_sm": 1},
    # The output projections (2,560 rows, K 4,096: 320 tasks) take 16 warps, 72 registers a thread: one
    # block an SM, so 132 blocks do 2-3 tasks one after another, each paying its scales' and residual's
    # round trips (about 6 us a layer for 10.5 MB). With 8 or 4 warps three or more blocks fit an SM
    # and every task has a block of its own.
    "o_proj, MLA dense: 8 warps": {"for": {("o_proj", "dense"): {"warps": 8}}},
    "o_proj, MLA dense: 4 warps": {"for": {("o_proj", "dense"): {"warps": 4}}},
    "o_proj, MLA dense, MLP down: 8 warps": {"for": {("o_proj", "dense", "MLP down"): {"warps": 8}}},
    # every load of a warp's task in flight where K allows (the KDA and MLA projections, K 2,560 over 4
    # warps: 10 steps a warp, 5 in flight by default: the largest divisor of 10 up to 8)
    "10 in flight": {"max_in_flight": 10},
    # after the persistent MoE kernel (all of an SM's shared memory) the SMs keep its carveout unless the
    # next kernel asks for another: the GEMVs' block scales then read through a 28 KB L1 (measured:
    # docs/results/h200_carveout_ab.log)
    "carveout 25%": {"carveout": 25},
    "carveout 50%": {"carveout": 50},  # (the product's since the sixth session)
    "driver's carveout": {"carveout": -1},
    # Every block of a persistent grid runs the same number of tasks (solo.kernels.cuda_step.persistent_grid):
    # no last round of a few blocks with too few loads in flight (the KDA projections: 188 of 792 blocks)
    "balanced grids": {"balanced": True},
    "balanced grids, o_proj + MLA dense 8 warps": {"balanced": True, "for": {("o_proj", "dense"): {"warps": 8}}},
    # (thirteenth session) a block's tasks after its first two taken from a counter as it goes
    # (gemv_decode.cu DYNAMIC): blocks that became resident early under PDL, or stream faster, take more,
    # so the grid ends together; the same grid and results
    "dynamic tasks": {"dynamic": True},
    "dynamic tasks: qkvfgb, q|kv_a|g, MLP": {"for": {("qkvfgb", "q|kv_a|g", "MLP"): {"dynamic": True}}},
    # (fourteenth session) whole tasks' weights asked of the L2 by bulk prefetches (gemv_decode.cu L2_AHEAD),
    # beyond the 5 loads a lane holds in registers (about 61 KB an SM): the block's first tasks before its
    # wait only, or also a fixed distance ahead as it goes
    "L2: first 2 tasks": {"l2_ahead": 2, "l2_loop": False},
    "L2: first 4 tasks": {"l2_ahead": 4, "l2_loop": False},
    "L2 fetch 256 B": {"l2_fetch": 256},
    "L2 fetch 128 B": {"l2_fetch": 128},
    # (twenty-seventh session) on the H200 the 256-byte fetch streamed every projection faster alone (q|k|v|f|g|b 17.4
    # against 18.1 us, 94% of the copy bandwidth at 4x its rows: h200_steady_lab70.log) but cost +19.4 us a decode step
    # on all of them (h200_ab_lab70.log): on the big projections only
    "L2 fetch 256 B: qkvfgb, q|kv_a|g, MLP": {"for": {("qkvfgb", "q|kv_a|g", "MLP"): {"l2_fetch": 256}}},
    "L2 ahead 1": {"l2_ahead": 1},
    "L2 ahead 2": {"l2_ahead": 2},
    "L2 ahead 2: qkvfgb, q|kv_a|g, MLP": {"for": {("qkvfgb", "q|kv_a|g", "MLP"): {"l2_ahead": 2}}},
    "L2: first 4 tasks: qkvfgb, q|kv_a|g, MLP": {
        "for": {("qkvfgb", "q|kv_a|g", "MLP"): {"l2_ahead": 4, "l2_loop": False}}
    },
    # the weights through a ring of shared-memory slots filled by bulk copies (gemv_decode.cu BULK): the
    # bytes in flight bounded by shared memory, not by a lane's registers
    "bulk": {"bulk": 1},
    "bulk, 8 warps": {"bulk": 1, "warps": 8},
    # fewer slots: room on the SM for the block to become resident while the previous kernel (e.g. the
    # shared expert's down, two blocks of 12 warps an SM) still runs, and request its first slots then
    "bulk, at most 8 slots": {"bulk": 1, "slots": 8},
    "bulk, at most 5 slots": {"bulk": 1, "slots": 5},
    "bulk: qkvfgb, q|kv_a|g, MLP": {"for": {("qkvfgb", "q|kv_a|g", "MLP"): {"bulk": 1}}},
    # (a bulk block of 4 warps is an SM's only compute for its stream; the register path has 24 warps an SM)
    "bulk, 8 warps: qkvfgb, q|kv_a|g, MLP": {"for": {("qkvfgb", "q|kv_a|g", "MLP"): {"bulk": 1, "warps": 8}}},
    # (fifteenth session: on the H100 the bulk ring on the big projections lost 245 us at 4 warps and 111 at 8,
    # h100_ab_lab18.log; more warps a block, or two blocks an SM, to consume the ring faster)
    "bulk, 10 warps: qkvfgb, q|kv_a|g, MLP": {"for": {("qkvfgb", "q|kv_a|g", "MLP"): {"bulk": 1, "warps": 10}}},
    "bulk, 20 warps: qkvfgb, q|kv_a|g, MLP": {"for": {("qkvfgb", "q|kv_a|g", "MLP"): {"bulk": 1, "warps": 20}}},
    # (two blocks an SM: +7.8, -16.4, +6.8 us in three H100 runs against +110.9 for one block of 8, a tie with the
    # register path; h100_ab_lab21.log, h100_ab_lab22.log. The H200, whose stream is more latency-bound, is next)
    "bulk, 2 blocks of 8 warps: qkvfgb, q|kv_a|g, MLP": {
        "for": {("qkvfgb", "q|kv_a|g", "MLP"): {"bulk": 2, "warps": 8}}
    },
    "bulk, 3 blocks of 8 warps: qkvfgb, q|kv_a|g, MLP": {
        "for": {("qkvfgb", "q|kv_a|g", "MLP"): {"bulk": 3, "warps": 8}}
    },
    "bulk, 2 blocks of 10 warps: qkvfgb, q|kv_a|g, MLP": {
        "for": {("qkvfgb", "q|kv_a|g", "MLP"): {"bulk": 2, "warps": 10}}
    },
    "bulk, 4 blocks of 4 warps: qkvfgb, q|kv_a|g, MLP": {
        "for": {("qkvfgb", "q|kv_a|g", "MLP"): {"bulk": 4, "warps": 4}}
    },
    "bulk, 2 blocks of 8 warps, at most 6 slots: qkvfgb, q|kv_a|g, MLP": {
        "for": {("qkvfgb", "q|kv_a|g", "MLP"): {"bulk": 2, "warps": 8, "slots": 6}}
    },
    "bulk, 2 blocks of 8 warps: every GEMV": {"bulk": 2, "warps": 8},
    # (twenty-fourth session) on the H200 the same CUDA GEMV streamed the LM head's 403 MB at 94-97% of the copy
    # bandwidth with 8-10 warps a block, at 72% with the big projections' 4 (h200_step_kernels_probe.log, kernels
    # alone, where q|k|v|f|g|b itself lost with them: 61-62% against 67%); never run in the step on an H200. The
    # sums run in another order (logits differ, as expected)
    "8 warps: qkvfgb, q|kv_a|g, MLP": {"for": {("qkvfgb", "q|kv_a|g", "MLP"): {"warps": 8}}},
    "10 warps: qkvfgb, q|kv_a|g, MLP": {"for": {("qkvfgb", "q|kv_a|g", "MLP"): {"warps": 10}}},
    # (nineteenth session) the H200's big projections stream at about 66% of its copy rate where the H100's reach
    # 79%: the same latency at a higher rate needs more bytes in flight than a lane's registers hold; the ring
    # holds about 200 KB an SM (never measured on the H200); with the H100's product asks beside it
    "bulk, 2 blocks of 8 warps: qkvfgb, q|kv_a|g, MLP + L2 next: shared + 16 MB, after the copies": {
        "for": {("qkvfgb", "q|kv_a|g", "MLP"): {"bulk": 2, "warps": 8}},
        "l2_next": {"megabytes": 16, "at": 1},
    },
    "bulk: o_proj, dense, downs": {"for": {("o_proj", "dense", "down"): {"bulk": 1}}},
    # (nineteenth session) the output projections' 10.5 MB fit in their blocks' rings (3 tasks a block, about 100 KB),
    # which fill before griddepcontrol.wait: the whole weight on chip while the KDA recurrence (512 B of shared
    # memory, 107 registers a thread) runs beside it, instead of each lane's first loads
    "bulk: o_proj": {"for": {("o_proj",): {"bulk": 1}}},
    "bulk: o_proj, dense": {"for": {("o_proj", "dense"): {"bulk": 1}}},
    "bulk, 8 warps: o_proj, dense": {"for": {("o_proj", "dense"): {"bulk": 1, "warps": 8}}},
    "bulk, 2 blocks of 8 warps: o_proj, dense": {"for": {("o_proj", "dense"): {"bulk": 2, "warps": 8}}},
    # not GEMV launches: the MLA and selection switches the product turned on in the twelfth session, undone
    # (one token's attention transposed on one warpgroup, the combine cut into 4 slices of the latent columns
    # for one token and verification, the routers' selection over the kept groups only). The product's
    # launches are FusedMLA.ONE_TOKEN and .WINDOW; "mla" changes both, "mla_one" and "mla_window" one each.
    "MLA and selection as before the twelfth session": {
        "mla": {"combine_rank_parts": 0},
        "mla_one": {"transposed": False, "warps": 8},
        "fast_select": False,
    },
    "MLA combine by the heads' value rows": {"mla": {"combine_rank_parts": 0}},
    "MLA one token: plain attention": {"mla_one": {"transposed": False, "warps": 8}},
    "MLA one token: plain attention, heads in two programs": {
        "mla_one": {"transposed": False, "warps": 8, "rows_per_program": 16}
    },
    # the selection over every warp (FAST_SELECT off), in the MoE kernel (one token) and the CUDA router
    "full selection": {"fast_select": False},
    # one token's transposed attention launched otherwise. Measured on the plain attention in the twelfth
    # session (docs/results/h200_ab_mla_lab15.log): 256 splits +43 us, 64 +90, heads in 4 programs +255,
    # one stage +121; transposed on 8 warps +10 (h100_ab_mla_lab13.log). At 128 positions a step, with one
    # stage, the transposed kernel gave logits unlike the product's on the H100 (rounding carried through an
    # expert choice or an error; under the interpreter it matches the reference); not pursued.
    "MLA one token transposed: 8 warps": {"mla_one": {"warps": 8}},
    "MLA one token transposed: heads in two programs": {"mla_one": {"rows_per_program": 16}},
    "MLA one token transposed: 256 splits": {"mla_one": {"splits": 256}},
    "MLA one token transposed: 3 stages": {"mla_one": {"stages": 3}},
    # (nineteenth session) each split asks the L2 for its first steps of old cache rows before it waits for the
    # prep (AttendLaunch.early_chunks): at 4K a split is one step of 64 positions, at 32K four
    "MLA one token: L2 asks for the first step early": {"mla_one": {"early_chunks": 1}},
    "MLA one token: L2 asks for the first step early, again": {"mla_one": {"early_chunks": 1}},
    "MLA one token: L2 asks for 2 steps early": {"mla_one": {"early_chunks": 2}},
    "MLA one token: L2 asks for 4 steps early": {"mla_one": {"early_chunks": 4}},
    "MLA one token: no early asks": {"mla_one": {"early_chunks": 0}},  # (the product's 1 on EARLY_CHUNK_CARDS)
    # each step of the loop asks the L2 for the step 2 (3) later: the pipeline's own loads cover the next one
    "MLA one token: L2 asks 2 steps ahead in the loop": {"mla_one": {"ahead_steps": 2}},
    "MLA one token: L2 asks 3 steps ahead in the loop": {"mla_one": {"ahead_steps": 3}},
    # the prep's query programs load their block of w_uk (4 MB a layer) before the wait for the projection
    "MLA prep: w_uk before the wait": {"mla": {"prep_weights_early": True}},
    "MLA prep: w_uk before the wait, one token": {"mla_one": {"prep_weights_early": True}},
    "MLA prep: w_uk before the wait, again": {"mla": {"prep_weights_early": True}},
    "MLA one token: no early asks, again": {"mla_one": {"early_chunks": 0}},
    "MLA one token transposed: 32 positions a step": {"mla_one": {"block_l": 32}},
    # (twenty-fifth session) at 2 stages Triton's pipeliner issues a step's cache copies at the end of the step
    # before and waits for all of them at its top (cp.async.wait_group 0, read in the PTX): no load overlaps the
    # products. 3 stages of 64 positions take more shared memory than an SM has; of 32 positions, 3-6 stages keep
    # 1-4 steps of copies in flight during the products (wait_group 2-8), with the scores on mma.sync. Lost on the
    # H100 (h100_ab_lab61.log): one token +25.8 / +41.1 / +60.8 us at 4 / 5 / 6 stages, +31.8 with 2 early steps;
    # verification +2.1 / +3.3 us at 3 / 4 stages
    "MLA one token: 32 positions a step, 4 stages": {"mla_one": {"block_l": 32, "stages": 4}},
    "MLA one token: 32 positions a step, 5 stages": {"mla_one": {"block_l": 32, "stages": 5}},
    "MLA one token: 32 positions a step, 6 stages": {"mla_one": {"block_l": 32, "stages": 6}},
    "MLA one token: 32 positions a step, 5 stages, 2 early": {
        "mla_one": {"block_l": 32, "stages": 5, "early_chunks": 2}
    },
    "MLA verification: 32 positions a step, 3 stages": {"mla_window": {"block_l": 32, "stages": 3}},
    "MLA verification: 32 positions a step, 4 stages": {"mla_window": {"block_l": 32, "stages": 4}},
    # (lab62's Nsight Compute: one warp a scheduler, 46% of its stalls on the cache copies' scoreboard) the copies
    # of the step after asked of the L2 at each step's top: +16.7 us on the H100 (h100_ab_lab63.log)
    "MLA one token: L2 asks 1 step ahead in the loop": {"mla_one": {"ahead_steps": 1}},
    # (twenty-sixth session) one token's attention in Gluon (solo.kernels.gluon_mla): TMA copies into a ring of 2
    # buffers of 64 positions, each refilled as soon as its products are done, so one step's copies are in flight
    # while the step before computes (Triton's pipeline issues them after it); with the product's early_chunks the
    # first two steps of old rows are copied before the wait for the prep. 1 buffer: no overlap, for scale
    "MLA one token: Gluon ring": {"mla_one": {"gluon": True}},
    "MLA one token: Gluon ring, again": {"mla_one": {"gluon": True}},
    "MLA one token: Gluon ring, no early copies": {"mla_one": {"gluon": True, "early_chunks": 0}},
    "MLA one token: Gluon ring, 1 buffer": {"mla_one": {"gluon": True, "ring_buffers": 1}},
    # the steps past the ring asked of the L2 too: before the wait (4 early: at 32K a split's whole 295 KB is
    # requested before the prep ends), and in the loop the step 2 later (1 more in flight than the ring holds)
    "MLA one token: Gluon ring, 4 early": {"mla_one": {"gluon": True, "early_chunks": 4}},
    "MLA one token: Gluon ring, 4 early, L2 2 ahead": {"mla_one": {"gluon": True, "early_chunks": 4, "ahead_steps": 2}},
    # (h100_mla_probe_lab65.log, alone at 32K: the product's attention 26.0 us, the ring 23.0, without early
    # copies 21.9, 1 buffer 24.5, 4 early 23.1, + L2 2 ahead 26.3, 64 splits 25.5) two warpgroups: each takes half
    # of the output's latent columns (64 accumulators a thread, 125 registers) and half of the scores' heads
    "MLA one token: Gluon ring, 8 warps": {"mla_one": {"gluon": True, "warps": 8}},
    "MLA one token: Gluon ring, 8 warps, again": {"mla_one": {"gluon": True, "warps": 8}},
    "MLA one token: Gluon ring, 8 warps, no early copies": {"mla_one": {"gluon": True, "warps": 8, "early_chunks": 0}},
    "MLA one token: Gluon ring, 8 warps, 4 early": {"mla_one": {"gluon": True, "warps": 8, "early_chunks": 4}},
    # (the product's on GLUON_RING_CARDS since h100_ab_lab66.log) undone, and with the lazy rescale (Nsight Compute,
    # h100_ncu_ring4_lab66.txt: one warp a scheduler issuing every 7.3 cycles, the step's chain of about 1,000
    # instructions a warp is the bound now, 128 of them the output's rescale)
    "MLA one token: Triton attention": {"mla_one": {"gluon": False}},
    "MLA one token: Triton attention, again": {"mla_one": {"gluon": False}},
    # (taken out after e91cd39) the lazy rescale (the maxima moved only when one grows by more than 8): on the H200
    # -21.6 us against the Triton attention where the ring alone gave -21.5 / -26.5 (h200_ab_lab71.log), alone 29.9
    # against 29.6 us a layer at 32K (h200_mla_probe_lab71.log)
    # (twenty-seventh session; taken out after f2f0ca6) the combine inside the Gluon ring's launch (AttendLaunch.merge:
    # a grid-wide count, then each program merged one head's slice): on the H200 +16 to +23 us against the ring alone
    # at 32K (h200_ab_lab70.log, h200_ab_lab71.log), alone 32.9 against 29.6 us a layer (h200_mla_probe_lab71.log)
    # half the splits (8 steps of 64 positions each at 32K): half the partials the combine merges
    "MLA one token: Gluon ring, 4 early, 64 splits": {"mla_one": {"gluon": True, "early_chunks": 4, "splits": 64}},
    # verification's attention transposed (4 warps for both lost 540 us of verification on the H100)
    "MLA verification transposed": {"mla_window": {"transposed": True}},
    "MLA verification: 128 splits": {"mla_window": {"splits": 128}},
    # (thirty-sixth session) verification's attention as the Gluon ring too: its 4 tokens x 32 heads in two programs
    # of 64 rows a split (two warpgroups: 128 accumulators a thread, 229,904 B of shared memory), or four of 32; with
    # 2 steps of old rows copied before the wait for the prep
    "MLA verification: Gluon ring": {"mla_window": {"gluon": True}},
    "MLA verification: Gluon ring, again": {"mla_window": {"gluon": True}},
    "MLA verification: Gluon ring, 32 rows": {"mla_window": {"gluon": True, "rows_per_program": 32}},
    "MLA verification: Gluon ring, 32 rows, 32 splits": {
        "mla_window": {"gluon": True, "rows_per_program": 32, "splits": 32}
    },
    "MLA verification: Gluon ring, 2 early": {"mla_window": {"gluon": True, "early_chunks": 2}},
    # not a launch: one token's shared expert inside the persistent MoE kernel (--moe-shared fused) instead
    # of its own two kernels after it (docs/results/h200_shared_order_ab.log)
    "shared expert inside": {"shared_inside": True},
    "shared expert inside, again": {"shared_inside": True},
    # (sixteenth session) the same beside the bulk ring of two blocks of 8 warps on the big projections: the
    # kernel after the MoE kernel (the next q|k|v|f|g|b) then streams from its ring as its blocks arrive
    "shared expert inside, bulk, 2 blocks of 8 warps: qkvfgb, q|kv_a|g, MLP": {
        "shared_inside": True,
        "for": {("qkvfgb", "q|kv_a|g", "MLP"): {"bulk": 2, "warps": 8}},
    },
    # (the KDA recurrence after a ringed q|k|v|f|g|b took 5.1-5.7 us against 3.7, h100_bench_decode_both_lab24.json:
    # two blocks of 5 slots fill the SM's shared memory, so its programs become resident only as the blocks end;
    # at most 4 slots leave about 47 KB an SM)
    "bulk, 2 blocks of 8 warps, at most 4 slots: qkvfgb, q|kv_a|g, MLP": {
        "for": {("qkvfgb", "q|kv_a|g", "MLP"): {"bulk": 2, "warps": 8, "slots": 4}}
    },
    "shared expert inside, bulk, 2 blocks of 8 warps, at most 4 slots: qkvfgb, q|kv_a|g, MLP": {
        "shared_inside": True,
        "for": {("qkvfgb", "q|kv_a|g", "MLP"): {"bulk": 2, "warps": 8, "slots": 4}},
    },
    # not a GEMV launch: one token's programs per KDA head (solo.kernels.fused_kda.VALUE_SPLITS, 4 in the
    # product): 8 halves each program's slice of the state, two programs an SM (sm_90: 72 registers against
    # 107). For verification 8 lost before (4.511 -> 4.537 ms at 4K, dev/verify_kernels_ab.py --kda-splits)
    "KDA one token 8 value splits": {"kda": {"one": 8}},
    # (thirty-sixth session) the recurrence's programs on one warp (fused_kda.VALUE_WARPS / WINDOW_WARPS): the sums
    # over the key dimension as shuffles, not through shared memory and barriers (78 barriers in a 4-token pass at 4
    # warps, 43 at one); more value splits keep the state slice in registers. One token's matters where the decode
    # step runs the Triton recurrence (not the fused KDA front)
    "KDA verification: 16 splits of 1 warp": {"kda": {"window": 16, "window_warps": 1}},
    "KDA verification: 16 splits of 1 warp, again": {"kda": {"window": 16, "window_warps": 1}},
    "KDA verification: 8 splits of 1 warp": {"kda": {"window": 8, "window_warps": 1}},
    "KDA verification: 8 splits of 2 warps": {"kda": {"window": 8, "window_warps": 2}},
    "KDA one token: 16 splits of 1 warp": {"kda": {"one": 16, "one_warps": 1}},
    "KDA one token: 8 splits of 1 warp": {"kda": {"one": 8, "one_warps": 1}},
    # (ninth session) the KDA recurrence and the MLA prep start once the projection before them has stored
    # the rows they read, while the output gate (computed last) still streams: solo.kernels.handoff,
    # FusedDecodeStep.handoff
    "hand-off": {"handoff": True},
    # (fourteenth session) not a GEMV launch: the MoE kernel's producer issues the down copies only once its
    # earlier gate_up tiles (all, or the first 2) have landed (moe_decode.cu DOWN_AFTER), so that the last
    # gate_up tile anywhere, which the activation exchange waits for, is not served beside down bytes; and the
    # selection lanes' expert biases read before the MoE kernel's wait (moe_decode.cu BIAS_EARLY): one L2 round
    # trip fewer between a score's arrival and the selection. Both in the product since the fifteenth session
    # (-26.5 and -28.0 us at 32K on the H100, h100_ab_lab18.log); these variants take them out again
    "MoE downs at once": {"moe": {"down_after": 0}},
    "MoE downs after 2 gate_up tiles": {"moe": {"down_after": 2}},
    "MoE copies in need order": {"moe": {"order": "need", "down_after": 0}},
    "MoE bias late": {"moe": {"bias_early": False}},
    "MoE as in the fourteenth session": {"moe": {"bias_early": False, "down_after": 0, "x_early": False}},
    "MoE x late": {"moe": {"x_early": False}},  # (the gate_up warps load x after the inputs' barrier)
    # (twentieth session) the MoE kernel's tiles spread by gate_up tiles first (DecodeKernelConfig.balance "gate_up":
    # every block 5 or 6, where 32 blocks had 7 and the activation exchange waited for their last), which fits
    # only with x in the block's down area of the tile memory (x_in_tiles); and x there alone
    "MoE gate_up balanced": {"moe": {"balance": "gate_up", "x_in_tiles": True}},
    "MoE gate_up balanced, again": {"moe": {"balance": "gate_up", "x_in_tiles": True}},
    "MoE x in tiles": {"moe": {"x_in_tiles": True}},
    # (twentieth session) the MoE kernel's producer keeps at most N gate_up tiles in flight (gate_up_window): all at
    # once, a block's tiles land together near the end of the stream and its gate_up warps (about 0.5 us a tile)
    # then work through five or six in a row (lab39's per-block trace)
    # (twenty-second session) each selection lane keeps four loads of its score in flight, N ns apart
    # (DecodeKernelConfig.score_stagger), instead of one poll round trip after another
    "MoE scores: 4 loads in flight, 128 ns apart": {"moe": {"score_stagger": 128}},
    "MoE scores: 4 loads in flight, 64 ns apart": {"moe": {"score_stagger": 64}},
    "MoE scores: 4 loads in flight, 128 ns apart, again": {"moe": {"score_stagger": 128}},
    # (twenty-second session) the selection ranks the groups once and keeps their ballot
    # (DecodeKernelConfig.lean_select, the product's since): against the selection as before
    "MoE selection as before": {"moe": {"lean_select": False}},
    "MoE and router selection as before": {"moe": {"lean_select": False}, "router_lean": False},
    "MoE lean selection": {"moe": {"lean_select": True}},
    "MoE lean selection, again": {"moe": {"lean_select": True}},
    # (thirty-first session) the producer copies from the ranking's own writes, before warp 0 sums and divides the
    # weights (DecodeKernelConfig.early_ids): the traces put 0.58 us between every rank written and the selection done
    "MoE experts before the weights": {"moe": {"early_ids": True}},
    "MoE experts before the weights, again": {"moe": {"early_ids": True}},
    # (thirty-fourth session) the producer warp alone chooses from every expert's key and score (warp reductions,
    # no barrier between the selection's steps; DecodeKernelConfig.warp_select)
    "MoE warp selection": {"moe": {"warp_select": True}},
    "MoE warp selection, again": {"moe": {"warp_select": True}},
    "MoE no gate_up window": {"moe": {"gate_up_window": 0}},
    "MoE warp selection, no gate_up window": {"moe": {"warp_select": True, "gate_up_window": 0}},
    # (thirty-eighth session) the one selection that won alone and lost in the step, without the L2 asks after its
    # copies: to tell whether they are what differs in the step
    "MoE warp selection, L2 next off": {
        "moe": {"warp_select": True},
        "l2_next": {"megabytes": 0, "shared": False, "at": 0},
    },
    "MoE gate_up window 2": {"moe": {"gate_up_window": 2}},
    "MoE gate_up window 3": {"moe": {"gate_up_window": 3}},
    "MoE gate_up window 4": {"moe": {"gate_up_window": 4}},
    "MoE gate_up window 3, again": {"moe": {"gate_up_window": 3}},
    "MoE gate_up window 3, downs after 2 tiles": {"moe": {"gate_up_window": 3, "down_after": 2}},
    # (twenty-first session) the down warps do the first slot pairs' down products while the gate_up warps still work
    # (early_pairs; those pairs' down rows right after the block's gate_up tiles of the pair): lab43's trace put the
    # down phase at about 1 us a pair after the last activation, the six down warps idle until then
    "MoE early pairs 1": {"moe": {"early_pairs": 1}},
    "MoE early pairs 2": {"moe": {"early_pairs": 2}},
    "MoE early pairs 1, again": {"moe": {"early_pairs": 1}},
    "MoE early pairs 2, again": {"moe": {"early_pairs": 2}},
    "MoE early pairs 3": {"moe": {"early_pairs": 3}},
    "MoE gate_up tiles all at once": {"moe": {"gate_up_window": 0}},  # (the product's before, and off the H100)
    "MoE gate_up tiles all at once, again": {"moe": {"gate_up_window": 0}},
    # ... the window over every copy group in issue order, the downs too (window_downs; DOWN_AFTER then off)
    "MoE window 3 over all copies": {"moe": {"gate_up_window": 3, "window_downs": True, "down_after": 0}},
    "MoE window 3 over all copies, again": {"moe": {"gate_up_window": 3, "window_downs": True, "down_after": 0}},
    "MoE window 4 over all copies": {"moe": {"gate_up_window": 4, "window_downs": True, "down_after": 0}},
    "MoE window 2 over all copies": {"moe": {"gate_up_window": 2, "window_downs": True, "down_after": 0}},
    "MoE window 3 over all copies in need order": {
        "moe": {"gate_up_window": 3, "window_downs": True, "down_after": 0, "order": "need"}
    },
    "MoE window 4 over all copies in need order": {
        "moe": {"gate_up_window": 4, "window_downs": True, "down_after": 0, "order": "need"}
    },
    # (fifteenth session) the output projections (2,560 rows, K 4,096: 320 tasks) build to 74 registers at 16
    # warps, one block an SM: 132 blocks, so 56 of them run a third task. Capped to 64 registers (16 bytes of
    # spills) two blocks an SM fit: two rounds; at 8 warps and 4 loads in flight a lane 86 registers, two
    # blocks an SM; capped to 80 (72 bytes of spills) three: a task a block (dev/nvrtc_resources.py)
    # (twenty-second session) the KDA and MLA input projections built for 7 blocks an SM (MIN_BLOCKS 7: 72 registers
    # and 96 bytes of spills inside the task loop, as NVRTC 13.0 builds it; dev/nvrtc_resources.py) instead of the
    # product's 80 registers and 6 blocks: a sixth more loads in flight where the stream is bound by them
    "qkvfgb, q|kv_a|g: 7 blocks an SM": {"for": {("qkvfgb", "q|kv_a|g"): {"min_blocks": 7}}},
    "qkvfgb, q|kv_a|g: 7 blocks an SM, again": {"for": {("qkvfgb", "q|kv_a|g"): {"min_blocks": 7}}},
    "o_proj, dense: 2 blocks an SM": {"for": {("o_proj", "dense"): {"min_blocks": 2}}},
    "o_proj, dense: 8 warps, 4 in flight": {"for": {("o_proj", "dense"): {"warps": 8, "max_in_flight": 4}}},
    "o_proj, dense: 8 warps, 4 in flight, 3 blocks an SM": {
        "for": {("o_proj", "dense"): {"warps": 8, "max_in_flight": 4, "min_blocks": 3}}
    },
    "bulk + hand-off": {"bulk": 1, "handoff": True},
    # (seventeenth session) verification's big projections only (GemvLaunch.window; the decode step's kernels
    # are the product's): through bulk rings of 2 blocks of 10 warps (WINDOW_RING, the product's on the cards
    # of WINDOW_RING_CARDS), or on the register path (the product's elsewhere)
    "window ring: qkvfgb, q|kv_a|g, MLP": {"for": {("qkvfgb", "q|kv_a|g", "MLP"): {"window": WINDOW_RING}}},
    "window ring: qkvfgb, q|kv_a|g, MLP, again": {"for": {("qkvfgb", "q|kv_a|g", "MLP"): {"window": WINDOW_RING}}},
    "window ring, 2 blocks of 8 warps: qkvfgb, q|kv_a|g, MLP": {
        "for": {("qkvfgb", "q|kv_a|g", "MLP"): {"window": dataclasses.replace(WINDOW_RING, warps=8)}}
    },
    "windows on the register path": {"window": None},
    "window ring: every GEMV": {"window": WINDOW_RING},
    "window ring: o_proj, dense, downs": {"for": {("o_proj", "dense", "down"): {"window": WINDOW_RING}}},
    # (eighteenth session) not a GEMV launch: each MoE kernel (one token) asks the L2 for the weights the step
    # reads after it, the shared expert's and the first MB of the next layer's input projection in its reading
    # order (FusedDecodeStep.prefetch_next_weights, moe_decode.cu L2_NEXT), once its block's copies landed (1),
    # its activation exchange is done (2) or at its end (3): HBM idles in the MoE kernel's tail and in the
    # shared expert's two short kernels. (The fourteenth session's ask for 16-32 MB while it routed collided
    # with the experts' copies.)
    "L2 next off": {"l2_next": {"megabytes": 0, "shared": False, "at": 0}},  # (the product's on L2_NEXT_CARDS)
    "L2 next off, again": {"l2_next": {"megabytes": 0, "shared": False, "at": 0}},
    "L2 next: shared + 32 MB, after the copies": {"l2_next": {"megabytes": 32, "at": 1}},
    "L2 next: shared + 32 MB, after the copies, again": {"l2_next": {"megabytes": 32, "at": 1}},
    "L2 next: shared expert, after the copies": {"l2_next": {"megabytes": 0, "at": 1}},
    # (thirty-third session; +9.7 us at 32K on an H100 in the thirty-fourth) with the fused KDA front a block's first
    # three ring tasks are q0, q1 and k0
    # of its head: all of q and a half of every head's k rows, which the product's first 16 MB (all of q, k of heads
    # 0-17) cover only in part; 21 MB is all of q and k
    "L2 next: shared + 21 MB, after the copies": {"l2_next": {"megabytes": 21, "at": 1}},
    # (thirty-eighth session) with the fused KDA front the next input projection is read task by task (q0 q1 k0 ...
    # of every block: kda_front.cu), so its first 10 MB (every q row) are what its blocks' rings ask for first
    "L2 next: shared + 10 MB, after the copies": {"l2_next": {"megabytes": 10, "at": 1}},
    "L2 next: shared + 10 MB, after the copies, again": {"l2_next": {"megabytes": 10, "at": 1}},
    "L2 next: shared expert, after the exchange": {"l2_next": {"megabytes": 0, "at": 2}},
    "L2 next: shared + 8 MB, after the copies": {"l2_next": {"megabytes": 8, "at": 1}},
    "L2 next: shared + 8 MB, after the exchange": {"l2_next": {"megabytes": 8, "at": 2}},
    "L2 next: shared + 8 MB, at the end": {"l2_next": {"megabytes": 8, "at": 3}},
    "L2 next: shared + 4 MB, after the exchange": {"l2_next": {"megabytes": 4, "at": 2}},
    "L2 next: shared + 16 MB, after the exchange": {"l2_next": {"megabytes": 16, "at": 2}},
    "L2 next: 8 MB, after the exchange": {"l2_next": {"megabytes": 8, "shared": False, "at": 2}},
    # (lab28, H100: after the copies -13.0 us with the shared expert's weights, -44.0 with 8 MB more; after the
    # exchange +19 to +54, at the end +80: there a compute warp or the block's end waits for the table's load)
    "L2 next: shared + 4 MB, after the copies": {"l2_next": {"megabytes": 4, "at": 1}},
    "L2 next: shared + 12 MB, after the copies": {"l2_next": {"megabytes": 12, "at": 1}},
    "L2 next: shared + 16 MB, after the copies": {"l2_next": {"megabytes": 16, "at": 1}},
    "L2 next: shared + 16 MB, after the copies, again": {"l2_next": {"megabytes": 16, "at": 1}},
    "L2 next: shared + 24 MB, after the copies": {"l2_next": {"megabytes": 24, "at": 1}},
    "L2 next: shared + 24 MB, after the copies, again": {"l2_next": {"megabytes": 24, "at": 1}},
    "L2 next: 8 MB, after the copies": {"l2_next": {"megabytes": 8, "shared": False, "at": 1}},
    # (with the table in shared memory, copied before the wait: the later points no longer wait for its load)
    "L2 next: shared + 16 MB, at the end": {"l2_next": {"megabytes": 16, "at": 3}},
    "L2 next: shared + 8 MB, at the wait": {"l2_next": {"megabytes": 8, "at": 4}},
    "L2 next: 4 MB, at the wait": {"l2_next": {"megabytes": 4, "shared": False, "at": 4}},
    # (nineteenth session; lab30, H100: asked by the producer's copy engine at the wait, +117.6 us) the down warps,
    # idle while the gate_up warps route, ask a 128-byte line per thread on the load path (prefetch.global.L2):
    # at the wait (5) or before it (6). Does the copy engine's queue, which the expert copies use next, explain
    # the loss, or HBM serving the asks while the copies start?
    "L2 next: shared + 8 MB, lines at the wait": {"l2_next": {"megabytes": 8, "at": 5}},
    "L2 next: shared + 16 MB, lines at the wait": {"l2_next": {"megabytes": 16, "at": 5}},
    "L2 next: shared expert, lines at the wait": {"l2_next": {"megabytes": 0, "at": 5}},
    "L2 next: shared + 8 MB, lines before the wait": {"l2_next": {"megabytes": 8, "at": 6}},
    # one token's KDA kernel asks the L2 for its output projection's weight (10.5 MB) once its wait returns: HBM
    # idles while the recurrence runs (FusedDecodeStep.kda_l2_ahead)
    "KDA asks the L2 for o_proj": {"kda_l2_ahead": True},
    # (ninth session) one token's shared gate_up normalises x itself and waits for the MoE kernel only at
    # its end (gemv_decode.cu LATE_WAIT): FusedDecodeStep.shared_late_wait
    "shared gate_up late wait": {"shared_late_wait": True},
    # (nineteenth session) the MoE kernel on 4 SMs fewer (PersistentDecodeMoE.set_blocks: 128 blocks take the same
    # most bytes a block as 132 at Ling shapes), so that the shared gate_up, waiting for it only at its end, runs
    # on the free SMs while it runs (its grid cut to what fits there: GemvLaunch.max_grid)
    "MoE on 4 SMs fewer": {"moe_free_sms": 4},
    "MoE on 4 SMs fewer, shared gate_up late wait": {"moe_free_sms": 4, "shared_late_wait": True},
    "MoE on 4 SMs fewer, shared gate_up late wait on 8 blocks": {
        "moe_free_sms": 4,
        "shared_late_wait": True,
        "for": {("shared",): {"max_grid": 8}},
    },
    "MoE on 4 SMs fewer, shared gate_up late wait on 4 blocks": {
        "moe_free_sms": 4,
        "shared_late_wait": True,
        "for": {("shared",): {"max_grid": 4}},
    },
    "shared gate_up late wait on 8 blocks": {"shared_late_wait": True, "for": {("shared",): {"max_grid": 8}}},
    # (lab35, H100: on 8 or 4 blocks of the register path the gate_up took about 20 us more a layer: a block's
    # loads in flight bound its stream) the free SMs' blocks streaming through bulk rings instead
    "MoE on 4 SMs fewer, shared gate_up late wait through rings on 4 blocks": {
        "moe_free_sms": 4,
        "shared_late_wait": True,
        "for": {("shared",): {"max_grid": 4, "bulk": 1}},
    },
    "MoE on 4 SMs fewer, shared gate_up late wait through rings on 8 blocks": {
        "moe_free_sms": 4,
        "shared_late_wait": True,
        "for": {("shared",): {"max_grid": 8, "bulk": 2}},
    },
    "MoE on 4 SMs fewer, shared gate_up late wait through rings on 4 blocks of 20 warps": {
        "moe_free_sms": 4,
        "shared_late_wait": True,
        "for": {("shared",): {"max_grid": 4, "bulk": 1, "warps": 20}},
    },
    "hand-off + shared gate_up late wait": {"handoff": True, "shared_late_wait": True},
    # (thirty-seventh session) verification's shared gate_up normalises x itself and runs on a side stream beside the
    # router (one block on 32 of the SMs for about 9 us a layer) and the routed experts, instead of after them:
    # FusedDecodeStep.shared_beside_router
    "shared gate_up beside the router": {"shared_beside_router": True},
    "shared gate_up beside the router, again": {"shared_beside_router": True},
    # (since the thirty-seventh session the product's on SHARED_BESIDE_CARDS and GLUON_WINDOW_CARDS) each turned off
    "shared gate_up after the router": {"shared_beside_router": False},
    "shared gate_up after the router, again": {"shared_beside_router": False},
    # (thirty-eighth session) the shared down beside the router too: the routed experts' GEMV down kernel adds its
    # output and the routed sum onto x in the shared down's order (FusedDecodeStep.shared_down_beside)
    "shared expert beside the router": {"shared_beside_router": True, "shared_down_beside": True},
    "shared expert beside the router, again": {"shared_beside_router": True, "shared_down_beside": True},
    "MLA verification: Triton": {"mla_window": {"gluon": False}},
    "MLA verification: Triton, again": {"mla_window": {"gluon": False}},
}
# a variant's keys that are not GemvLaunch fields
NOT_LAUNCH = (
    "for",
    "kda_front",
    "kda_front_min_blocks",
    "kda_front_warps",
    "kda_front_l2",
    "kda_front_exchange",
    "kda_front_ring",
    "kda_front_oproj",
    "kda_front_g_last",
    "kda_front_carveout",
    "kda_front_l2_o_proj",
    "shared_inside",
    "mla",
    "mla_one",
    "mla_window",
    "fast_select",
    "router_lean",
    "kda",
    "handoff",
    "shared_late_wait",
    "shared_beside_router",
    "shared_down_beside",
    "moe",
    "l2_next",
    "kda_l2_ahead",
    "moe_free_sms",
)


class CacheState:
    """The cache's contents a step reads and writes (KDA states, the MLA rows near `context`), filled with
    fresh random values, saved, and put back before each output check. (Only the rows the steps write are
    saved: a copy of every 32K-row MLA cache would take 0.3 GB beside the full-shape model.)"""

    def __init__(self, cache: HybridCache, context: int, seed: int = 0) -> None:
        gen = torch.Generator(device=cache.kda_recurrent.device).manual_seed(seed)

        def fill(t: torch.Tensor, std: float) -> None:
            t.copy_(torch.randn(t.shape, generator=gen, device=t.device, dtype=torch.float32) * std)

        fill(cache.kda_recurrent, 0.05)
        fill(cache.kda_conv, 0.5)
        self.saved: list[tuple[torch.Tensor, torch.Tensor]] = []
        for mla in cache.mla.values():
            for rows in (mla.latent[:context], mla.rope[:context]):
                fill(rows, 0.5)
            for rows in (mla.latent[context - 8 : context], mla.rope[context - 8 : context]):
                self.saved.append((rows, rows.clone()))
        for t in (cache.kda_recurrent, cache.kda_conv):
            self.saved.append((t, t.clone()))

    def restore(self) -> None:
        for live, saved in self.saved:
            live.copy_(saved)


def outputs_of(graph: torch.cuda.CUDAGraph, logits: torch.Tensor, state: CacheState) -> torch.Tensor:
    state.restore()
    graph.replay()
    return logits.float().clone()


def agreement(mine: torch.Tensor, product: torch.Tensor) -> tuple[float, bool]:
    """(relative L2 distance, whether every row's greedy token is the same)."""
    rel = float((mine - product).norm() / product.norm().clamp_min(1e-30))
    return rel, bool((mine.argmax(-1) == product.argmax(-1)).all())


def launch_for(gemv: CudaGemv, variant: dict) -> GemvLaunch:
    """The GemvLaunch a variant gives this GEMV: the product's on this card (choose_launch) with the variant's
    fields. A variant that changes a GEMV's launch without naming its `window` runs that launch for every
    call (verification's too, as before GemvLaunch.window existed)."""
    fields = {k: v for k, v in variant.items() if k not in NOT_LAUNCH}
    for suffixes, more in variant.get("for", {}).items():
        if gemv.name.endswith(suffixes):
            fields.update(more)
    if fields and "window" not in fields:
        fields["window"] = None
    return dataclasses.replace(choose_launch(gemv.rows, gemv.card), **fields)


def grids(gemvs: list[CudaGemv]) -> list[str]:
    """Per kind of projection (name without its layer): rows, K, warps, grid, tasks and the most tasks a
    block runs, of the one-token kernels built so far."""
    seen: dict[str, str] = {}
    for g in gemvs:
        kind = g.name.split(" ", 2)[-1] if g.name.startswith("layer ") else g.name
        for key, (_, grid, threads, _) in g._kernels.items():
            if key[0] != 1 or kind in seen:
                continue
            tasks = -(-g.rows // 8)
            seen[kind] = (
                f"{kind:22s} rows {g.rows:6d} K {g.k:5d}: {threads // 32:2d} warps, grid {grid:4d}, "
                f"{tasks:5d} tasks, at most {-(-tasks // grid)} a block"
            )
    return list(seen.values())


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--context", type=int, default=4096)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--variants", default=";".join(VARIANTS), help="names separated by ';'")
    p.add_argument("--json", default=None)
    p.add_argument("--num-experts", type=int, default=None, help="fewer experts (512): fits an 80 GB H100 at 256")
    p.add_argument("--eager-only", action="store_true", help="run each variant's steps eagerly once, time nothing")
    p.add_argument("--deadline", type=float, default=None, help="seconds after start: capture no more variants")
    args = p.parse_args()
    names = [v.strip() for v in args.variants.split(";") if v.strip()]
    unknown = [n for n in names if n not in VARIANTS]
    if unknown:  # before the minute of loading, not after it
        print(f"unknown variants {unknown}; the names are this script's VARIANTS keys", file=sys.stderr)
        return 2
    start = time.monotonic()
    model, times = load_full_shape("fused+cuda+pdl", 4, args.num_experts)
    step = model.decode_step
    device = model.device
    gemvs = step.cuda_projections()
    routers = [k for k in (getattr(o, a) for o, a in step._slots()) if isinstance(k, CudaRouter)]
    moes = step.routers_in_experts()
    mlas = [layer.attention.mla for layer in step.layers if hasattr(layer.attention, "mla")]
    mla_launches = [(mla.ONE_TOKEN, mla.WINDOW) for mla in mlas]
    kda_splits = (fused_kda.VALUE_SPLITS, fused_kda.WINDOW_VALUE_SPLITS)
    kda_warps = (fused_kda.VALUE_WARPS, fused_kda.WINDOW_WARPS)
    product_ahead = {k: step.l2_next[k] for k in ("megabytes", "shared", "at")}  # (its MoE kernels' L2 asks)
    product_window = step.gate_up_window()  # (its MoE kernels' gate_up window on this card)
    product_beside = step.shared_beside_router  # (verification's shared gate_up beside its router on this card)
    product_down_beside = step.shared_down_beside  # (... and its shared down too)
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    print(f"loaded in {times}; {len(gemvs)} CUDA GEMVs", flush=True)
    cache = HybridCache(model.config, args.context + 16, device, model.dtype, with_nextn=True)
    history = cache.new_history(4)
    ids1 = torch.randint(0, model.config.vocab_size, (1,), device=device)
    pos1 = torch.full((1,), args.context - 2, device=device)
    ids4 = torch.randint(0, model.config.vocab_size, (4,), device=device)
    pos4 = torch.arange(args.context - 5, args.context - 1, device=device)
    state = CacheState(cache, args.context)
    eager = EagerStep(model)
    graphs = GraphCapture()
    captured = {}
    checked: dict[str, tuple[float, bool, float, bool]] = {}
    reference: tuple[torch.Tensor, torch.Tensor] | None = None
    for name in names:
        if args.deadline is not None and time.monotonic() - start > args.deadline:
            print(f"{name}: past the deadline, left out", flush=True)
            continue
        # (kernels built again keep what the graphs captured before read: the MoE kernel's schedule tables
        # (set_kernel_config), the router's counters (CudaRouter.scratch); the GEMVs' entries hold none)
        for owner in [*gemvs, *routers]:
            owner._kernels.clear()
        for g in gemvs:
            g.launch_config = launch_for(g, VARIANTS[name])
        fast = VARIANTS[name].get("fast_select", DecodeKernelConfig.fast_select)
        for moe in moes:
            moe.shared_in_experts = moe.shared_expert() if VARIANTS[name].get("shared_inside") else None
            fields = {"fast_select": fast, "gate_up_window": product_window, **VARIANTS[name].get("moe", {})}
            moe.experts.set_kernel_config(DecodeKernelConfig(**fields))
            moe.experts.set_blocks(sms - VARIANTS[name].get("moe_free_sms", 0))
        for router in routers:
            router.fast_select = fast
            router.lean_select = VARIANTS[name].get("router_lean", True)
        both, one_only = VARIANTS[name].get("mla", {}), VARIANTS[name].get("mla_one", {})
        window_only = VARIANTS[name].get("mla_window", {})
        for mla, (one, window) in zip(mlas, mla_launches, strict=True):
            mla.ONE_TOKEN = dataclasses.replace(one, **{**both, **one_only})
            mla.WINDOW = dataclasses.replace(window, **{**both, **window_only})
        step.handoff = VARIANTS[name].get("handoff", False)
        ahead = VARIANTS[name].get("l2_next", product_ahead)  # (after set_kernel_config: it sets l2_next_at)
        step.prefetch_next_weights(**ahead)
        step.shared_late_wait = VARIANTS[name].get("shared_late_wait", False)
        step.shared_beside_router = VARIANTS[name].get("shared_beside_router", product_beside)
        step.shared_down_beside = VARIANTS[name].get("shared_down_beside", product_down_beside)
        step.kda_l2_ahead = VARIANTS[name].get("kda_l2_ahead", False)
        if "kda_front" in VARIANTS[name]:  # (0: the two kernels; else a build of the fused KDA front)
            front = VARIANTS[name]["kda_front"]
            step.fuse_kda_front(
                front > 0,
                front or 2,
                VARIANTS[name].get("kda_front_min_blocks", 1),
                VARIANTS[name].get("kda_front_warps", 10),
                VARIANTS[name].get("kda_front_l2", 0),
                VARIANTS[name].get("kda_front_exchange", "cluster"),
                VARIANTS[name].get("kda_front_ring", 0),
                VARIANTS[name].get("kda_front_oproj", False),
                VARIANTS[name].get("kda_front_g_last", False),
                VARIANTS[name].get("kda_front_carveout", -1),
                VARIANTS[name].get("kda_front_l2_o_proj", 0),
            )
        else:  # the product's: this card's build or the two kernels
            step.restore_kda_front()
        splits = VARIANTS[name].get("kda", {})
        fused_kda.VALUE_SPLITS = splits.get("one", kda_splits[0])
        fused_kda.WINDOW_VALUE_SPLITS = splits.get("window", kda_splits[1])
        fused_kda.VALUE_WARPS = splits.get("one_warps", kda_warps[0])
        fused_kda.WINDOW_WARPS = splits.get("window_warps", kda_warps[1])
        try:  # a variant that cannot build or run here is reported and left out, the others still run
            if args.eager_only:  # (with CUDA_LAUNCH_BLOCKING=1 a fault's traceback names its launch)
                for run in (lambda: eager(ids1, pos1, cache), lambda: eager(ids4, pos4, cache, history)):
                    run()
                    torch.cuda.synchronize()
                print(f"{name}: eager one token and verification ran", flush=True)
                continue
            (one, (_, logits1)), (four, (_, logits4)) = (
                graphs.capture(lambda: eager(ids1, pos1, cache)),
                graphs.capture(lambda: eager(ids4, pos4, cache, history)),
            )
            outs = []
            for graph, logits in ((one, logits1), (four, logits4)):  # a fault shows here, against this variant
                outs.append(outputs_of(graph, logits, state))
                torch.cuda.synchronize()
            captured[name] = (one, four)
            if reference is None:  # the first variant (the product, where asked for) is the reference
                reference = (outs[0], outs[1])
                print(f"{name}: the reference of the output checks", flush=True)
            else:
                checked[name] = (*agreement(outs[0], reference[0]), *agreement(outs[1], reference[1]))
                rel1, same1, rel4, same4 = checked[name]
                verdict = "identical" if rel1 == rel4 == 0 else "DIFFER (its GPU layer test decides)"
                print(
                    f"{name}: outputs {verdict}: logits {rel1:.2e} (one token), {rel4:.2e} (four) from the "
                    f"reference's; greedy tokens {'the same' if same1 and same4 else 'not the same'}",
                    flush=True,
                )
        except torch.AcceleratorError as exc:  # the context is lost: nothing after this can run
            print(f"{name}: FAULT: {str(exc)[:300]}", flush=True)
            return 3
        except Exception as exc:  # noqa: BLE001
            print(f"{name}: FAILED, left out: {type(exc).__name__}: {str(exc)[:300]}", flush=True)
            torch.cuda.synchronize()
            continue
        print(f"{name}:", *grids(gemvs), sep="\n  ", flush=True)
    for moe in moes:
        moe.shared_in_experts = None
    decode: dict[str, list[float]] = {name: [] for name in captured}
    verify: dict[str, list[float]] = {name: [] for name in captured}
    for _ in range(args.rounds):
        for name, (one, four) in captured.items():
            decode[name].append(time_graph(one, replays=50, rounds=1) * 1e3)
            verify[name].append(time_graph(four, replays=30, rounds=1) * 1e3)
    report = {
        "environment": environment(),  # (versions, device, commit, the sources' digest)
        "device": torch.cuda.get_device_name(device),
        "num_experts": model.config.num_experts,
        "copy_gbs": copy_bandwidth(device) / 1e9,
        "context": args.context,
        "decode_ms": {n: statistics.median(v) for n, v in decode.items()},
        "verify_ms": {n: statistics.median(v) for n, v in verify.items()},
        "all": {"decode": decode, "verify": verify},
        "outputs_against_reference": {
            n: {"one_token_rel": c[0], "one_token_same_greedy": c[1], "four_rel": c[2], "four_same_greedy": c[3]}
            for n, c in checked.items()
        },
    }
    base = report["decode_ms"].get("product")
    for name in captured:
        d = report["decode_ms"][name]
        versus = f", {1e3 * (d - base):+.1f} us against the product" if base is not None and name != "product" else ""
        if name in checked and (checked[name][0] or checked[name][2]):
            versus += " (outputs differ from the product's)"
        print(
            f"@ {args.context}: {name:22s} decode {d:.3f} ms (rounds {min(decode[name]):.3f}-{max(decode[name]):.3f})"
            f"{versus}, verify 4 {report['verify_ms'][name]:.3f} ms",
            flush=True,
        )
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

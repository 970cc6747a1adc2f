// One token's routed MoE (gate_up, SwiGLU, down, weighted combine) in one persistent kernel.
//
// Compiled at run time by NVRTC for the layer's exact shapes (solo/kernels/cuda_moe.py); the
// defines below are set there. One block per SM, all resident at once (cooperative launch). The
// token's top-k experts are 25 MB at Ling-3.0-flash shapes, which fits in the GPU's shared memory,
// so each block asks for its whole share of the weight and scale bytes with 1-D bulk (TMA) copies
// at the start, in the order it will need them; the down weights are on chip before the
// activations they multiply exist.
//
// Work: a gate_up tile is 8 gate + 8 up rows of one expert slot (whole K); a down tile is 8
// output rows of all top-k slots, and a block's down tiles are consecutive rows (one copy per slot
// moves them all). A host schedule spreads the tiles over the blocks by bytes.
// Warps: GU_WARPS compute gate_up (one 4-chunk K slice each, activations in registers), one
// producer warp issues the copies, one publisher warp reduces each gate_up tile, applies SwiGLU and
// the routing weight, and stores the activations to global memory (ACT_COPIES copies), each value
// tagged with the launch number, without fences. Then every compute warp (the gate_up warps and
// DN_WARPS more) does down items (one down tile x one K slice), slot pair by slot pair: they read
// the pair's activations (each 16-byte piece once per block), store them to shared memory as fp16
// and check the tags at one barrier; each poll round reloads the stale pieces of this pair and of
// every later one (REFRESH_PENDING), so a pair whose values all arrived meanwhile costs no round.
// x and the launch number are read once per block, by the publisher (every warp reading them was
// an L2 hot spot at the start).
//
// ROUTER (the fused decode step's MoE layers): the kernel is also the layer's router, so the step
// has no router launch and no kernel boundary between the routing and the experts. x is then the
// residual stream: the gate_up warps normalise it (post-attention RMSNorm, block 0 also writes the
// normalised row for the shared expert), each block scores its EPB experts (their router rows are
// loaded before griddepcontrol.wait: they do not depend on the previous kernel) and publishes the
// sigmoid scores tagged with the launch number (one 64-bit word each: tag and value arrive together,
// no fence); then every block selects from all E scores itself (the same grouped top-k as
// router_decode.cu: groups by the sum of their two best biased scores, ties to the lower index; the
// top-k by rank counting, in each warp, then over the warps' best), and the producer
// issues the copies of the experts it chose.
//
// SHARED (with ROUTER): the layer's shared expert (block-FP8 SwiGLU MLP, intermediate SHI) runs in the
// same launch, on the down warps, which wait for the routed activations anyway. Its weights do not
// depend on the previous kernel: the producer copies them (block b < SHI / 8: gate_up rows 8b..8b+7 of
// gate and of up; every block: the shared down rows of its own down tiles) into the tail of the tile
// area before griddepcontrol.wait. Once the gate_up warps have normalised x, the down warps compute the
// block's 8 shared SwiGLU activations, publish them tagged (bf16 bits, SH_COPIES copies), gather all SHI
// of them (polling their tags), compute the shared down rows of the block's output rows and release the
// tail (mbarrier SH_FREE: the producer issues the routed copies that land there only after it). The
// kernel then writes the layer's new residual stream, x + shared + routed, rounded as the separate
// kernels round it (the shared down's bf16 result added to x, then the routed sum's bf16 result).
//
// Products on the tensor cores (mma.m16n8k16, fp16 in, fp32 sums): the packed E2M1 words
// (pack_e2m1_words) unpack to fp16 pairs equal to value * 2^-14, times the group's factor
// 2^(s-113) they are the weights (exact for E8M0 scales s in [104, 128]). Shared-memory reads
// are free of bank conflicts without swizzling: in every 8-lane phase, rows of even MMA row
// index read 16-byte chunks c..c+3 of a 128-byte line and odd rows chunks c+4..c+7; each lane's
// B column holds the activations of its own chunk, so row r's sum is in the columns of r's parity.

#ifndef H
#error "H (hidden size) must be defined"
#endif
#define GU_WARPS (H / 128)             // each covers 4 chunks (128 codes) of every row, per tile
#define DN_WARPS (I / 128)
#define PAIRS (TOPK / 2)
#define PRODUCER (GU_WARPS + DN_WARPS)
#define PUBLISHER (PRODUCER + 1)
#define OBSERVER (PUBLISHER + 1)        // TRACE only: stamps each copy group's arrival
#define NWARPS (PUBLISHER + 1 + (TRACE ? 1 : 0))
// PROBE (diagnostics, wrong results, timing only): 1 copies only (no products), 2 no scale copies,
// 3 no activation exchange (each block reads the activations once, whatever their tags), 4 no down products
#ifndef PROBE
#define PROBE 0
#endif
// trace row slots (TRACE): [launch parity][block][TRACE_SLOTS] globaltimer stamps
#define TRACE_SLOTS 80
#define T_START 0
#define T_END 1
#define T_FIRST_GU 2
#define T_PUBLISHED 3
#define T_PAIR0 4                       // 4..7: slot pair p's activations staged
#define T_ISSUED 8
#define T_IDS 9
#define T_LAST_GU 10
#define T_DOWN_DONE 11
#define T_SMID 12
#define T_WAITED 13
#define T_NORMED 14                     // ROUTER: x normalised (gate_up warp 0)
#define T_SCORED 15                     // ROUTER: this block's scores published
#define T_SEEN 28                       // ROUTER: every score seen (selection warps)
#define T_SELECTED 29                   // ROUTER: the selection in shared memory
#define T_BIASED 30                     // ROUTER: thread 0's score arrived and its bias added
#define T_WARP_BEST 31                  // ROUTER: the warps' best written (the selection's first barrier)
#define T_RANKED 27                     // ROUTER: thread 0's candidate ranked (before the second barrier)
#define T_RANKS_IN 58                   // ROUTER: every candidate's place written (after the second barrier)
#define T_EARLY_STAGED 59               // EARLY_PAIRS: the early pairs' activations staged (down warp 0)
#define T_EARLY_DONE 60                 // EARLY_PAIRS: the early pairs' products handed over (down warp 0)
#define T_SCORES_FIRST 52               // ROUTER: the first selection warp with all 32 of its scores current
#define T_SCORES_LAST 53                // ROUTER: the last one (the exchange's end for this block)
#define N_SCORE_POLLS 54                // ROUTER: the most score loads any lane of the block issued (a count)
#define T_SELECT2 55                    // SELECT_TWICE: the selection's second run begins (its stamps are the second's)
#define C_SEL0 64                       // ROUTER: 64 + k: clock64 of thread 0 at the selection's step k (SEL_CLOCK below)
#if TRACE
#define SEL_CLOCK(k)                                       \
    do {                                                   \
        if (threadIdx.x == 0) trow[C_SEL0 + (k)] = clock64(); \
    } while (0)
#else
#define SEL_CLOCK(k) \
    do {             \
    } while (0)
#endif
#define T_GROUP0 16                     // 16.. : copy group q (issue order) complete
#define C_PAIR0 32                      // 32 + 4 * p + s: clock64 of warp 0 in pair p's down step s: 0 enter,
                                        // 1 staged, 2 its down rows there, 3 products done
#define N_POLLS0 48                     // 48 + p: poll rounds of pair p (block-wide)
#define C_START 56                      // clock64 at the block's start and end (with T_START, T_END: the clock rate)
#define C_END 57
#define GU_WORD_BYTES (4 * H)           // 8 rows of H/2 bytes (gate, then up)
#define DN_WORD_BYTES (4 * I)           // 8 rows of I/2 bytes
// Scale rows are copied right after their tile's words (plain loads of them, issued before or after
// the copies, were slower: docs/kernels.md).
#define GU_TILE_BYTES (2 * GU_WORD_BYTES + H / 2)
#define DN_SLOT_BYTES (DN_WORD_BYTES + I / 4)  // per 8 rows; a block's down rows are contiguous, and
                                                // each slot's words (then scales) for all of them are one copy
#define DOWN_WORKERS (GU_WARPS + DN_WARPS)  // every compute warp, the gate_up warps after their last tile
#define MAX_ITEMS ((MAX_DN * DN_WARPS + DOWN_WORKERS - 1) / DOWN_WORKERS)  // (down tile, K slice) items per warp
#define STAGE_PIECES ((I / 2 + DOWN_WORKERS * 32 - 1) / (DOWN_WORKERS * 32))  // 16-byte pieces per lane per pair
#define BAR_STAGED 8                    // a slot pair's activations are in shared memory (and all current)
#ifndef SHARED
#define SHARED 0
#endif
#define ROW_WORDS (2 + MAX_GU + MAX_DN + MAX_GU + PAIRS + SHARED)  // SHARED: + the first copy group into the tail
#if X_IN_TILES && SHARED
#error "X_IN_TILES is not for the kernel with the shared expert inside (it reads x to the end)"
#endif
#if X_IN_TILES && PROBE == 1
#error "X_IN_TILES needs the gate_up warps (the copies-only probe has none)"
#endif
#if ROUTER && PROBE == 1
#error "the copies-only probe has no gate_up warps to route with: not with the router inside (it would wait forever)"
#endif
#define NUM_BARS (MAX_GU + PAIRS + 2 * SHARED + X_IN_TILES)
#define X_FREE (MAX_GU + PAIRS)         // X_IN_TILES: the gate_up warps hold their x (GU_WARPS arrivals)
#define SH_BAR (MAX_GU + PAIRS)         // SHARED: the shared expert's weights are in shared memory
#define SH_FREE (SH_BAR + 1)            // SHARED: the down warps are done with them (DN_WARPS arrivals)
#define BAR_FULL0 9                     // named barriers 9.. : gate_up tile i's partials ready (one buffer each)
#if MAX_GU > 7
#error "at most 7 gate_up tiles per block (named barriers 9..15)"
#endif
#define BAR_DOWN 5                      // down partials ready
#define BAR_INPUTS 6                    // x and the launch number are in shared memory
#define BAR_ROUTER 4                    // ROUTER: the gate_up warps' steps (norm, scores, selection)
#define BAR_ROUTED 7                    // ROUTER: the selected experts and weights are in shared memory
#define BAR_SELECT 3                    // ROUTER: the selection warps' steps
#define BAR_NORMED 2                    // SHARED: x is normalised (gate_up warps arrive, down warps wait);
                                        // then the down warps' own steps
#define BAR_SH 2
#ifndef ROUTER
#define ROUTER 0
#endif
#if ROUTER
#define EPB ((E + NBLOCKS - 1) / NBLOCKS)        // experts each block scores
#define WCH (H / 256)                            // 256-column warp chunks of a router row
#define RCH ((EPB * WCH + GU_WARPS - 1) / GU_WARPS)  // router-row pieces per gate_up lane
#define SEL_WARPS (E / 32)                       // selection warps: one expert per lane
#ifndef SCORE_POLL_NS
#define SCORE_POLL_NS 64                         // back-off between polls of the scores (0: none)
#endif
#ifndef SCORE_COPIES
#define SCORE_COPIES 8                           // copies of the exchanged scores (block b polls copy b % 8)
#endif
// SCORE_STAGGER (a variant, DecodeKernelConfig.score_stagger; ns, 0: off): each selection lane keeps four loads of
// its score in flight, issued this far apart, instead of one load, a back-off and the next: a score that becomes
// visible is seen about one L2 round trip later, not up to two (every poll round is a round trip)
#ifndef SCORE_STAGGER
#define SCORE_STAGGER 0
#endif
// SELECT_TWICE (a probe of TRACE builds, DecodeKernelConfig.probe "select_twice": the same results, later): the
// selection (from the score polls to the experts in shared memory) runs twice, one copy of its code, and the trace
// stamps the second run (T_SELECT2 at its start). The first run's time over the second's is what fetching its
// instructions costs where they are not cached.
#ifndef SELECT_TWICE
#define SELECT_TWICE 0
#endif
// LEAN_SELECT (a variant, DecodeKernelConfig.lean_select; with FAST_SELECT's whole-warp groups): the selection ranks
// the groups once, lane g group g, and keeps the ballot of the kept ones; each lane's own group's rank (the same 8
// shuffles and twice the comparisons again) only zeroed keys that no kept warp reads. The same choices.
#ifndef LEAN_SELECT
#define LEAN_SELECT 0
#endif
#if SELECT_TWICE && !TRACE
#error "SELECT_TWICE is a probe of TRACE builds"
#endif
// EARLY_IDS (a variant, DecodeKernelConfig.early_ids; with ROUTER): the threads that rank the top-k write the
// chosen experts straight into sm.experts, and the producer passes the ranking's own barrier (BAR_IDS, the selection
// warps arrive, warp 0 and the producer wait) instead of waiting for warp 0 to sum and divide the weights first;
// the weights then reach the publisher alone (BAR_ROUTED of 64). The same results: only when the copies start.
#ifndef EARLY_IDS
#define EARLY_IDS 0
#endif
#if EARLY_IDS && SELECT_TWICE
#error "EARLY_IDS: the selection's second run would write the experts the producer is copying"
#endif
// FAST_SELECT (a variant, DecodeKernelConfig.fast_select): where groups are whole warps, the warps of the
// discarded groups (zero keys only) skip the in-warp ranking and the kept warps' best are the only
// candidates (KEEP x warps-per-group x TOPK, 64 at Ling shapes, instead of 128), each ranked by 4 threads;
// the same experts in the same order as the full ranking, whose zero keys can never rank below TOPK
#ifndef FAST_SELECT
#define FAST_SELECT 0
#endif
// WARP_SELECT (a variant, DecodeKernelConfig.warp_select; with ROUTER, where groups are whole lane columns or there is
// no group limit): the selection warps only write their experts' keys and scores into shared memory and arrive on
// BAR_SELECT; the producer warp alone chooses, lane l holding experts l + 32 j: the groups' two best by two warp
// reductions a group (redux.sync), the groups' ranks without a shuffle, then TOPK rounds of a warp maximum and a warp
// minimum of the tied indices. No barrier between the selection's steps, and the producer holds the experts it
// copies; the same choices and weights bit for bit.
#ifndef WARP_SELECT
#define WARP_SELECT 0
#endif
// DOWN_AFTER (a variant, DecodeKernelConfig.down_after): the producer issues the first down copy only once
// this many of the gate_up tiles it issued before have landed (0: at once). Every block asks for its whole
// share at the selection, so HBM serves the blocks' down bytes beside other blocks' gate_up tiles, and the
// last gate_up tile anywhere (which the activation exchange waits for) lands near the end of the 25 MB; the
// down bytes are needed only after that exchange.
#ifndef DOWN_AFTER
#define DOWN_AFTER 0
#endif
// X_IN_TILES (a variant, DecodeKernelConfig.x_in_tiles; not with SHARED): x lives at the start of the block's down
// area of the tile memory, not in Smem, until every gate_up warp holds its slice in registers (they arrive on the
// mbarrier X_FREE); the producer issues the first down copy, which lands there, only after that. Its 5 KB (at Ling
// shapes) let the schedule give every block at most 6 gate_up tiles (DecodeKernelConfig.balance "gate_up").
#ifndef X_IN_TILES
#define X_IN_TILES 0
#endif
// GU_WINDOW (a variant, DecodeKernelConfig.gate_up_window): the producer keeps at most this many of its gate_up tiles
// in flight (0: all at once), issuing tile i once tile i - GU_WINDOW has landed. Asked all at once, a block's tiles
// land together near the end of the 16 MB (the memory serves the whole GPU's requests in its own order), and the
// gate_up warps, which take about half a microsecond a tile, then work through five or six of them in a row; in a
// window the tiles land one after another while the warps keep up, and 132 blocks x a few tiles still keep several
// MB in flight.
#ifndef GU_WINDOW
#define GU_WINDOW 0
#endif
// WINDOW_DOWNS (with GU_WINDOW; DecodeKernelConfig.window_downs): the window spans every copy group in issue order,
// the down groups too (group q is issued once group q - GU_WINDOW has landed), so that a block's down rows follow its
// last gate_up tiles by the window, not after all of them have landed (DOWN_AFTER)
#ifndef WINDOW_DOWNS
#define WINDOW_DOWNS 0
#endif
// BIAS_EARLY (a variant, DecodeKernelConfig.bias_early; with ROUTER): each selection lane reads its expert's
// bias before griddepcontrol.wait, with the router rows, instead of after its score arrived
#ifndef BIAS_EARLY
#define BIAS_EARLY 0
#endif
// X_EARLY (DecodeKernelConfig.x_early; with ROUTER): the gate_up warps load x before the inputs' barrier
#ifndef X_EARLY
#define X_EARLY 1
#endif
#if SHARED
#define SH_TASKS (SHI / 8)                               // shared gate_up tasks: 8 gate + 8 up rows, block b < SH_TASKS
#define SH_RPW ((8 * MAX_DN + DN_WARPS - 1) / DN_WARPS)  // shared down rows per down warp
#define SH_PIECES (SHI / 256)                            // 8-column pieces of the shared down per lane
#if SHI % 256 || SH_TASKS > NBLOCKS || SH_RPW > 32 || DN_WARPS * 16 > MAX_DN * DN_WARPS * 8
#error "SHARED needs SHI a multiple of 256, SHI / 8 <= NBLOCKS, and 8 * MAX_DN >= 16 (scratch in dn_part)"
#endif
#endif
#if SEL_WARPS * TOPK > SEL_WARPS * 32
#error "top-k above 32"
#endif
#define GSIZE (E / GROUPS)
#define FAST_SEL (FAST_SELECT && KEEP < GROUPS && GSIZE >= 32)  // (elsewhere the full ranking runs)
#define WARP_SEL (WARP_SELECT && (KEEP == GROUPS || GSIZE % 32 == 0))  // (elsewhere the selection warps choose)
#if WARP_SEL && (EARLY_IDS || SELECT_TWICE)
#error "WARP_SELECT: the producer chooses; not with EARLY_IDS or SELECT_TWICE"
#endif
#if WARP_SEL && TOPK > (KEEP < GROUPS ? KEEP * GSIZE : E)
#error "WARP_SELECT needs at least TOPK experts in the kept groups"
#endif
#if E % 32 || SEL_WARPS > GU_WARPS || SEL_WARPS > 32 || H / 8 > GU_WARPS * 32
#error "ROUTER needs E a multiple of 32, E / 32 <= H / 128 gate_up warps, E <= 1024"
#endif
#else
#define WARP_SEL 0
#endif
#if SHARED && !ROUTER
#error "SHARED runs with ROUTER (the gate_up warps normalise x)"
#endif
#define INPUT_THREADS ((GU_WARPS + DN_WARPS + 1) * 32)  // the compute warps and the publisher
// EARLY_PAIRS (a variant, DecodeKernelConfig.early_pairs): the down warps, idle while the gate_up warps work through
// their tiles, do the first EARLY_PAIRS slot pairs' down products themselves as soon as those pairs' activations
// and down rows are there (the schedule issues those pairs' down rows right after the block's gate_up tiles of the
// pair), instead of every compute warp doing every pair after its last gate_up tile. Each down warp takes K slice
// dw of all of the block's down tiles, with the product's MMA chains, and hands the row sums' parts over through
// the early pairs' own activation memory (no longer read then); each later item's owner continues from them, so
// the sums are the product's bit for bit. Not with SHARED (whose down warps run the shared expert).
#ifndef EARLY_PAIRS
#define EARLY_PAIRS 0
#endif
#if EARLY_PAIRS && (SHARED || EARLY_PAIRS >= TOPK / 2)
#error "EARLY_PAIRS needs the down warps free (no SHARED) and fewer than TOPK / 2 pairs"
#endif
#define BAR_EARLY 2                     // EARLY_PAIRS: the down warps' own steps (SHARED's barrier 2 is not built)
#if EARLY_PAIRS && MAX_DN * DN_WARPS * 128 > EARLY_PAIRS * 4 * I
#error "EARLY_PAIRS hands its sums over in the early pairs' activation memory, which is too small here"
#endif
#define EARLY_PIECES ((EARLY_PAIRS * I / 2 + DN_WARPS * 32 - 1) / (DN_WARPS * 32))  // 16-byte pieces a down lane
#ifndef UNROLL_PAIRS
#define UNROLL_PAIRS 1
#endif
#ifndef REFRESH_PENDING
#define REFRESH_PENDING 1
#endif
// L2_NEXT (a lab variant, PersistentDecodeMoE.prefetch_next and DecodeKernelConfig.l2_next_at): the kernel
// also asks the L2 for L2_NEXT regions of weights the step reads after it (the shared expert's, the first
// tasks of the next layer's input projection), each block its share of each region in bulk prefetches
// (cp.async.bulk.prefetch.L2: no registers, no result; a hint, every result stays the same). When:
// L2_NEXT_AT 1, by the producer once its block's copies have landed; 2, once the block's activation exchange
// is done (every block's gate_up tiles landed); 3, at the block's end; 4, by the producer as soon as the
// previous kernel is complete (while the block routes). The window it fills is the HBM's idle time in the
// kernel's tail and in the short kernels after it (4: in the routing). The issuing thread copies the table
// into shared memory before griddepcontrol.wait, so that its read is not a round trip at the ask.
// L2_NEXT_AT 5 and 6: the down warps, idle until the selection, ask with per-line prefetches of the load
// path (prefetch.global.L2, one 128-byte line a thread at a time) instead of the copy engine, whose queue the
// expert copies then find empty: 5 once the previous kernel is complete (while the gate_up warps route), 6
// before (while it ends; the weights do not depend on it).
#ifndef L2_NEXT
#define L2_NEXT 0
#endif
#ifndef L2_NEXT_AT
#define L2_NEXT_AT 0
#endif
#if L2_NEXT && (L2_NEXT_AT < 1 || L2_NEXT_AT > 6 || L2_NEXT > 8)
#error "L2_NEXT (at most 8 regions) needs L2_NEXT_AT 1..6"
#endif
#define L2_LINES (L2_NEXT_AT == 5 || L2_NEXT_AT == 6)  // the down warps ask, a line a thread at a time
#define L2_ASKER (L2_NEXT_AT == 1 || L2_NEXT_AT == 4 ? PRODUCER * 32 : L2_LINES ? GU_WARPS * 32 : 0)  // copies the table
#define BAR_L2_TABLE 1                  // L2_LINES: the table is in shared memory (the down warps)
#define BAR_IDS 1                       // EARLY_IDS: the chosen experts are in sm.experts (not with L2_LINES)
#if EARLY_IDS && L2_LINES
#error "EARLY_IDS takes named barrier 1, which L2_NEXT_AT 5 and 6 use"
#endif
#define ROUTED_THREADS (EARLY_IDS || WARP_SEL ? 64 : 96)  // BAR_ROUTED: warp 0 of the selection (not with WARP_SEL),
                                                        // the publisher (and the producer)
#define L2_PIECE 32768u                 // bytes per bulk prefetch

// u32, warp_sum, ld_stream, rms_value, bf16_pair: the helpers router_decode.cu uses too
#include "step_common.cuh"

typedef unsigned long long u64;

#if ID64
typedef long long expert_id_t;
#else
typedef int expert_id_t;
#endif

struct __align__(16) Smem {
    u64 bars[NUM_BARS];
    expert_id_t experts[8];
    u32 launch;                 // the launch number (read once per block: every warp reading it was an L2 hot spot)
#if !X_IN_TILES
    uint4 x[H / 8];             // the token's activations, bf16 (read once per block, not once per warp)
#endif
    uint4 act_h[TOPK * I / 8];  // all slots' activations in fp16, 16-byte units swizzled (act_unit)
    float wts[8];               // ROUTER: the selected experts' weights
    union {
        float gu_part[MAX_GU][GU_WARPS][16];
#if ROUTER
        // used before the producer issues the first copy, so before any gate_up partial exists
        struct {
            float red[GU_WARPS];                 // RMSNorm: sums of squares per warp
            float part[GU_WARPS * RCH];          // router scores: warp chunk partial dot products
            float gtop[2][GROUPS][(GSIZE + 31) / 32];  // groups: their two best biased scores, per warp
#if WARP_SEL
            u32 skey[E];                         // every expert's key (rt_key of its biased score)
            float sscore[E];                     //   ... unbiased score
#else
            u64 key[SEL_WARPS][8];               // each selection warp's best, in order: key << 32 | ~index
            float score[SEL_WARPS][8];           //   ... unbiased score
#endif
            int sel_idx[8];                      // the block's top-k in order: expert index
            float sel_score[8];                  //   ... unbiased score
        } rt;
#endif
    };
    float dn_part[MAX_DN][DN_WARPS][8];
#if L2_NEXT
    u64 l2_table[2 * L2_NEXT];  // L2_NEXT: the regions, copied by the asking thread before the wait
#endif
};
#define TILES_OFFSET ((sizeof(Smem) + 127) / 128 * 128)

__device__ __forceinline__ void bar_wait(u32 bar) {
    asm volatile(
        "{\n.reg .pred p;\nWAIT_%=:\n"
        "mbarrier.try_wait.parity.shared::cta.b64 p, [%0], 0;\n"
        "@!p bra WAIT_%=;\n}\n" ::"r"(bar)
        : "memory");
}

// L2_NEXT: this block's share of each region [address, address + bytes) of `table` ([L2_NEXT][2] u64, in
// shared memory), whole 256-byte pieces (bytes are multiples of 16: PersistentDecodeMoE.prefetch_next), asked
// from byte `first` of the share on in steps of `step` bytes: bulk prefetches of up to `step` bytes each, or
// (LINES) a 128-byte line each on the load path
template <bool LINES>
__device__ __forceinline__ void l2_next_ask(const u64 *table, u64 first, u64 step) {
#if L2_NEXT
#pragma unroll 1
    for (int r = 0; r < L2_NEXT; ++r) {
        const u64 base = table[2 * r], bytes = table[2 * r + 1];
        const u64 share = ((bytes + NBLOCKS - 1) / NBLOCKS + 255) & ~(u64)255;
        const u64 end = min(bytes, (u64)(blockIdx.x + 1) * share);
        for (u64 at = (u64)blockIdx.x * share + first; at < end; at += step) {
            if (LINES) {
                asm volatile("prefetch.global.L2 [%0];" ::"l"(base + at) : "memory");
            } else {
                const u32 n = (u32)min(step, end - at);
                asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(base + at), "r"(n) : "memory");
            }
        }
    }
#else
    (void)table;
    (void)first;
    (void)step;
#endif
}

// the bulk asks (L2_NEXT_AT 1..4): pieces of L2_PIECE bytes
__device__ __forceinline__ void l2_next_prefetch(const u64 *table) { l2_next_ask<false>(table, 0, L2_PIECE); }

// L2_LINES: the lines spread over the DN_WARPS * 32 threads (d: this thread's index among them)
__device__ __forceinline__ void l2_next_lines(const u64 *table, int d) {
    l2_next_ask<true>(table, 128u * d, 128u * DN_WARPS * 32);
}

__device__ __forceinline__ void bulk_copy(u32 dst, const void *src, u32 bytes, u32 bar, u64 policy) {
#if EVICT_FIRST
    asm volatile(
        "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes.L2::cache_hint [%0], [%1], %2, [%3], %4;" ::"r"(dst),
        "l"(src), "r"(bytes), "r"(bar), "l"(policy)
        : "memory");
#else
    bulk_to_shared(dst, src, bytes, bar);
#endif
}

__device__ __forceinline__ uint4 ld_cg4(const u32 *p) {
    uint4 v;
    asm volatile("ld.relaxed.gpu.global.v4.u32 {%0,%1,%2,%3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                 : "l"(p)
                 : "memory");
    return v;
}

__device__ __forceinline__ u64 globaltimer() {
    u64 t;
    asm volatile("mov.u64 %0, %globaltimer;" : "=l"(t));
    return t;
}

// the timer read once `v` exists (an unused input: the compiler cannot read the timer before computing it)
__device__ __forceinline__ u64 globaltimer_after(u32 v) {
    u64 t;
    asm volatile("mov.u64 %0, %globaltimer;" : "=l"(t) : "r"(v));
    return t;
}

// Codes J and J+4 of a packed word as an fp16 pair (low half code J), each value * 2^-14.
__device__ __forceinline__ u32 e2m1_pair(u32 w, int j) {
    if (j == 0) return w & 0x8E008E00u;
    if (j == 1) return (w << 3) & 0x8E008E00u;
    if (j == 2) return ((w << 6) & 0x0E000E00u) | ((w << 1) & 0x80008000u);
    return ((w << 9) & 0x0E000E00u) | ((w << 2) & 0x80008000u);
}

// fp16 pair of 2^(s-113), s an E8M0 scale byte (0 for s < 99: those groups' values are < 2^-28)
__device__ __forceinline__ u32 scale_factor(u32 s) {
    u32 e = s > 98u ? s - 98u : 0u;
    return (e << 10) | (e << 26);
}

__device__ __forceinline__ u32 hmul2(u32 a, u32 b) {
    u32 d;
    asm("mul.rn.f16x2 %0, %1, %2;" : "=r"(d) : "r"(a), "r"(b));
    return d;
}

// A pair of a word's codes as an MMA operand, scaled by the row's fp16 factor f.
// (The scale cannot wait until after the products: an MMA row's 16 K values come from the 4 lanes of a
// quad, each lane's chunk a different 32-code scale group, so one row's sum mixes four scales.)
__device__ __forceinline__ u32 weight_pair(u32 w, int j, u32 f) { return hmul2(e2m1_pair(w, j), f); }

// 16 rows (two 8-row groups) x one 16-byte chunk (4 words, 32 codes) per lane: 8 MMAs.
// lo/hi: the chunk of MMA row g and g+8; flo/fhi: their scale factors (scale_factor); xb: 16 activation pairs.
// Two accumulators (a0: pairs 0-1, a1: pairs 2-3 of each word) halve the chain of dependent MMAs.
__device__ __forceinline__ void chunk_products(float *a0, float *a1, uint4 lo, uint4 hi, u32 flo, u32 fhi,
                                               const u32 *xb) {
    const u32 wl[4] = {lo.x, lo.y, lo.z, lo.w};
    const u32 wh[4] = {hi.x, hi.y, hi.z, hi.w};
#pragma unroll
    for (int k = 0; k < 4; ++k) {
#pragma unroll
        for (int jj = 0; jj < 2; ++jj) {
            const int j0 = 2 * jj, j1 = 2 * jj + 1;
            mma(jj ? a1 : a0, weight_pair(wl[k], j0, flo), weight_pair(wh[k], j0, fhi),
                     weight_pair(wl[k], j1, flo), weight_pair(wh[k], j1, fhi), xb[4 * k + j0], xb[4 * k + j1]);
        }
    }
}

// (no cuda_fp16.h / cuda_bf16.h: NVRTC does not ship them everywhere)
__device__ __forceinline__ u32 f16_pair(float lo, float hi) {
    u32 d;
    asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(d) : "f"(hi), "f"(lo));
    return d;
}

__device__ __forceinline__ float bf16_to_float(unsigned short b) { return __uint_as_float((u32)b << 16); }

__device__ __forceinline__ unsigned short float_to_bf16(float f) {
    unsigned short d;
    asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(d) : "f"(f));
    return d;
}

// Unit k (elements 8k..8k+7) of chunk ch (32 elements) of the staged fp16 activations; the swizzle
// makes the 8 lanes of a phase, which read 8 different chunks, hit 8 different 16-byte bank groups.
__device__ __forceinline__ int act_unit(int ch, int k) { return 4 * ch + (k ^ ((ch >> 1) & 3)); }

__device__ __forceinline__ int stage_piece(int d, int lane, int k) { return d * 32 + lane + k * DOWN_WORKERS * 32; }

__device__ __forceinline__ void stage_issue(uint4 *ahead, const u32 *copy, int p, int d, int lane) {
#pragma unroll
    for (int k = 0; k < STAGE_PIECES; ++k)
        if (stage_piece(d, lane, k) < I / 2) ahead[k] = ld_cg4(copy + 2 * p * I + 4 * stage_piece(d, lane, k));
}

// The AND of `ok` over the `threads` threads at named barrier `bar` (bar.red orders their shared-memory
// stores like bar.sync)
__device__ __forceinline__ bool bar_all(bool ok, u32 bar, u32 threads) {
    u32 all_ok;
    asm volatile(
        "{\n.reg .pred pi, po;\nsetp.ne.u32 pi, %1, 0;\nbar.red.and.pred po, %2, %3, pi;\n"
        "selp.u32 %0, 1, 0, po;\n}\n"
        : "=r"(all_ok)
        : "r"((u32)ok), "r"(bar), "r"(threads)
        : "memory");
    return all_ok != 0;
}

__device__ __forceinline__ bool piece_current(uint4 v, u32 tag) {
    return (v.x >> 16) == tag && (v.y >> 16) == tag && (v.z >> 16) == tag && (v.w >> 16) == tag;
}

// Load again the pieces of pair p whose tags are stale (a current value stays current).
__device__ __forceinline__ void stage_refresh(uint4 *ahead, const u32 *copy, int p, int d, int lane, u32 tag) {
#pragma unroll
    for (int k = 0; k < STAGE_PIECES; ++k)
        if (stage_piece(d, lane, k) < I / 2 && !piece_current(ahead[k], tag))
            ahead[k] = ld_cg4(copy + 2 * p * I + 4 * stage_piece(d, lane, k));
}

// The stale pieces of pairs first..last (pending[q] is only indexed by constants, so it stays in
// registers also where first and last are not constants).
__device__ __forceinline__ void refresh_pairs(uint4 (*pending)[STAGE_PIECES], const u32 *copy, int first, int last,
                                              int d, int lane, u32 tag) {
#pragma unroll
    for (int q = 0; q < PAIRS; ++q)
        if (q >= first && q <= last) stage_refresh(pending[q], copy, q, d, lane, tag);
}

// The fp16 halves of a loaded piece (4 tagged activations from element e on) into shared memory.
__device__ __forceinline__ void stage_store(uint4 *act_h, int e, uint4 v) {
    uint2 *dst = reinterpret_cast<uint2 *>(act_h + act_unit(e >> 5, (e & 31) >> 3)) + ((e >> 2) & 1);
    *dst = make_uint2(__byte_perm(v.x, v.y, 0x5410), __byte_perm(v.z, v.w, 0x5410));
}

#if EARLY_PAIRS
// The first EARLY_PAIRS pairs' activations into shared memory by the down warps alone (down warp dw, lane l: the
// pairs' pieces dw * 32 + l + k * DN_WARPS * 32), polled until every tag is current (stale values in shared memory
// are overwritten by the next round, as in stage_finish).
__device__ __forceinline__ void early_stage(const u32 *copy, int dw, int lane, u32 tag, uint4 *act_h) {
    uint4 v[EARLY_PIECES];
#pragma unroll
    for (int k = 0; k < EARLY_PIECES; ++k) {
        const int pc = dw * 32 + lane + k * DN_WARPS * 32;
        if (pc < EARLY_PAIRS * I / 2) v[k] = ld_cg4(copy + 4 * pc);
    }
    for (;;) {
        bool ok = true;
#pragma unroll
        for (int k = 0; k < EARLY_PIECES; ++k) {
            const int pc = dw * 32 + lane + k * DN_WARPS * 32;
            if (pc >= EARLY_PAIRS * I / 2) continue;
            ok = ok && piece_current(v[k], tag);
            stage_store(act_h, 4 * pc, v[k]);
        }
        if (bar_all(ok, BAR_EARLY, DN_WARPS * 32)) return;
        __nanosleep(POLL_NS);
#pragma unroll
        for (int k = 0; k < EARLY_PIECES; ++k) {
            const int pc = dw * 32 + lane + k * DN_WARPS * 32;
            if (pc < EARLY_PAIRS * I / 2 && !piece_current(v[k], tag)) v[k] = ld_cg4(copy + 4 * pc);
        }
    }
}

// Where down warp dw's lane (g, t < 2) leaves the two accumulators' parts of down tile j (floats in the early pairs'
// activation memory): the element of its fragment that the row sums read at the end, 2 t + (g & 1).
__device__ __forceinline__ int early_slot(int j, int dw, int g, int t) { return ((j * DN_WARPS + dw) * 16 + 2 * g + t) * 2; }
#endif

// Store the fp16 halves of the pieces loaded for pair p to shared memory and check their tags (all
// DOWN_WORKERS warps at once, one barrier: bar.red orders the stores like bar.sync); if any is stale,
// load the stale ones again and repeat (stale values in shared memory are overwritten then). Each
// poll round also reloads the stale pieces of every later pair (REFRESH_PENDING), so that a round
// brings all of them up to date instead of the later pairs waiting their turn.
__device__ __forceinline__ int stage_finish(uint4 (*pending)[STAGE_PIECES], const u32 *copy, int p, int d, int lane,
                                            u32 tag, uint4 *act_h) {
    int rounds = 0;
    for (;; ++rounds) {
        bool ok = true;
#pragma unroll
        for (int q = 0; q < PAIRS; ++q) {
            if (q != p) continue;
            const uint4 *ahead = pending[q];
#pragma unroll
            for (int k = 0; k < STAGE_PIECES; ++k) {
                if (stage_piece(d, lane, k) >= I / 2) continue;
                ok = ok && piece_current(ahead[k], tag);
                stage_store(act_h, 2 * p * I + 4 * stage_piece(d, lane, k), ahead[k]);
            }
        }
#if PROBE == 3
        ok = true;
#endif
        if (bar_all(ok, BAR_STAGED, DOWN_WORKERS * 32)) return rounds;
        __nanosleep(POLL_NS);
        refresh_pairs(pending, copy, p, REFRESH_PENDING ? PAIRS - 1 : p, d, lane, tag);
    }
}

// The 16 B-fragment pairs of chunk ch: word k's pair j is (element 8k+j, element 8k+j+4).
__device__ __forceinline__ void load_b_fragments(u32 *xb, const uint4 *act_h, int ch) {
#pragma unroll
    for (int k = 0; k < 4; ++k) {
        const uint4 u = act_h[act_unit(ch, k)];
        xb[4 * k + 0] = __byte_perm(u.x, u.z, 0x5410);
        xb[4 * k + 1] = __byte_perm(u.x, u.z, 0x7632);
        xb[4 * k + 2] = __byte_perm(u.y, u.w, 0x5410);
        xb[4 * k + 3] = __byte_perm(u.y, u.w, 0x7632);
    }
}

#if ROUTER
#define NEG_INF __int_as_float(0xff800000)

__device__ __forceinline__ float rt_dot2(u32 w, u32 xq, float acc) {
    acc = fmaf(__uint_as_float(w << 16), __uint_as_float(xq << 16), acc);
    return fmaf(__uint_as_float(w & 0xFFFF0000u), __uint_as_float(xq & 0xFFFF0000u), acc);
}

// A float as an unsigned key of the same order (-0 made +0 first, so equal values have equal keys);
// 0 is below every key of a number, and stands for an expert out of the running.
__device__ __forceinline__ u32 rt_key(float f) {
    const u32 u = __float_as_uint(f + 0.0f);
    return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

__device__ __forceinline__ unsigned long long rt_ld_relaxed(const unsigned long long *p) {
    unsigned long long v;
    asm volatile("ld.relaxed.gpu.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
    return v;
}

#if WARP_SEL
#define WS_COLS (E / 32)                                  // experts a lane holds: lane l, column j: expert l + 32 j
#define WS_GCOLS (KEEP < GROUPS ? GSIZE / 32 : 1)         // columns of a group (groups are whole columns)
#define WS_CANDS (KEEP < GROUPS ? KEEP * WS_GCOLS : WS_COLS)  // columns left after the groups' cut

// rt_key's inverse (a key of -0 comes back +0)
__device__ __forceinline__ float rt_key_value(u32 k) {
    return __uint_as_float((k & 0x80000000u) ? (k & 0x7FFFFFFFu) : ~k);
}

// The largest of N values, as a tree of pairs (N - 1 steps, log2 N deep)
template <int N>
__device__ __forceinline__ u32 ws_max(const u32 (&v)[N]) {
    u32 t[N];
#pragma unroll
    for (int i = 0; i < N; ++i) t[i] = v[i];
#pragma unroll
    for (int s = 1; s < N; s <<= 1) {
#pragma unroll
        for (int i = 0; i + s < N; i += 2 * s) t[i] = max(t[i], t[i + s]);
    }
    return t[0];
}

// WARP_SELECT: one warp's grouped top-k over the keys and scores in shared memory; lane r < TOPK gets the r-th expert
// (the largest key first, ties: the lower index) and its weight (renormalised if RENORM, before the routed scaling),
// summed in rank order as the selection warps' path sums them.
__device__ __forceinline__ int warp_select(const u32 *skey, const float *sscore, int lane, float &weight) {
    u32 c[WS_CANDS];  // the candidates' keys (0: taken)
    u32 col[WS_CANDS];  // their columns (warp-uniform)
#if KEEP < GROUPS
    u32 k[WS_COLS];
#pragma unroll
    for (int j = 0; j < WS_COLS; ++j) k[j] = skey[32 * j + lane];
    // each group's two largest keys: the largest by one warp reduction, the second by another, where the lowest lane
    // holding the largest offers its own second
    float gs[GROUPS];
#pragma unroll
    for (int g = 0; g < GROUPS; ++g) {
        u32 l1 = k[g * WS_GCOLS], l2 = 0u;
#pragma unroll
        for (int w = 1; w < WS_GCOLS; ++w) {
            const u32 v = k[g * WS_GCOLS + w], hi = max(l1, v), lo = max(min(l1, v), l2);
            l1 = hi;
            l2 = lo;
        }
        const u32 m1 = __reduce_max_sync(0xFFFFFFFFu, l1);
        const u32 holders = __ballot_sync(0xFFFFFFFFu, l1 == m1);
        const u32 m2 = __reduce_max_sync(0xFFFFFFFFu, lane == __ffs(holders) - 1 ? l2 : l1);
        gs[g] = rt_key_value(m1) + rt_key_value(m2);
    }
    // lane g < GROUPS ranks group g (ties: the lower group first); every lane holds every group's sum
    float mine = gs[0];
#pragma unroll
    for (int g = 1; g < GROUPS; ++g) mine = lane == g ? gs[g] : mine;
    int rank = 0;
#pragma unroll
    for (int g = 0; g < GROUPS; ++g) rank += (gs[g] > mine || (gs[g] == mine && g < lane)) ? 1 : 0;
    u32 left = __ballot_sync(0xFFFFFFFFu, lane < GROUPS && rank < KEEP);
    // the kept groups' columns, in group order
#pragma unroll
    for (int i = 0; i < KEEP; ++i) {
        const int g = __ffs(left) - 1;
        left &= left - 1u;
#pragma unroll
        for (int w = 0; w < WS_GCOLS; ++w) {
            u32 v = k[w];
#pragma unroll
            for (int h = 1; h < GROUPS; ++h) v = g == h ? k[h * WS_GCOLS + w] : v;
            c[i * WS_GCOLS + w] = v;
            col[i * WS_GCOLS + w] = (u32)(g * WS_GCOLS + w);
        }
    }
#else
#pragma unroll
    for (int j = 0; j < WS_COLS; ++j) {
        c[j] = skey[32 * j + lane];
        col[j] = (u32)j;
    }
#endif
    // TOPK rounds: the largest key left, then the lowest index holding it, which leaves the running
    int my_id = 0;
#pragma unroll
    for (int r = 0; r < TOPK; ++r) {
        const u32 top = __reduce_max_sync(0xFFFFFFFFu, ws_max(c));
        u32 idx[WS_CANDS];
#pragma unroll
        for (int i = 0; i < WS_CANDS; ++i) idx[i] = c[i] == top ? 32u * col[i] + (u32)lane : 0xFFFFFFFFu;
        u32 low = idx[0];
#pragma unroll
        for (int i = 1; i < WS_CANDS; ++i) low = min(low, idx[i]);
        const u32 id = __reduce_min_sync(0xFFFFFFFFu, low);
#pragma unroll
        for (int i = 0; i < WS_CANDS; ++i) c[i] = idx[i] == id ? 0u : c[i];
        my_id = lane == r ? (int)id : my_id;
    }
    const float sc = lane < TOPK ? sscore[my_id] : 0.f;
    float wsum = 0.f;
#pragma unroll
    for (int r = 0; r < TOPK; ++r) wsum += __shfl_sync(0xFFFFFFFFu, sc, r);
    weight = sc;
#if RENORM
    weight = weight / (wsum + 1e-20f);
#endif
    return my_id;
}
#endif

// Lane r < TOPK of the warp that chose: the r-th expert (into sm.experts unless the ranking wrote it there, EXPERTS
// false) and its scaled weight in shared memory, and block 0's also into ids_out / wts_out
template <bool EXPERTS>
__device__ __forceinline__ void store_choice(Smem &sm, int lane, int id, float w, float scaling, int *ids_out,
                                             float *wts_out) {
    if (lane < TOPK) {
        if (EXPERTS) sm.experts[lane] = id;
        sm.wts[lane] = w * scaling;
        if (blockIdx.x == 0) {
            ids_out[lane] = id;
            wts_out[lane] = w * scaling;
        }
    }
}
#endif


#if SHARED
// NW words of e4m3 codes (4 each, low byte first) times 4 * NW fp32 values, summed in fp32
template <int NW>
__device__ __forceinline__ float e4m3_dot(const u32 *ws, const float *x) {
    float d = 0.f;
#pragma unroll
    for (int q = 0; q < NW; ++q) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const u32 pr = e4m3x2_to_f16x2(ws[q] >> (16 * h));
            float lo, hi;
            asm("{\n\t.reg .b16 l, h;\n\tmov.b32 {l, h}, %2;\n\tcvt.f32.f16 %0, l;\n\tcvt.f32.f16 %1, h;\n\t}"
                : "=f"(lo), "=f"(hi)
                : "r"(pr));
            d = fmaf(lo, x[4 * q + 2 * h], d);
            d = fmaf(hi, x[4 * q + 2 * h + 1], d);
        }
    }
    return d;
}

// One step of a warp's transposed sum of 16 values: lanes with bit O set keep values O/2..O-1 (summed
// with their partner's), the others 0..O/2-1, moved to the front.
template <int O>
__device__ __forceinline__ void keep_half(float *acc, int lane) {
    const bool upper = lane & O;
#pragma unroll
    for (int i = 0; i < O / 2; ++i) {
        const float send = upper ? acc[i] : acc[i + O / 2], keep = upper ? acc[i + O / 2] : acc[i];
        acc[i] = keep + __shfl_xor_sync(0xFFFFFFFFu, send, O);
    }
}

// The shared expert, by the down warps (dw: 0..DN_WARPS-1); see SHARED at the top. Returns the shared
// down sum of output row dw * SH_RPW + lane of the block's down rows (lanes < SH_RPW).
__device__ __forceinline__ float shared_expert(const uint4 *xs, float *scratch, const unsigned char *sh, bool weights,
                                               u32 sh_bar, u32 free_bar, int dw, int lane, int n_dn, int first_row,
                                               const float *__restrict__ gu_s, const float *__restrict__ dn_s,
                                               u32 *sh_act, float limit, u32 launch) {
    const u32 tag = launch << 16;
    const int dtid = dw * 32 + lane;
    asm volatile("bar.sync %0, %1;" ::"r"(BAR_NORMED), "r"((GU_WARPS + DN_WARPS) * 32) : "memory");
    if (weights) bar_wait(sh_bar);
    if (blockIdx.x < SH_TASKS) {
        // ---- gate_up: lane chunk c (16 columns) of the 16 rows, block scales per chunk
        float acc[16];
#pragma unroll
        for (int r = 0; r < 16; ++r) acc[r] = 0.f;
        for (int c = dtid; c < H / 16; c += DN_WARPS * 32) {
            float xf[16];
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const uint4 v = xs[2 * c + h];
                const u32 vw[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
                for (int q = 0; q < 4; ++q) {
                    xf[8 * h + 2 * q] = bf16_to_float(vw[q] & 0xFFFFu);
                    xf[8 * h + 2 * q + 1] = bf16_to_float(vw[q] >> 16);
                }
            }
            const float sg = __ldg(gu_s + (blockIdx.x * 8 / 128) * (H / 128) + c / 8);
            const float su = __ldg(gu_s + ((SHI + blockIdx.x * 8) / 128) * (H / 128) + c / 8);
#pragma unroll
            for (int r = 0; r < 16; ++r) {
                const uint4 w = *reinterpret_cast<const uint4 *>(sh + r * H + 16 * c);
                const u32 ws[4] = {w.x, w.y, w.z, w.w};
                acc[r] = fmaf(e4m3_dot<4>(ws, xf), r < 8 ? sg : su, acc[r]);
            }
        }
        // the warp's 16 sums: each step keeps half the rows (lane bit o), so lane l ends with row l >> 1
        keep_half<16>(acc, lane);
        keep_half<8>(acc, lane);
        keep_half<4>(acc, lane);
        keep_half<2>(acc, lane);
        acc[0] += __shfl_xor_sync(0xFFFFFFFFu, acc[0], 1);
        if (!(lane & 1)) scratch[dw * 16 + (lane >> 1)] = acc[0];
        asm volatile("bar.sync %0, %1;" ::"r"(BAR_SH), "r"(DN_WARPS * 32) : "memory");
        if (dw == 0) {
            u32 word = 0u;
            if (lane < 8) {
                float gate = 0.f, up = 0.f;
#pragma unroll
                for (int w = 0; w < DN_WARPS; ++w) gate += scratch[w * 16 + lane], up += scratch[w * 16 + 8 + lane];
                float a = gate / (1.f + __expf(-gate));
#if SH_HAS_LIMIT
                a = fminf(a, limit);
                up = fminf(fmaxf(up, -limit), limit);
#endif
                word = tag | (__float_as_uint(round_bf16(a * up)) >> 16);
            }
            word = __shfl_sync(0xFFFFFFFFu, word, lane & 7);
            for (int k = lane >> 3; k < SH_COPIES; k += 4)
                asm volatile("st.relaxed.gpu.global.u32 [%0], %1;" ::"l"(sh_act + k * SHI + blockIdx.x * 8 + (lane & 7)),
                             "r"(word)
                             : "memory");
        }
    }
    float mine = 0.f;
    if (n_dn) {
        // ---- every shared activation (8-column pieces lane + 32 j), polled until all are this launch's
        const u32 *copy = sh_act + (blockIdx.x % SH_COPIES) * SHI;
        uint4 a[SH_PIECES][2];
#pragma unroll
        for (int j = 0; j < SH_PIECES; ++j)
#pragma unroll
            for (int h = 0; h < 2; ++h) a[j][h] = ld_cg4(copy + 8 * (lane + 32 * j) + 4 * h);
        for (;;) {
            bool ok = true;
#pragma unroll
            for (int j = 0; j < SH_PIECES; ++j) ok = ok && piece_current(a[j][0], launch) && piece_current(a[j][1], launch);
            if (bar_all(ok, BAR_SH, DN_WARPS * 32)) break;
            __nanosleep(POLL_NS);
#pragma unroll
            for (int j = 0; j < SH_PIECES; ++j)
#pragma unroll
                for (int h = 0; h < 2; ++h)
                    if (!piece_current(a[j][h], launch)) a[j][h] = ld_cg4(copy + 8 * (lane + 32 * j) + 4 * h);
        }
        // ---- down: this warp's rows, lane pieces; the row's block scale per 128 columns
        const unsigned char *rows = sh + 16 * H;
#pragma unroll
        for (int i = 0; i < SH_RPW; ++i) {
            const int r = dw * SH_RPW + i;
            if (r >= 8 * n_dn) break;
            float d = 0.f;
#pragma unroll
            for (int j = 0; j < SH_PIECES; ++j) {
                const int piece = lane + 32 * j;
                const uint2 w = *reinterpret_cast<const uint2 *>(rows + r * SHI + 8 * piece);
                const u32 aw[8] = {a[j][0].x, a[j][0].y, a[j][0].z, a[j][0].w, a[j][1].x, a[j][1].y, a[j][1].z, a[j][1].w};
                float xf[8];
#pragma unroll
                for (int q = 0; q < 8; ++q) xf[q] = bf16_to_float(aw[q] & 0xFFFFu);
                const float s = __ldg(dn_s + ((first_row + r) / 128) * (SHI / 128) + piece / 16);
                const u32 ws[2] = {w.x, w.y};
                d = fmaf(e4m3_dot<2>(ws, xf), s, d);
            }
            d = warp_sum(d);
            if (lane == i) mine = d;
        }
    }
    __syncwarp();
    if (lane == 0) asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(free_bar) : "memory");
    return mine;
}
#endif

extern "C" __global__ void __launch_bounds__(NWARPS * 32, 1)
moe_decode(const unsigned short *__restrict__ x,    // [H] bf16
           const expert_id_t *__restrict__ ids,             // [TOPK]
           const float *__restrict__ wts,            // [TOPK]
           const u32 *__restrict__ gu_words,         // [E, 2I, H/8]
           const unsigned char *__restrict__ gu_scale,  // [E, 2I, H/32]
           const u32 *__restrict__ dn_words,         // [E, H, I/8]
           const unsigned char *__restrict__ dn_scale,  // [E, H, I/32]
           unsigned short *__restrict__ out,         // [H] bf16
           u32 *act,                                 // [ACT_COPIES, TOPK, I] tagged fp16 (tag << 16 | bits)
           u32 *launches,                            // launch counter, wraps at NBLOCKS * 65536
           const int *__restrict__ schedule,         // [NBLOCKS, ROW_WORDS]
           float limit,
           u64 *trace,                               // [2, NBLOCKS, TRACE_SLOTS] globaltimer stamps (TRACE only)
           // ROUTER only (x is then the residual stream, ids and wts unused):
           const unsigned short *__restrict__ norm_w,   // [H] post-attention norm weight, bf16
           const unsigned short *__restrict__ router_w, // [E, H] router weight, bf16
           const float *__restrict__ bias,           // [E] expert bias (selection only)
           u64 *scores,                              // [SCORE_COPIES, E] exchange: launch tag << 32 | fp32 score
           unsigned short *__restrict__ xn_out,      // [H] normalised x for the shared expert (block 0)
           int *__restrict__ ids_out,                // [TOPK] the selection (block 0)
           float *__restrict__ wts_out,              // [TOPK]
           int *__restrict__ count,                  // launch counter (the start-up check); SHARED: 2 of them
           float eps, float scaling,
           // SHARED only (out is then x + shared + routed; it may be x itself):
           const unsigned char *__restrict__ sh_gu_w,  // [2 SHI, H] e4m3: gate rows, then up rows
           const float *__restrict__ sh_gu_s,        // [2 SHI / 128, H / 128] block scales
           const unsigned char *__restrict__ sh_dn_w,  // [H, SHI] e4m3
           const float *__restrict__ sh_dn_s,        // [H / 128, SHI / 128]
           u32 *sh_act,                              // [SH_COPIES, SHI] tagged bf16 (tag << 16 | bits)
           float sh_limit,
           // L2_NEXT only: the regions to ask the L2 for, [L2_NEXT][2] (address, bytes)
           const u64 *__restrict__ l2_next)
{
    extern __shared__ __align__(128) unsigned char smem_raw[];
    Smem &sm = *reinterpret_cast<Smem *>(smem_raw);
    unsigned char *tiles = smem_raw + TILES_OFFSET;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int g = lane >> 2, t = lane & 3;
    const int *row = schedule + blockIdx.x * ROW_WORDS;
    const int n_gu = row[0], n_dn = row[1];
    const int *gu_tile = row + 2;                  // slot << 16 | first row
    const int *dn_tile = gu_tile + MAX_GU;          // first output row (consecutive tiles)
    const int *order = dn_tile + MAX_DN;            // copy groups in issue order
    const u32 dn_base = n_gu * GU_TILE_BYTES;
    const u32 dn_rows = 8 * n_dn, dn_slot = n_dn * DN_SLOT_BYTES;  // one slot's words, then its scales
#if X_IN_TILES
    uint4 *const xs = reinterpret_cast<uint4 *>(tiles + dn_base);  // x, until the first down copy
#else
    uint4 *const xs = sm.x;
#endif
#if TRACE
    u64 t0 = 0, c0 = 0;
    if (threadIdx.x == 0) t0 = globaltimer(), c0 = clock64();
#endif

    if (threadIdx.x == 0) {
        for (int b = 0; b < NUM_BARS; ++b)
            asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smem_addr(&sm.bars[b])),
                         "r"(SHARED && b == NUM_BARS - 1 ? DN_WARPS
                             : X_IN_TILES && b == X_FREE ? GU_WARPS
                                                         : 1));  // (SH_FREE: one arrival per down warp)
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    }
    __syncthreads();
#if ROUTER
    // the block's router rows (piece k of gate_up lane: warp chunk k * GU_WARPS + warp) and the norm
    // weight: independent of the previous kernel, so loaded while it runs
    const int e0 = blockIdx.x * EPB;
    uint4 rrow[RCH];
    uint4 rnw = make_uint4(0u, 0u, 0u, 0u);
    if (warp < GU_WARPS) {
#pragma unroll
        for (int k = 0; k < RCH; ++k) {
            const int sidx = k * GU_WARPS + warp, e = sidx / WCH, c = sidx % WCH;
            rrow[k] = sidx < EPB * WCH && e0 + e < E
                          ? ld_stream(router_w + (size_t)(e0 + e) * H + c * 256 + lane * 8)
                          : make_uint4(0u, 0u, 0u, 0u);
        }
        if (threadIdx.x < H / 8) rnw = ld_stream(norm_w + threadIdx.x * 8);
    }
#if BIAS_EARLY
    // the selection lane's expert bias, also independent of the previous kernel (read after the score's
    // poll loop, whose relaxed loads keep it there, it is one more L2 round trip on the routing's path)
    const float my_bias = warp < SEL_WARPS ? __ldg(bias + warp * 32 + lane) : 0.0f;
#endif
#endif
#if SHARED
    // the shared expert's weights into the tail of the tile area (SH_OFFSET): gate_up rows, then down rows
    unsigned char *sh_tail = tiles + SH_OFFSET;
    const u32 sh_bytes = (blockIdx.x < SH_TASKS ? 16 * H : 0) + 8 * n_dn * SHI;
    if (warp == PRODUCER && lane == 0 && sh_bytes) {
        u64 policy = 0;
#if EVICT_FIRST
        asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(policy));
#endif
        const u32 bar = smem_addr(&sm.bars[SH_BAR]);
        asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar), "r"(sh_bytes) : "memory");
        if (blockIdx.x < SH_TASKS) {
            bulk_copy(smem_addr(sh_tail), sh_gu_w + (size_t)blockIdx.x * 8 * H, 8 * H, bar, policy);
            bulk_copy(smem_addr(sh_tail + 8 * H), sh_gu_w + (size_t)(SHI + blockIdx.x * 8) * H, 8 * H, bar, policy);
        }
        if (n_dn) bulk_copy(smem_addr(sh_tail + 16 * H), sh_dn_w + (size_t)dn_tile[0] * SHI, 8 * n_dn * SHI, bar, policy);
    }
#endif
#if L2_NEXT
    if (threadIdx.x == L2_ASKER)
        for (int i = 0; i < 2 * L2_NEXT; ++i) sm.l2_table[i] = __ldg(l2_next + i);
#if L2_NEXT_AT == 6
    if (warp >= GU_WARPS && warp < PRODUCER) {
        asm volatile("bar.sync %0, %1;" ::"r"(BAR_L2_TABLE), "r"(DN_WARPS * 32) : "memory");
        l2_next_lines(sm.l2_table, threadIdx.x - GU_WARPS * 32);
    }
#endif
#endif
    // Everything above is independent of the previous kernel; the routing, x and the
    // activation buffer are not.
    asm volatile("griddepcontrol.wait;" ::: "memory");
    // the next kernel may launch only now: it may read what the previous kernel wrote before its own wait
    // (gemv_decode.cu LATE_WAIT); this kernel fills the SMs, so it could not be resident earlier anyway
    asm volatile("griddepcontrol.launch_dependents;");
#if ROUTER
    if (blockIdx.x == 0 && threadIdx.x == 0) {
        atomicAdd(count, 1);
        if (SHARED) atomicAdd(count + 1, 1);  // (the start-up check: the shared expert ran here)
    }
#endif
#if TRACE
    u64 *trow = trace + ((__shfl_sync(0xFFFFFFFFu, lane == 0 ? __ldcg(launches) : 0u, 0) / NBLOCKS & 1) * NBLOCKS +
                         blockIdx.x) * TRACE_SLOTS;
    if (threadIdx.x == 0) trow[T_WAITED] = globaltimer();
#endif

    if (warp == PRODUCER) {
#if L2_NEXT && L2_NEXT_AT == 4
        if (lane == 0) l2_next_prefetch(sm.l2_table);
#endif
#if ROUTER
#if WARP_SEL
        // every expert's key and score, then this warp's choice
        asm volatile("bar.sync %0, %1;" ::"r"(BAR_SELECT), "r"((SEL_WARPS + 1) * 32) : "memory");
#if TRACE
        if (lane == 0) trow[T_SEEN] = globaltimer();
#endif
        {
            float my_w;
            const int my_id = warp_select(sm.rt.skey, sm.rt.sscore, lane, my_w);
            store_choice<true>(sm, lane, my_id, my_w, scaling, ids_out, wts_out);
            __syncwarp();
#if TRACE
            if (lane == 0) trow[T_SELECTED] = globaltimer();
#endif
            asm volatile("bar.arrive %0, %1;" ::"r"(BAR_ROUTED), "r"(ROUTED_THREADS) : "memory");  // the publisher
        }
#elif EARLY_IDS
        asm volatile("bar.sync %0, %1;" ::"r"(BAR_IDS), "r"((SEL_WARPS + 1) * 32) : "memory");  // its experts
#else
        asm volatile("bar.sync %0, %1;" ::"r"(BAR_ROUTED), "r"(96) : "memory");  // the block's own selection
#endif
#else
        if (lane < TOPK) sm.experts[lane] = __ldcg(ids + lane);
        __syncwarp();
#endif
#if TRACE
        if (lane == 0) trow[T_IDS] = globaltimer();
#endif
        const expert_id_t *e = sm.experts;
        if (lane == 0) {
            u64 policy = 0;
#if EVICT_FIRST
            asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(policy));
#endif
            const int groups = n_gu + (n_dn ? PAIRS : 0);
            for (int q = 0; q < groups; ++q) {
#if SHARED
                if (q == row[ROW_WORDS - 1]) bar_wait(smem_addr(&sm.bars[SH_FREE]));  // it lands in the shared tail
#endif
                const int code = order[q];
#if GU_WINDOW && WINDOW_DOWNS
                if (q >= GU_WINDOW) bar_wait(smem_addr(&sm.bars[order[q - GU_WINDOW]]));  // (group code = barrier)
#elif GU_WINDOW
                if (code < MAX_GU && code >= GU_WINDOW) bar_wait(smem_addr(&sm.bars[code - GU_WINDOW]));
#endif
#if X_IN_TILES
                if (code == MAX_GU) bar_wait(smem_addr(&sm.bars[X_FREE]));  // slot pair 0's copy lands on x
#endif
#if DOWN_AFTER
                if (code == MAX_GU) {  // the first down group (slot pair 0): wait for the earlier gate_up tiles
                    for (int q2 = 0, seen = 0; q2 < q && seen < DOWN_AFTER; ++q2)
                        if (order[q2] < MAX_GU) {
                            bar_wait(smem_addr(&sm.bars[order[q2]]));
                            ++seen;
                        }
                }
#endif
                if (code < MAX_GU) {
                    const int i = code, slot = gu_tile[i] >> 16, r0 = gu_tile[i] & 0xFFFF;
                    const u32 bar = smem_addr(&sm.bars[i]);
                    const u32 dst = smem_addr(tiles + i * GU_TILE_BYTES);
                    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar),
                                 "r"(PROBE == 2 ? 2 * GU_WORD_BYTES : GU_TILE_BYTES)
                                 : "memory");
                    const u32 *src = gu_words + ((size_t)e[slot] * 2 * I + r0) * (H / 8);
                    bulk_copy(dst, src, GU_WORD_BYTES, bar, policy);
                    bulk_copy(dst + GU_WORD_BYTES, src + (size_t)I * (H / 8), GU_WORD_BYTES, bar, policy);
#if PROBE != 2
                    const unsigned char *ssrc = gu_scale + ((size_t)e[slot] * 2 * I + r0) * (H / 32);
                    bulk_copy(dst + 2 * GU_WORD_BYTES, ssrc, H / 4, bar, policy);
                    bulk_copy(dst + 2 * GU_WORD_BYTES + H / 4, ssrc + (size_t)I * (H / 32), H / 4, bar, policy);
#endif
                } else {
                    const int p = code - MAX_GU;  // slot pair p's down rows, all of the block's tiles
                    const u32 bar = smem_addr(&sm.bars[MAX_GU + p]);
                    const u32 dn_bytes = PROBE == 2 ? 2 * dn_rows * (I / 2) : 2 * dn_slot;
                    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar), "r"(dn_bytes)
                                 : "memory");
#pragma unroll
                    for (int h = 0; h < 2; ++h) {
                        const int slot = 2 * p + h;
                        const u32 dst = smem_addr(tiles + dn_base + slot * dn_slot);
                        const size_t first = (size_t)e[slot] * H + dn_tile[0];
                        bulk_copy(dst, dn_words + first * (I / 8), dn_rows * (I / 2), bar, policy);
#if PROBE != 2
                        bulk_copy(dst + dn_rows * (I / 2), dn_scale + first * (I / 32), dn_rows * (I / 32), bar, policy);
#endif
                    }
                }
            }
#if SHARED
            if (row[ROW_WORDS - 1] >= groups) bar_wait(smem_addr(&sm.bars[SH_FREE]));  // (the barrier's phase completes)
#endif
#if TRACE
            trow[T_ISSUED] = globaltimer();
#endif
#if L2_NEXT && L2_NEXT_AT == 1
            for (int q = 0; q < groups; ++q) bar_wait(smem_addr(&sm.bars[order[q]]));  // (group code = barrier)
            l2_next_prefetch(sm.l2_table);
#endif
        }
#if TRACE
    } else if (warp == OBSERVER) {
        if (lane == 0) {
            const int groups = n_gu + (n_dn ? PAIRS : 0);
            for (int q = 0; q < groups; ++q) {
                bar_wait(smem_addr(&sm.bars[order[q]]));  // (group code = barrier index)
                trow[T_GROUP0 + q] = globaltimer();
            }
        }
#endif
#if PROBE == 1
    } else {  // copies only: wait for every group, compute nothing
        if (warp == 0 && lane == 0) {
            for (int i = 0; i < n_gu; ++i) bar_wait(smem_addr(&sm.bars[i]));
            for (int p = 0; p < PAIRS; ++p)
                if (n_dn) bar_wait(smem_addr(&sm.bars[MAX_GU + p]));
#if TRACE
            trow[T_DOWN_DONE] = globaltimer();
#endif
        }
    }
#else
    } else if (warp == PUBLISHER) {
        // the block's inputs, once: x and the launch number (read before any block bumps it twice)
        const u32 launch = __shfl_sync(0xFFFFFFFFu, lane == 0 ? __ldcg(launches) / NBLOCKS : 0u, 0);
#if ROUTER
        if (lane == 0) sm.launch = launch;  // (the gate_up warps normalise x)
        asm volatile("bar.arrive %0, %1;" ::"r"(BAR_INPUTS), "r"(INPUT_THREADS) : "memory");
        asm volatile("bar.sync %0, %1;" ::"r"(BAR_ROUTED), "r"(ROUTED_THREADS) : "memory");
        const float my_wt = lane < TOPK ? sm.wts[lane] : 0.f;
#else
        const float my_wt = lane < TOPK ? __ldcg(wts + lane) : 0.f;  // no global load inside the tile loop
        for (int k = lane; k < H / 8; k += 32) xs[k] = __ldcg(reinterpret_cast<const uint4 *>(x) + k);
        if (lane == 0) sm.launch = launch;
        asm volatile("bar.arrive %0, %1;" ::"r"(BAR_INPUTS), "r"(INPUT_THREADS) : "memory");
#endif
        const u32 tag = launch << 16;
        for (int i = 0; i < n_gu; ++i) {
            asm volatile("bar.sync %0, %1;" ::"r"(BAR_FULL0 + i), "r"((GU_WARPS + 1) * 32) : "memory");
            float v = 0.f;
            if (lane < 16) {
#pragma unroll
                for (int w = 0; w < GU_WARPS; ++w) v += sm.gu_part[i][w][lane];
            }
            const float up = __shfl_down_sync(0xFFFFFFFFu, v, 8);
            const int slot = gu_tile[i] >> 16, r0 = gu_tile[i] & 0xFFFF;
            u32 word = 0;
            if (lane < 8) {
                float gate = v, u = up;
                float a = gate / (1.f + __expf(-gate));
#if HAS_LIMIT
                a = fminf(a, limit);
                u = fminf(fmaxf(u, -limit), limit);
#endif
                const float y = a * u * __shfl_sync(0xFFu, my_wt, slot);
                word = tag | (f16_pair(y, 0.f) & 0xFFFFu);
            }
            // ACT_COPIES copies, so the blocks' reads of a freshly completed slot pair spread over more L2 slices
            word = __shfl_sync(0xFFFFFFFFu, word, lane & 7);
            for (int k = lane >> 3; k < ACT_COPIES; k += 4)
                asm volatile("st.relaxed.gpu.global.u32 [%0], %1;" ::"l"(act + (k * TOPK + slot) * I + r0 + (lane & 7)),
                             "r"(word)
                             : "memory");
        }
#if TRACE
        if (lane == 0) trow[T_PUBLISHED] = globaltimer();
#endif
    } else {  // compute warps
#if ROUTER
        // X_EARLY: x before the inputs' barrier, so its load and the publisher's read of the launch number fly
        // together (else after it: two L2 round trips in a row)
        uint4 xv = make_uint4(0u, 0u, 0u, 0u);
        if (X_EARLY && threadIdx.x < H / 8) xv = ld_cg4(reinterpret_cast<const u32 *>(x) + 4 * threadIdx.x);
#endif
        asm volatile("bar.sync %0, %1;" ::"r"(BAR_INPUTS), "r"(INPUT_THREADS) : "memory");
#if L2_NEXT && L2_NEXT_AT == 5
        if (warp >= GU_WARPS) l2_next_lines(sm.l2_table, threadIdx.x - GU_WARPS * 32);  // (the table: before the barrier)
#endif
#if ROUTER
        if (!X_EARLY && threadIdx.x < H / 8) xv = ld_cg4(reinterpret_cast<const u32 *>(x) + 4 * threadIdx.x);
        if (warp < GU_WARPS) {
            // ---- RMSNorm of x: one 8-element piece per thread, sums of squares over the warps in order
            const int tid = threadIdx.x;
            const u32 xw[4] = {xv.x, xv.y, xv.z, xv.w}, nw4[4] = {rnw.x, rnw.y, rnw.z, rnw.w};
            float ss = 0.f;
#pragma unroll
            for (int q = 0; q < 4; ++q) {
                const float lo = __uint_as_float(xw[q] << 16), hi = __uint_as_float(xw[q] & 0xFFFF0000u);
                ss = fmaf(lo, lo, ss);
                ss = fmaf(hi, hi, ss);
            }
            ss = warp_sum(ss);
            if (lane == 0) sm.rt.red[warp] = ss;
            asm volatile("bar.sync %0, %1;" ::"r"(BAR_ROUTER), "r"(GU_WARPS * 32) : "memory");
            float total = 0.f;
#pragma unroll
            for (int w = 0; w < GU_WARPS; ++w) total += sm.rt.red[w];
            const float rstd = __frcp_rn(__fsqrt_rn(__fdiv_rn(total, (float)H) + eps));
            if (tid < H / 8) {
                u32 o[4];
#pragma unroll
                for (int q = 0; q < 4; ++q)
                    o[q] = bf16_pair(rms_value(xw[q] & 0xFFFFu, rstd, nw4[q] & 0xFFFFu),
                                     rms_value(xw[q] >> 16, rstd, nw4[q] >> 16));
                const uint4 packed = make_uint4(o[0], o[1], o[2], o[3]);
                xs[tid] = packed;
                if (blockIdx.x == 0) reinterpret_cast<uint4 *>(xn_out)[tid] = packed;
            }
            asm volatile("bar.sync %0, %1;" ::"r"(BAR_ROUTER), "r"(GU_WARPS * 32) : "memory");
#if SHARED
            asm volatile("bar.arrive %0, %1;" ::"r"(BAR_NORMED), "r"((GU_WARPS + DN_WARPS) * 32) : "memory");
#endif
#if TRACE
            if (threadIdx.x == 0) {
                trow[T_NORMED] = globaltimer();
                trow[T_SCORES_FIRST] = ~0ull;  // (the selection warps' atomics follow the next barrier)
                trow[T_SCORES_LAST] = 0ull;
                trow[N_SCORE_POLLS] = 0ull;
            }
#endif
            // ---- this block's router scores: warp chunk partials, then per expert in chunk order
#pragma unroll
            for (int k = 0; k < RCH; ++k) {
                const int sidx = k * GU_WARPS + warp;
                if (sidx < EPB * WCH) {
                    const uint4 xq = xs[(sidx % WCH) * 32 + lane];
                    float acc = 0.f;
                    acc = rt_dot2(rrow[k].x, xq.x, acc);
                    acc = rt_dot2(rrow[k].y, xq.y, acc);
                    acc = rt_dot2(rrow[k].z, xq.z, acc);
                    acc = rt_dot2(rrow[k].w, xq.w, acc);
                    acc = warp_sum(acc);
                    if (lane == 0) sm.rt.part[sidx] = acc;
                }
            }
            asm volatile("bar.sync %0, %1;" ::"r"(BAR_ROUTER), "r"(GU_WARPS * 32) : "memory");
            const u32 rtag = sm.launch;
            if (warp == 0 && lane < EPB && e0 + lane < E) {
                float dot = 0.f;
#pragma unroll
                for (int c = 0; c < WCH; ++c) dot += sm.rt.part[lane * WCH + c];
                const float sc = 1.0f / (1.0f + __expf(-dot));
                const u64 word = (u64)rtag << 32 | __float_as_uint(sc);
#pragma unroll
                for (int c = 0; c < SCORE_COPIES; ++c)  // copies: the blocks' polls spread over more L2 slices
                    asm volatile("st.relaxed.gpu.global.u64 [%0], %1;" ::"l"(scores + c * E + e0 + lane), "l"(word)
                                 : "memory");
            }
#if TRACE
            if (threadIdx.x == 0) trow[T_SCORED] = globaltimer();
#endif
            // ---- selection, in every block: one expert per lane of the first E / 32 warps
#if SELECT_TWICE
#pragma unroll 1  // one copy of the code, run twice: the second run finds its instructions cached
            for (int pass = 0; pass < 2; ++pass) {
                if (pass == 1 && warp < SEL_WARPS) {
                    asm volatile("bar.sync %0, %1;" ::"r"(BAR_SELECT), "r"(SEL_WARPS * 32) : "memory");
                    if (threadIdx.x == 0) trow[T_SELECT2] = globaltimer();
                }
#endif
            if (warp < SEL_WARPS) {
                const int me = warp * 32 + lane;
                const u64 *mine = scores + (blockIdx.x % SCORE_COPIES) * E + me;
#if TRACE
                int polls = 1;
#define SCORE_POLLED() ++polls
#else
#define SCORE_POLLED()
#endif
#if SCORE_STAGGER
                // a ring of four loads in flight, SCORE_STAGGER ns apart; each is checked (waited for) in turn and
                // issued again while the others fly
                u64 q[4];
#pragma unroll
                for (int j = 0; j < 4; ++j) {
                    if (j) __nanosleep(SCORE_STAGGER);
                    q[j] = rt_ld_relaxed(mine);
                }
                u64 v = 0;
                for (bool seen = false; !seen;) {
#pragma unroll
                    for (int j = 0; j < 4; ++j) {
                        if (!seen) {
                            if ((u32)(q[j] >> 32) == rtag) {
                                v = q[j];
                                seen = true;
                            } else {
                                __nanosleep(SCORE_STAGGER);
                                q[j] = rt_ld_relaxed(mine);
                                SCORE_POLLED();
                            }
                        }
                    }
                }
#else
                u64 v = rt_ld_relaxed(mine);
                while ((u32)(v >> 32) != rtag) {
                    if (SCORE_POLL_NS) __nanosleep(SCORE_POLL_NS);
                    v = rt_ld_relaxed(mine);
                    SCORE_POLLED();
                }
#endif
#undef SCORE_POLLED
                SEL_CLOCK(0);  // (warp 0's scores in)
#if TRACE
                {
                    u64 seen_at = globaltimer_after((u32)v);
#pragma unroll
                    for (int o = 16; o; o >>= 1) {
                        const u64 other = __shfl_xor_sync(0xFFFFFFFFu, seen_at, o);
                        seen_at = other > seen_at ? other : seen_at;
                    }
                    const int most = __reduce_max_sync(0xFFFFFFFFu, polls + (SCORE_STAGGER ? 3 : 0));
                    if (lane == 0) {
                        atomicMin(&trow[T_SCORES_FIRST], seen_at);
                        atomicMax(&trow[T_SCORES_LAST], seen_at);
                        atomicMax(&trow[N_SCORE_POLLS], (u64)most);
                    }
                }
#endif
                const float sc = __uint_as_float((u32)v);
#if BIAS_EARLY
                const float biased = sc + my_bias;
#else
                const float biased = sc + __ldg(bias + me);
#endif
#if TRACE
                if (threadIdx.x == 0) trow[T_BIASED] = globaltimer_after(__float_as_uint(biased));
#endif
#if WARP_SEL
                // the producer chooses (warp_select): this expert's key and score for it
                sm.rt.skey[me] = rt_key(biased);
                sm.rt.sscore[me] = sc;
                __syncwarp();  // (the lanes left the poll loop, and the traced build's thread 0 its stamp, apart: an
                               // aligned barrier needs the warp converged)
                asm volatile("bar.arrive %0, %1;" ::"r"(BAR_SELECT), "r"((SEL_WARPS + 1) * 32) : "memory");
#else
                u32 key = rt_key(biased);
                u32 kept_groups = 0xFFFFFFFFu;  // bit g: group g is kept (FAST_SEL)
#if KEEP < GROUPS
                {
#define WPG (GSIZE >= 32 ? GSIZE / 32 : 1)
                    store_group_best_two<GSIZE, WPG>(sm.rt.gtop, biased, me, warp);
                    SEL_CLOCK(1);  // groups' two best in this warp
                    asm volatile("bar.sync %0, %1;" ::"r"(BAR_SELECT), "r"(SEL_WARPS * 32) : "memory");
                    SEL_CLOCK(2);
                    rank_groups<GROUPS, KEEP, WPG, FAST_SEL, LEAN_SELECT>(sm.rt.gtop, me / GSIZE, lane, key, kept_groups);
#undef WPG
                }
#endif
                SEL_CLOCK(3);  // groups ranked
#if TRACE
                asm volatile("bar.sync %0, %1;" ::"r"(BAR_SELECT), "r"(SEL_WARPS * 32) : "memory");
                if (threadIdx.x == 0) trow[T_SEEN] = globaltimer();
#endif
                SEL_CLOCK(4);
                // this warp's best TOPK, in order: each lane's rank among the warp's 32 (ties: the lower
                // lane, which is the lower index), and the first TOPK write themselves down. Ranks
                // compare (key, ~index) as one 64-bit value: unique, so no branch for ties.
#if FAST_SEL
#define SEL_WPG (GSIZE / 32)
#define SEL_CANDS (KEEP * SEL_WPG * TOPK)
#define SEL_SUB 4  // threads ranking one candidate
#if SEL_CANDS * SEL_SUB > SEL_WARPS * 32 || KEEP * SEL_WPG > SEL_WARPS
#error "FAST_SELECT: too many candidates for the selecting warps"
#endif
                const int group_of_warp = me / GSIZE;
                // the kept groups' warps, numbered in group order: rows of sm.rt.key
                const int kept_row = __popc(kept_groups & ((1u << group_of_warp) - 1u)) * SEL_WPG + warp % SEL_WPG;
                if ((kept_groups >> group_of_warp) & 1u) {  // (warp-uniform: a group is whole warps)
                    const int wrank = rank_in_warp(key, lane);
                    if (wrank < TOPK) {
                        sm.rt.key[kept_row][wrank] = (u64)key << 32 | (u32)~me;
                        sm.rt.score[kept_row][wrank] = sc;
                    }
                }
                SEL_CLOCK(5);  // this warp's best written
                asm volatile("bar.sync %0, %1;" ::"r"(BAR_SELECT), "r"(SEL_WARPS * 32) : "memory");
                SEL_CLOCK(6);
#if TRACE
                if (threadIdx.x == 0) trow[T_WARP_BEST] = globaltimer();
#endif
                {
                    u64 ck;
                    const int grank = candidate_rank<SEL_CANDS, SEL_SUB, TOPK, 8>(sm.rt.key, me, ck);
                    const int cand = me / SEL_SUB;
                    if (cand < SEL_CANDS && me % SEL_SUB == 0 && grank < TOPK) {
                        sm.rt.sel_idx[grank] = (int)~(u32)ck;
#if EARLY_IDS
                        sm.experts[grank] = (expert_id_t)(int)~(u32)ck;
#endif
                        sm.rt.sel_score[grank] = sm.rt.score[cand / TOPK][cand % TOPK];
                    }
#if TRACE
                    if (threadIdx.x == 0) trow[T_RANKED] = globaltimer_after((u32)grank);
#endif
                }
#undef SEL_WPG
#undef SEL_CANDS
#undef SEL_SUB
#else
                const int wrank = rank_in_warp(key, lane);
                const u64 mykey = (u64)key << 32 | (u32)~me;
                if (wrank < TOPK) {
                    sm.rt.key[warp][wrank] = mykey;
                    sm.rt.score[warp][wrank] = sc;
                }
                asm volatile("bar.sync %0, %1;" ::"r"(BAR_SELECT), "r"(SEL_WARPS * 32) : "memory");
#if TRACE
                if (threadIdx.x == 0) trow[T_WARP_BEST] = globaltimer();
#endif
                // every warp's best are candidates; each one's rank over all of them is its place in the
                // block's top-k
                const int cand = warp * 32 + lane;
                if (cand < SEL_WARPS * TOPK) {
                    const u64 ck = sm.rt.key[cand / TOPK][cand % TOPK];
                    int grank = 0;
#pragma unroll
                    for (int w = 0; w < SEL_WARPS; ++w) {
#pragma unroll
                        for (int j = 0; j < TOPK; ++j) grank += (int)(sm.rt.key[w][j] > ck);
                    }
                    if (grank < TOPK) {
                        sm.rt.sel_idx[grank] = (int)~(u32)ck;
#if EARLY_IDS
                        sm.experts[grank] = (expert_id_t)(int)~(u32)ck;
#endif
                        sm.rt.sel_score[grank] = sm.rt.score[cand / TOPK][cand % TOPK];
                    }
#if TRACE
                    if (threadIdx.x == 0) trow[T_RANKED] = globaltimer_after((u32)grank);
#endif
                }
#endif
                SEL_CLOCK(7);  // candidates ranked
#if EARLY_IDS
                // warp 0 waits with the producer for every rank; the other selection warps go on to their tiles
                if (warp == 0)
                    asm volatile("bar.sync %0, %1;" ::"r"(BAR_IDS), "r"((SEL_WARPS + 1) * 32) : "memory");
                else
                    asm volatile("bar.arrive %0, %1;" ::"r"(BAR_IDS), "r"((SEL_WARPS + 1) * 32) : "memory");
#else
                asm volatile("bar.sync %0, %1;" ::"r"(BAR_SELECT), "r"(SEL_WARPS * 32) : "memory");
#endif
                SEL_CLOCK(8);
#if TRACE
                if (threadIdx.x == 0) trow[T_RANKS_IN] = globaltimer();
#endif
                if (warp == 0) {
                    // weights: the unbiased scores, summed in rank order as router_decode.cu does
                    float wsum = 0.f;
#pragma unroll
                    for (int r = 0; r < TOPK; ++r) wsum += sm.rt.sel_score[r];
                    const int my_id = lane < TOPK ? sm.rt.sel_idx[lane] : 0;
                    float my_w = lane < TOPK ? sm.rt.sel_score[lane] : 0.f;
#if RENORM
                    my_w = my_w / (wsum + 1e-20f);
#endif
                    store_choice<!EARLY_IDS>(sm, lane, my_id, my_w, scaling, ids_out, wts_out);
                    SEL_CLOCK(9);  // the experts and weights in shared memory
#if TRACE
                    if (lane == 0) trow[T_SELECTED] = globaltimer();
#endif
#if SELECT_TWICE
                    if (pass == 1)
#endif
                    asm volatile("bar.arrive %0, %1;" ::"r"(BAR_ROUTED), "r"(ROUTED_THREADS) : "memory");
                }
#endif
            }
#if SELECT_TWICE
            }
#endif
        }
#endif
        if (warp < GU_WARPS) {
            // ---- gate_up: this warp's K slice, rows of even MMA index on chunks c..c+3, odd on c+4..c+7
            const int c = 8 * (warp >> 1) + t + 4 * ((g ^ warp) & 1);
            u32 xb[16];
            {
#pragma unroll
                for (int k = 0; k < 4; ++k) {
                    uint4 v = xs[4 * c + k];
                    const unsigned short *e8 = reinterpret_cast<const unsigned short *>(&v);
#pragma unroll
                    for (int j = 0; j < 4; ++j) xb[4 * k + j] = f16_pair(bf16_to_float(e8[j]), bf16_to_float(e8[j + 4]));
                }
            }
#if X_IN_TILES
            __syncwarp();  // (every lane's reads of x before lane 0's release)
            if (lane == 0)
                asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(smem_addr(&sm.bars[X_FREE])) : "memory");
#endif
#pragma unroll
            for (int i = 0; i < MAX_GU; ++i) {
                if (i < n_gu) {
                    bar_wait(smem_addr(&sm.bars[i]));
#if TRACE
                    if (i == 0 && warp == 0 && lane == 0) trow[T_FIRST_GU] = globaltimer();
                    if (i == n_gu - 1 && warp == 0 && lane == 0) trow[T_LAST_GU] = globaltimer();
#endif
                    const unsigned char *tile = tiles + i * GU_TILE_BYTES + c * 16 + g * (H / 2);
                    const uint4 lo = *reinterpret_cast<const uint4 *>(tile);
                    const uint4 hi = *reinterpret_cast<const uint4 *>(tile + GU_WORD_BYTES);
                    const unsigned char *sc = tiles + i * GU_TILE_BYTES + 2 * GU_WORD_BYTES + g * (H / 32) + c;
                    const u32 f_lo = scale_factor(sc[0]), f_hi = scale_factor(sc[H / 4]);
                    float acc[4] = {0.f, 0.f, 0.f, 0.f}, acc1[4] = {0.f, 0.f, 0.f, 0.f};
                    chunk_products(acc, acc1, lo, hi, f_lo, f_hi, xb);
#pragma unroll
                    for (int q = 0; q < 4; ++q) acc[q] += acc1[q];
                    if (t == 0) {
                        sm.gu_part[i][warp][g] = (g & 1) ? acc[1] : acc[0];  // (no dynamic register index)
                        sm.gu_part[i][warp][g + 8] = (g & 1) ? acc[3] : acc[2];
                    }
                    asm volatile("bar.arrive %0, %1;" ::"r"(BAR_FULL0 + i), "r"((GU_WARPS + 1) * 32) : "memory");
                }
            }
        }

#if SHARED
        float sh_row = 0.f;  // down warps: the shared down sum of their row dw * SH_RPW + lane
        if (warp >= GU_WARPS)
            sh_row = shared_expert(sm.x, &sm.dn_part[0][0][0], sh_tail, sh_bytes != 0, smem_addr(&sm.bars[SH_BAR]),
                                   smem_addr(&sm.bars[SH_FREE]), warp - GU_WARPS, lane, n_dn, dn_tile[0], sh_gu_s,
                                   sh_dn_s, sh_act, sh_limit, sm.launch);
#endif
        // ---- down, by every compute warp (the gate_up warps join after their last tile). Item (j, d) =
        // down tile j, K slice d: MMA rows 0-7 are slot 2p, rows 8-15 slot 2p+1, and B column n holds
        // slot 2p + ((n >> 1) & 1).
        const int bslot = (g >> 1) & 1;
        const u32 tag = sm.launch;
        const u32 *copy = act + (blockIdx.x % ACT_COPIES) * TOPK * I;
        float acc[MAX_ITEMS][4], acc_b[MAX_ITEMS][4];  // two chains of dependent MMAs per item
#pragma unroll
        for (int k = 0; k < MAX_ITEMS; ++k)
#pragma unroll
            for (int q = 0; q < 4; ++q) acc[k][q] = acc_b[k][q] = 0.f;
        // The slot pairs' activations are read by the down workers together (each 16-byte piece
        // once): pair 0 until it is complete, then every other pair at once (they complete at
        // about the same time), each checked and, if a tag is stale, read again.
        uint4 ahead[PAIRS][STAGE_PIECES];
        if (n_dn) stage_issue(ahead[EARLY_PAIRS], copy, EARLY_PAIRS, warp, lane);
#if EARLY_PAIRS
        // the down warps: the first EARLY_PAIRS pairs while the gate_up warps still work (see EARLY_PAIRS)
        if (warp >= GU_WARPS && n_dn) {
            const int dw = warp - GU_WARPS;
            early_stage(copy, dw, lane, tag, sm.act_h);
#if TRACE
            if (dw == 0 && lane == 0) trow[T_EARLY_STAGED] = globaltimer();
#endif
#pragma unroll
            for (int p = 0; p < EARLY_PAIRS; ++p) bar_wait(smem_addr(&sm.bars[MAX_GU + p]));
            const int c = 8 * (dw >> 1) + t + 4 * ((g ^ dw) & 1);
            float keep[MAX_DN][2];
#pragma unroll
            for (int j = 0; j < MAX_DN; ++j) {
                float a0[4] = {0.f, 0.f, 0.f, 0.f}, a1[4] = {0.f, 0.f, 0.f, 0.f};
                if (j < n_dn) {
#pragma unroll
                    for (int p = 0; p < EARLY_PAIRS; ++p) {  // item (j, dw) of pair p, as the loop below does it
                        u32 xb[16];
                        load_b_fragments(xb, sm.act_h, (2 * p + bslot) * (I / 32) + c);
                        const unsigned char *slot_a = tiles + dn_base + 2 * p * dn_slot;
                        const int r = 8 * j + g;
                        const uint4 lo = *reinterpret_cast<const uint4 *>(slot_a + r * (I / 2) + c * 16);
                        const uint4 hi = *reinterpret_cast<const uint4 *>(slot_a + dn_slot + r * (I / 2) + c * 16);
                        const unsigned char *sc = slot_a + dn_rows * (I / 2) + r * (I / 32) + c;
                        chunk_products(a0, a1, lo, hi, scale_factor(sc[0]), scale_factor(sc[dn_slot]), xb);
                    }
                }
                // (lane t < 2 keeps element 2 t + (g & 1), the one the row sums read; constant indices only)
                keep[j][0] = (g & 1) ? (t ? a0[3] : a0[1]) : (t ? a0[2] : a0[0]);
                keep[j][1] = (g & 1) ? (t ? a1[3] : a1[1]) : (t ? a1[2] : a1[0]);
            }
            asm volatile("bar.sync %0, %1;" ::"r"(BAR_EARLY), "r"(DN_WARPS * 32) : "memory");  // act_h read
            float *hand = reinterpret_cast<float *>(sm.act_h);
            if (t < 2) {
#pragma unroll
                for (int j = 0; j < MAX_DN; ++j)
                    if (j < n_dn) {
                        hand[early_slot(j, dw, g, t)] = keep[j][0];
                        hand[early_slot(j, dw, g, t) + 1] = keep[j][1];
                    }
            }
#if TRACE
            if (dw == 0 && lane == 0) trow[T_EARLY_DONE] = globaltimer();
#endif
        }
#endif
#if UNROLL_PAIRS
#pragma unroll
#else
#pragma unroll 1  // one copy of the loop's code (instruction cache)
#endif
        for (int p = EARLY_PAIRS; p < PAIRS; ++p) {
            if (!n_dn) break;  // (more blocks than down tiles: this one has none)
#if TRACE
            const u64 c_enter = clock64();
#endif
            const int rounds = stage_finish(ahead, copy, p, warp, lane, tag, sm.act_h);
#if TRACE
            const u64 c_staged = clock64();
            if (warp == 0 && lane == 0) trow[T_PAIR0 + p] = globaltimer();
#else
            (void)rounds;
#endif
#if L2_NEXT && L2_NEXT_AT == 2
            if (p == PAIRS - 1 && warp == 0 && lane == 0) l2_next_prefetch(sm.l2_table);  // every activation is in
#endif
            if (p == EARLY_PAIRS) {
#pragma unroll
                for (int q = EARLY_PAIRS + 1; q < PAIRS; ++q) stage_issue(ahead[q], copy, q, warp, lane);
#if EARLY_PAIRS
                // each item continues from the early pairs' sums (in shared memory since the barrier above)
                const float *hand = reinterpret_cast<const float *>(sm.act_h);
#pragma unroll
                for (int k = 0; k < MAX_ITEMS; ++k) {
                    const int item = warp + k * DOWN_WORKERS, j = item / DN_WARPS, d = item % DN_WARPS;
                    if (j < n_dn && t < 2) {
                        const int q = 2 * t + (g & 1);
#pragma unroll
                        for (int e = 0; e < 4; ++e)
                            if (e == q) {
                                acc[k][e] = hand[early_slot(j, d, g, t)];
                                acc_b[k][e] = hand[early_slot(j, d, g, t) + 1];
                            }
                    }
                }
#endif
            }
#if REFRESH_PENDING
            else
                refresh_pairs(ahead, copy, p + 1, PAIRS - 1, warp, lane, tag);  // loads fly during this pair's products
#endif
            bar_wait(smem_addr(&sm.bars[MAX_GU + p]));
#if TRACE
            const u64 c_rows = clock64();
#endif
            const unsigned char *slot_a = tiles + dn_base + 2 * p * dn_slot;  // slot 2p; slot 2p+1 follows
#pragma unroll
            for (int k = 0; k < MAX_ITEMS; ++k) {
                const int item = warp + k * DOWN_WORKERS, j = item / DN_WARPS, d = item % DN_WARPS;
                if (j < n_dn) {
                    const int c = 8 * (d >> 1) + t + 4 * ((g ^ d) & 1);
                    u32 xb[16];
                    load_b_fragments(xb, sm.act_h, (2 * p + bslot) * (I / 32) + c);
                    const int r = 8 * j + g;  // row within the block's down rows
                    const uint4 lo = *reinterpret_cast<const uint4 *>(slot_a + r * (I / 2) + c * 16);
                    const uint4 hi = *reinterpret_cast<const uint4 *>(slot_a + dn_slot + r * (I / 2) + c * 16);
                    const unsigned char *sc = slot_a + dn_rows * (I / 2) + r * (I / 32) + c;
                    const u32 f_lo = scale_factor(sc[0]), f_hi = scale_factor(sc[dn_slot]);
#if PROBE == 4
                    acc[k][0] += __uint_as_float(lo.x ^ hi.y ^ f_lo ^ f_hi ^ xb[0]);
#else
                    chunk_products(acc[k], acc_b[k], lo, hi, f_lo, f_hi, xb);
#endif
                }
            }
#if TRACE
            if (warp == 0 && lane == 0) {
                const u64 c_done = clock64();
                trow[C_PAIR0 + 4 * p + 0] = c_enter;
                trow[C_PAIR0 + 4 * p + 1] = c_staged;
                trow[C_PAIR0 + 4 * p + 2] = c_rows;
                trow[C_PAIR0 + 4 * p + 3] = c_done;
                trow[N_POLLS0 + p] = rounds;
            }
#endif
        }
#if TRACE
        if (warp == 0 && lane == 0) trow[T_DOWN_DONE] = globaltimer();
#endif
        // row g's sum: slot 2p parts in column g&1 (lane t=0), slot 2p+1 parts in column 2+(g&1) (t=1)
#pragma unroll
        for (int k = 0; k < MAX_ITEMS; ++k)
#pragma unroll
            for (int q = 0; q < 4; ++q) acc[k][q] += acc_b[k][q];
#pragma unroll
        for (int k = 0; k < MAX_ITEMS; ++k) {
            const int item = warp + k * DOWN_WORKERS, j = item / DN_WARPS, d = item % DN_WARPS;
            const float other = __shfl_down_sync(0xFFFFFFFFu, (g & 1) ? acc[k][3] : acc[k][2], 1);
            if (j < n_dn && t == 0) sm.dn_part[j][d][g] = ((g & 1) ? acc[k][1] : acc[k][0]) + other;
        }
        asm volatile("bar.sync %0, %1;" ::"r"(BAR_DOWN), "r"(DOWN_WORKERS * 32) : "memory");
#if SHARED
        // the new residual stream: x, plus the shared down rounded to bf16, plus the routed sum rounded
        if (warp >= GU_WARPS && lane < SH_RPW) {
            const int o = (warp - GU_WARPS) * SH_RPW + lane;  // = 8 j + output row
            if (o < 8 * n_dn) {
                float s = 0.f;
#pragma unroll
                for (int w = 0; w < DN_WARPS; ++w) s += sm.dn_part[o >> 3][w][o & 7];
                const int r = dn_tile[0] + o;
                const float res = bf16_to_float(ld_fresh_u16(x + r));
                out[r] = float_to_bf16(res + round_bf16(sh_row) + round_bf16(s));
            }
        }
#else
        if (warp == 0) {
            for (int o = lane; o < 8 * n_dn; o += 32) {  // o = 8 j + output row
                float s = 0.f;
#pragma unroll
                for (int w = 0; w < DN_WARPS; ++w) s += sm.dn_part[o >> 3][w][o & 7];
                out[dn_tile[0] + o] = float_to_bf16(s);
            }
        }
#endif
    }
#endif  // PROBE == 1
    __syncthreads();
    if (threadIdx.x == 0) {
#if L2_NEXT && L2_NEXT_AT == 3
        l2_next_prefetch(sm.l2_table);
#endif
        atomicInc(launches, NBLOCKS * 65536u - 1u);
#if TRACE
        u32 smid;
        asm("mov.u32 %0, %%smid;" : "=r"(smid));
        trow[T_SMID] = smid;
        trow[T_START] = t0;
        trow[T_END] = globaltimer();
        trow[C_START] = c0;
        trow[C_END] = clock64();
#endif
    }
}

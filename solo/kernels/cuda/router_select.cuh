// One token's grouped top-k, by E / 32 warps with one expert per lane (warp w, lane l: expert 32 w + l),
// branch-free: the semantics of solo/kernels/fused_router.py.
//   biased = score + bias (for the choice only); groups of GSIZE = E / GROUPS experts ranked by the sum
//   of their two largest biased scores, the best KEEP kept (ties: lower group first); the TOPK largest
//   biased scores among them in order (ties: lower index first); weights = the unbiased scores, summed
//   in rank order when renormalised.
// Each warp finds its best TOPK by rank counting over 32 shuffles; then every warp's best are ranked
// over all of them with (key, ~index) compared as one 64-bit value (unique: no branch for ties).
//
// Needs: E, GROUPS (<= 32), KEEP, TOPK (<= 32), RENORM, SEL_WARPS (E / 32) and SEL_BARRIER (a named
// barrier for the SEL_WARPS * 32 selecting threads) defined before inclusion, and step_common.cuh.

#define GSIZE (E / GROUPS)
#define SEL_WPG (GSIZE >= 32 ? GSIZE / 32 : 1)  // warps per group
#define SEL_NEG_INF __int_as_float(0xff800000)
// FAST_SELECT (a variant, CudaRouter.fast_select): where groups are whole warps, only the kept groups'
// warps rank their experts (the others hold zero keys) and only their best are candidates (KEEP x SEL_WPG
// x TOPK: 64 at Ling shapes, not 128), each ranked by 4 threads; the same choices bit for bit, as a zero
// key never ranks within the top TOPK (moe_decode.cu has the same for one token)
#ifndef FAST_SELECT
#define FAST_SELECT 0
#endif
#define SEL_FAST (FAST_SELECT && KEEP < GROUPS && GSIZE >= 32)
// LEAN_SELECT (CudaRouter.lean_select; with SEL_FAST): the groups ranked once, lane g group g, and only the ballot of
// the kept ones used; each lane's own group's rank only zeroed keys that no kept warp reads. The same choices.
#ifndef LEAN_SELECT
#define LEAN_SELECT 1
#endif
#define SEL_CANDS (KEEP * SEL_WPG * TOPK)
#if SEL_FAST && (SEL_CANDS * 4 > E || KEEP * SEL_WPG > E / 32)
#error "FAST_SELECT: too many candidates for the selecting warps"
#endif

#if E % 32 || E > 1024 || GROUPS > 32 || TOPK > 32
#error "the selection needs E a multiple of 32 up to 1024, at most 32 groups and TOPK <= 32"
#endif

typedef unsigned long long u64;

struct SelectScratch {
    float gtop[2][GROUPS][SEL_WPG];  // groups: their two best biased scores, per warp
    u64 key[SEL_WARPS][TOPK];        // each warp's best, in order: key << 32 | ~index
    float score[SEL_WARPS][TOPK];    //   ... unbiased score
    int idx[TOPK];                   // the token's top-k in order: expert index
    float sel_score[TOPK];           //   ... unbiased score
};

// A float as an unsigned key of the same order (-0 made +0 first, so equal values have equal keys);
// 0 is below every key of a number, and stands for an expert out of the running.
__device__ __forceinline__ u32 order_key(float f) {
    const u32 u = __float_as_uint(f + 0.0f);
    return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

__device__ __forceinline__ void select_sync() {
    asm volatile("bar.sync %0, %1;" ::"r"(SEL_BARRIER), "r"(SEL_WARPS * 32) : "memory");
}

// Called by every lane of the SEL_WARPS warps: sc = its expert's score, biased = sc + bias. Leaves the
// top-k in order in s.idx / s.sel_score (visible to the selecting warps after the call).
__device__ __forceinline__ void select_top(SelectScratch &s, float sc, float biased, int warp, int lane) {
    const int me = warp * 32 + lane;
    u32 key = order_key(biased);
    u32 kept_groups = 0u;  // bit g: group g is kept (SEL_FAST)
#if KEEP < GROUPS
    {
        store_group_best_two<GSIZE, SEL_WPG>(s.gtop, biased, me, warp);
        select_sync();
        rank_groups<GROUPS, KEEP, SEL_WPG, SEL_FAST, LEAN_SELECT>(s.gtop, me / GSIZE, lane, key, kept_groups);
    }
#endif
#if SEL_FAST
    {
        const int group = me / GSIZE;  // (a whole warp's: groups are whole warps here)
        const int row = __popc(kept_groups & ((1u << group) - 1u)) * SEL_WPG + warp % SEL_WPG;
        if ((kept_groups >> group) & 1u) {
            const int wrank = rank_in_warp(key, lane);
            if (wrank < TOPK) {
                s.key[row][wrank] = (u64)key << 32 | (u32)~me;
                s.score[row][wrank] = sc;
            }
        }
        select_sync();
        u64 ck;
        const int grank = candidate_rank<SEL_CANDS, 4, TOPK, TOPK>(s.key, me, ck);
        const int cand = me / 4;
        if (cand < SEL_CANDS && me % 4 == 0 && grank < TOPK) {
            s.idx[grank] = (int)~(u32)ck;
            s.sel_score[grank] = s.score[cand / TOPK][cand % TOPK];
        }
        select_sync();
    }
#else
    // this warp's best TOPK, in order: each lane's rank among the warp's 32 (ties: the lower lane, which
    // is the lower index), and the first TOPK write themselves down
    const int wrank = rank_in_warp(key, lane);
    if (wrank < TOPK) {
        s.key[warp][wrank] = (u64)key << 32 | (u32)~me;
        s.score[warp][wrank] = sc;
    }
    select_sync();
    // every warp's best are candidates; each one's rank over all of them is its place in the top-k
    const int cand = me;
    if (cand < SEL_WARPS * TOPK) {
        const u64 ck = s.key[cand / TOPK][cand % TOPK];
        int grank = 0;
#pragma unroll
        for (int w = 0; w < SEL_WARPS; ++w) {
#pragma unroll
            for (int j = 0; j < TOPK; ++j) grank += (int)(s.key[w][j] > ck);
        }
        if (grank < TOPK) {
            s.idx[grank] = (int)~(u32)ck;
            s.sel_score[grank] = s.score[cand / TOPK][cand % TOPK];
        }
    }
    select_sync();
#endif
}

// Lane r < TOPK of a selecting warp: the r-th expert and its weight (renormalised if RENORM, before the
// routed scaling factor), the sum taken in rank order.
__device__ __forceinline__ int selected_weight(const SelectScratch &s, int lane, float &weight) {
    float wsum = 0.f;
#pragma unroll
    for (int r = 0; r < TOPK; ++r) wsum += s.sel_score[r];
    weight = lane < TOPK ? s.sel_score[lane] : 0.f;
#if RENORM
    weight = weight / (wsum + 1e-20f);
#endif
    return lane < TOPK ? s.idx[lane] : 0;
}

// Device helpers shared by the decode step's CUDA kernels (gemv_decode.cu, router_decode.cu, moe_decode.cu,
// kda_front.cu), inlined into each source before NVRTC compiles it (solo/kernels/cuda_runtime.py).

typedef unsigned int u32;
typedef unsigned short u16;

__device__ __forceinline__ float bf16_to_float(u32 b) { return __uint_as_float(b << 16); }

// fp32 -> nearest bf16 (ties to even), kept in fp32: the reference's rounding
__device__ __forceinline__ float round_bf16(float f) {
    u32 b = __float_as_uint(f);
    b = (b + 0x7FFFu + ((b >> 16) & 1u)) & 0xFFFF0000u;
    return __uint_as_float(b);
}

// word q of a uint4 (q a compile-time constant after unrolling: no local-memory indexing)
__device__ __forceinline__ u32 word(const uint4 &v, int q) { return q == 0 ? v.x : q == 1 ? v.y : q == 2 ? v.z : v.w; }

// a piece of 8 bf16 values (low half of each word first) as floats
__device__ __forceinline__ void bf16x8_to_float(const uint4 &w, float (&v)[8]) {
#pragma unroll
    for (int q = 0; q < 4; ++q) {
        v[2 * q] = bf16_to_float(word(w, q) & 0xFFFFu);
        v[2 * q + 1] = bf16_to_float(word(w, q) >> 16);
    }
}

// Weights: read once per step, never written while a kernel runs; through the read-only path, no L1.
// L2_FETCH (a lab variant: 128 or 256): a miss fetches that many bytes into the L2 (the PTX prefetch-size
// qualifier), so a warp's later steps along the same rows find their bytes there
#if defined(L2_FETCH) && L2_FETCH == 256
#define LD_STREAM_OP "ld.global.nc.L1::no_allocate.L2::256B.v4.u32"
#elif defined(L2_FETCH) && L2_FETCH == 128
#define LD_STREAM_OP "ld.global.nc.L1::no_allocate.L2::128B.v4.u32"
#else
#define LD_STREAM_OP "ld.global.nc.L1::no_allocate.v4.u32"
#endif
__device__ __forceinline__ uint4 ld_stream(const void *p) {
    uint4 v;
    asm volatile(LD_STREAM_OP " {%0,%1,%2,%3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
    return v;
}

// Activations (written by the kernels before this one) bypass L1: under programmatic dependent launch
// a kernel starts before its producer ends, so a read-only or L1 path could serve stale lines.
__device__ __forceinline__ uint4 ld_fresh(const void *p) {
    uint4 v;
    asm volatile("ld.global.cg.v4.u32 {%0,%1,%2,%3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
    return v;
}

__device__ __forceinline__ u32 ld_fresh_u16(const u16 *p) {
    unsigned short v;
    asm volatile("ld.global.cg.u16 %0, [%1];" : "=h"(v) : "l"(p));
    return v;
}

// Shared memory filled by bulk copies (the MoE kernel's tiles, the GEMV's and the KDA front's rings): a 32-bit
// shared-memory address, an mbarrier armed for a byte count, one global -> shared bulk copy completing on it, and
// the wait for a phase of it.
__device__ __forceinline__ u32 smem_addr(const void *p) { return (u32)__cvta_generic_to_shared(p); }

__device__ __forceinline__ void bar_expect_bytes(u32 bar, u32 bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar), "r"(bytes) : "memory");
}

__device__ __forceinline__ void bulk_to_shared(u32 dst, const void *src, u32 bytes, u32 bar) {
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(dst),
                 "l"(src), "r"(bytes), "r"(bar)
                 : "memory");
}

__device__ __forceinline__ void bar_wait_parity(u32 bar, u32 parity) {
    asm volatile(
        "{\n.reg .pred p;\nWAIT_%=:\n"
        "mbarrier.try_wait.parity.shared::cta.b64 p, [%0], %1;\n"
        "@!p bra WAIT_%=;\n}\n" ::"r"(bar),
        "r"(parity)
        : "memory");
}

// fp32 -> nearest bf16 bits (ties to even)
__device__ __forceinline__ u16 to_bf16(float f) { return (u16)(__float_as_uint(round_bf16(f)) >> 16); }

// two fp32 -> an f16x2 register (round to nearest), lo in the low half
__device__ __forceinline__ u32 f16x2(float lo, float hi) {
    u32 r;
    asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
}

// one m16n8k16 tensor-core product, f16 operands, fp32 accumulators c (c += A B)
__device__ __forceinline__ void mma(float *c, u32 a0, u32 a1, u32 a2, u32 a3, u32 b0, u32 b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// two e4m3 codes (low byte first) -> f16x2 (exact), low byte in the low half
__device__ __forceinline__ u32 e4m3x2_to_f16x2(u32 pair) {
    u32 r;
    asm("{\n\t.reg .b16 t;\n\tcvt.u16.u32 t, %1;\n\tcvt.rn.f16x2.e4m3x2 %0, t;\n\t}" : "=r"(r) : "r"(pair));
    return r;
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xFFFFFFFFu, v, o);
    return v;
}

// RMSNorm's 1 / rms of NT rows of n bf16 values, each held as 8-element pieces by every thread of the
// block (zeros past the end): the sums of squares reduced over the warps through `red` [NT][NW].
template <int NT, int NP, int NW>
__device__ __forceinline__ void block_rstd(const uint4 (&xv)[NT][NP], float (*red)[NW], int n, float eps,
                                           float (&rstd)[NT]) {
    float ss[NT];
#pragma unroll
    for (int r = 0; r < NT; ++r) {
        ss[r] = 0.0f;
#pragma unroll
        for (int p = 0; p < NP; ++p) {
#pragma unroll
            for (int q = 0; q < 4; ++q) {
                const u32 xq = word(xv[r][p], q);
                const float lo = bf16_to_float(xq & 0xFFFFu), hi = bf16_to_float(xq >> 16);
                ss[r] = fmaf(lo, lo, ss[r]);
                ss[r] = fmaf(hi, hi, ss[r]);
            }
        }
        ss[r] = warp_sum(ss[r]);
        if ((threadIdx.x & 31) == 0) red[r][threadIdx.x >> 5] = ss[r];
    }
    __syncthreads();
#pragma unroll
    for (int r = 0; r < NT; ++r) {
        float total = 0.0f;
#pragma unroll
        for (int i = 0; i < NW; ++i) total += red[r][i];
        rstd[r] = __frcp_rn(__fsqrt_rn(__fdiv_rn(total, (float)n) + eps));
    }
}

// One normalised value as the reference rounds it: normalise in fp32, round to bf16, times the bf16
// norm weight, round.
__device__ __forceinline__ float rms_value(u32 x_bits, float rstd, u32 w_bits) {
    return round_bf16(round_bf16(bf16_to_float(x_bits) * rstd) * bf16_to_float(w_bits));
}

// The gated per-group RMSNorm of 8 consecutive values v (one 16-byte piece of bf16; the KDA output norm): a group of
// GN columns is GN / 8 consecutive pieces held by consecutive lanes of one warp (every lane must call it), g and
// w the piece's gate and norm weight (bf16); each value normalised in fp32, times w and sigmoid(g), rounded to bf16.
// (gemv_decode.cu's NORM 2 prologue and the KDA front's output projection: the same bits.)
template <int GN>
__device__ __forceinline__ void gated_rms_piece(float (&v)[8], const uint4 &g, const uint4 &w, float eps) {
    float sq = 0.0f;
#pragma unroll
    for (int j = 0; j < 8; ++j) sq = fmaf(v[j], v[j], sq);
#pragma unroll
    for (int o = 1; o < GN / 8; o <<= 1) sq += __shfl_xor_sync(0xFFFFFFFFu, sq, o);
    const float rs = __frcp_rn(__fsqrt_rn(__fdiv_rn(sq, (float)GN) + eps));
#pragma unroll
    for (int q = 0; q < 4; ++q) {
        const u32 gq = word(g, q), nq = word(w, q);
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const float gate = bf16_to_float(h ? gq >> 16 : gq & 0xFFFFu);
            const float wn = bf16_to_float(h ? nq >> 16 : nq & 0xFFFFu);
            const float sig = 1.0f / (1.0f + __expf(-gate));
            v[2 * q + h] = round_bf16(wn * (v[2 * q + h] * rs) * sig);
        }
    }
}

// Two bf16-exact fp32 values -> a packed bf16 pair (low first)
__device__ __forceinline__ u32 bf16_pair(float lo, float hi) {
    return (__float_as_uint(lo) >> 16) | (__float_as_uint(hi) & 0xFFFF0000u);
}

// The selection over the kept groups (FAST_SELECT in moe_decode.cu and router_select.cuh) ranks with
// these two; the default selections keep their own loops, whose schedule the helpers' form would change
// before it is measured.

// A lane's rank of `key` among the 32 keys of its warp (ties: the lower lane first), by 32 shuffles.
__device__ __forceinline__ int rank_in_warp(u32 key, int lane) {
    int rank = 0;
#pragma unroll
    for (int j = 0; j < 32; ++j) {
        const u32 kj = __shfl_sync(0xFFFFFFFFu, key, j);
        rank += (int)((kj > key) | ((kj == key) & (j < lane)));
    }
    return rank;
}

// The groups the grouped top-k keeps, as a mask (bit g: group g): lane g < NG holds group g's score gs and ranks it
// among all NG groups (ties: the lower group first); the best NK are kept. Every lane calls it. (NG, NK: the
// kernels' GROUPS and KEEP, which are macros there.)
template <int NG, int NK>
__device__ __forceinline__ u32 kept_groups_mask(float gs, int lane) {
    int rank = 0;
#pragma unroll
    for (int g = 0; g < NG; ++g) {
        const float other = __shfl_sync(0xFFFFFFFFu, gs, g);
        rank += (other > gs || (other == gs && g < lane)) ? 1 : 0;
    }
    return __ballot_sync(0xFFFFFFFFu, lane < NG && rank < NK);
}

// The grouped top-k's first half, before its barrier: the two largest biased scores of the lanes of my group (GS
// experts, WPG = its warps) in this warp, stored by the group's first lane in the warp as gtop[0 / 1][group][its warp].
// Every lane of the selecting warps calls it with its expert `me`'s biased score. (GS, WPG: the kernels' GSIZE and
// their warps per group, macros there; W, the array's last extent, may exceed WPG.)
template <int GS, int WPG, int NG, int W>
__device__ __forceinline__ void store_group_best_two(float (&gtop)[2][NG][W], float biased, int me, int warp) {
    float m1 = biased, m2 = __int_as_float(0xff800000);
#pragma unroll
    for (int o = 1; o < (GS < 32 ? GS : 32); o <<= 1) {
        const float o1 = __shfl_xor_sync(0xFFFFFFFFu, m1, o), o2 = __shfl_xor_sync(0xFFFFFFFFu, m2, o);
        const float hi = fmaxf(m1, o1), lo = fmaxf(fminf(m1, o1), fmaxf(m2, o2));
        m1 = hi;
        m2 = lo;
    }
    const int group = me / GS;
    if (me % (GS < 32 ? GS : 32) == 0) {
        const int part = GS >= 32 ? warp % WPG : 0;
        gtop[0][group][part] = m1;
        gtop[1][group][part] = m2;
    }
}

// The grouped top-k's second half, after that barrier: each group's score is the sum of its two best biased scores
// (over its WPG warps' pairs in gtop), and the best NK groups are kept (ties: the lower group first). FAST (the kept
// groups' warps alone rank their experts, which needs groups of whole warps) sets `kept` (bit g: group g is kept);
// with LEAN too that is all, and the keys stand as they are (no kept warp reads a dropped group's). Otherwise a lane
// of a dropped `group` zeroes its `key`. Every lane of the selecting warps calls it.
template <int NG, int NK, int WPG, bool FAST, bool LEAN, int W>
__device__ __forceinline__ void rank_groups(const float (&gtop)[2][NG][W], int group, int lane, u32 &key, u32 &kept) {
    float gs = __int_as_float(0xff800000);
    if (lane < NG) {
        float a1 = gtop[0][lane][0], a2 = gtop[1][lane][0];
#pragma unroll
        for (int w = 1; w < WPG; ++w) {
            const float o1 = gtop[0][lane][w], o2 = gtop[1][lane][w];
            const float hi = fmaxf(a1, o1), lo = fmaxf(fminf(a1, o1), fmaxf(a2, o2));
            a1 = hi;
            a2 = lo;
        }
        gs = a1 + a2;
    }
    if constexpr (FAST && LEAN) {
        kept = kept_groups_mask<NG, NK>(gs, lane);
    } else {
        const float mine = __shfl_sync(0xFFFFFFFFu, gs, group);
        int rank = 0, lane_rank = 0;  // lane_rank (FAST): lane g < NG's group g's rank
#pragma unroll
        for (int g = 0; g < NG; ++g) {
            const float other = __shfl_sync(0xFFFFFFFFu, gs, g);
            rank += (other > mine || (other == mine && g < group)) ? 1 : 0;
            if constexpr (FAST) lane_rank += (other > gs || (other == gs && g < lane)) ? 1 : 0;
        }
        if constexpr (FAST) kept = __ballot_sync(0xFFFFFFFFu, lane < NG && lane_rank < NK);
        if (rank >= NK) key = 0u;
    }
}

// Candidate me / SUB's rank among the N distinct 64-bit keys of `keys` (TK to a row of W), the
// comparisons split over SUB consecutive lanes of a warp (every lane calls it); `ck` gets the candidate.
template <int N, int SUB, int TK, int W>
__device__ __forceinline__ int candidate_rank(const unsigned long long (*keys)[W], int me, unsigned long long &ck) {
    const int cand = me / SUB, sub = me % SUB;
    int rank = 0;
    ck = 0;
    if (cand < N) {
        ck = keys[cand / TK][cand % TK];
#pragma unroll
        for (int i = 0; i < (N + SUB - 1) / SUB; ++i) {
            const int j = i * SUB + sub;
            if (j < N) rank += (int)(keys[j / TK][j % TK] > ck);
        }
    }
#pragma unroll
    for (int o = 1; o < SUB; o <<= 1) rank += __shfl_xor_sync(0xFFFFFFFFu, rank, o);
    return rank;
}

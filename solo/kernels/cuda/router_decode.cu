// MoE router of the decode step (one token) and of NEXTN verification (a few) in one launch
// (solo/kernels/cuda_step.py): RMSNorm, router GEMV, sigmoid, grouped top-k, the semantics of
// solo/kernels/fused_router.py.
//
// Why CUDA: the router reads 2.6 MB, so its time is latency, and the Triton kernel spent it in a
// chain of dependent steps (one warp per program looping over K chunks; the selection as about 30
// arg-max reductions each through Triton's generic reduction). Here every warp loads its expert
// row(s) in one go before griddepcontrol.wait (the weights do not depend on the previous kernel),
// each block normalises x once into shared memory (block 0 also writes it for the experts; a warp's
// row meets every token, so NTOK tokens read the weights once), and the last block to finish selects,
// one warp per token, with lane-local work and shuffles:
//   biased = score + bias (for the choice only); groups of E / GROUPS experts ranked by the sum of
//   their two largest biased scores, the best KEEP kept (ties: lower index first); the TOPK largest
//   biased scores among them in order (ties: lower index first); weights = their unbiased scores,
//   renormalised if RENORM, times the routed scaling factor.
// The arrival counter is reset by the last block, so graph replays need no memset.
//
// Defines: NTOK (tokens, 1..8), H (hidden, multiple of 256), E (experts, 32 <= E, power of two), GROUPS,
// KEEP, TOPK, RENORM, WARPS (per block), EPW (experts per warp).

#include "step_common.cuh"

#define THREADS (WARPS * 32)
#define NCH ((H * 2 + 511) / 512)  // 16-byte loads per lane per expert row (bf16)
#define EPL (E / 32)                // experts per lane in the selection
#define GSIZE (E / GROUPS)
#define PIECES ((H / 8 + THREADS - 1) / THREADS)  // 8-element pieces of x per thread
#define NEG_INF __int_as_float(0xff800000)

__device__ __forceinline__ float dot2(u32 w, float a, float b, float acc) {
    acc = fmaf(__uint_as_float(w << 16), a, acc);
    return fmaf(__uint_as_float(w & 0xFFFF0000u), b, acc);
}

// better(a, ia, b, ib): a larger, or equal with a lower index
__device__ __forceinline__ bool better(float a, int ia, float b, int ib) { return a > b || (a == b && ia < ib); }

// One token's selection by one warp: scores [E] (sigmoid), bias [E] -> ids, wts [TOPK].
__device__ __forceinline__ void select_token(const float *scores, const float *__restrict__ bias,
                                             int *__restrict__ ids, float *__restrict__ wts, int lane, float scaling) {
    float sc[EPL], bsd[EPL];
#pragma unroll
    for (int j = 0; j < EPL; ++j) {
        sc[j] = __ldcg(scores + lane * EPL + j);
        bsd[j] = sc[j] + __ldg(bias + lane * EPL + j);
    }
#if KEEP < GROUPS
    {
        // the two largest biased scores of this lane's experts, then of its group's lanes
        float m1 = NEG_INF, m2 = NEG_INF;
#pragma unroll
        for (int j = 0; j < EPL; ++j) {
            const float v = bsd[j];
            if (v > m1) {
                m2 = m1;
                m1 = v;
            } else if (v > m2) {
                m2 = v;
            }
        }
#pragma unroll
        for (int o = 1; o < GSIZE / EPL; o <<= 1) {
            const float o1 = __shfl_xor_sync(0xFFFFFFFFu, m1, o), o2 = __shfl_xor_sync(0xFFFFFFFFu, m2, o);
            const float hi = fmaxf(m1, o1), lo = fmaxf(fminf(m1, o1), fmaxf(m2, o2));
            m1 = hi;
            m2 = lo;
        }
        const float mine = m1 + m2;
        const int group = lane * EPL / GSIZE;
        int rank = 0;
#pragma unroll
        for (int g = 0; g < GROUPS; ++g) {
            const float other = __shfl_sync(0xFFFFFFFFu, mine, g * GSIZE / EPL);
            rank += better(other, g, mine, group) ? 1 : 0;
        }
        if (rank >= KEEP) {
#pragma unroll
            for (int j = 0; j < EPL; ++j) bsd[j] = NEG_INF;
        }
    }
#endif
    int my_ids = 0;
    float my_wts = 0.0f, total = 0.0f;
#pragma unroll
    for (int i = 0; i < TOPK; ++i) {
        float best = NEG_INF;
        int at = E;
#pragma unroll
        for (int j = 0; j < EPL; ++j)
            if (better(bsd[j], lane * EPL + j, best, at)) {
                best = bsd[j];
                at = lane * EPL + j;
            }
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) {
            const float ob = __shfl_xor_sync(0xFFFFFFFFu, best, o);
            const int oa = __shfl_xor_sync(0xFFFFFFFFu, at, o);
            if (better(ob, oa, best, at)) {
                best = ob;
                at = oa;
            }
        }
        // the owner lane takes the expert out and tells its unbiased score
        float score = 0.0f;
#pragma unroll
        for (int j = 0; j < EPL; ++j)
            if (lane * EPL + j == at) {
                score = sc[j];
                bsd[j] = NEG_INF;
            }
        score = __shfl_sync(0xFFFFFFFFu, score, at / EPL);
        total += score;
        if (lane == i) {
            my_ids = at;
            my_wts = score;
        }
    }
#if RENORM
    my_wts = my_wts / (total + 1e-20f);
#endif
    if (lane < TOPK) {
        ids[lane] = my_ids;
        wts[lane] = my_wts * scaling;
    }
}

extern "C" __global__ void __launch_bounds__(THREADS)
router_decode(const u16 *__restrict__ x,       // [NTOK, H] bf16 residual stream (rows x_stride apart)
              const u16 *__restrict__ nw,      // [H] post-attention norm weight
              const u16 *__restrict__ w,       // [E, H] bf16 router weight
              const float *__restrict__ bias,  // [E] expert bias (selection only)
              u16 *__restrict__ xn,            // [NTOK, H] normalised x for the experts (written by block 0)
              float *scores,                   // [NTOK, E] scratch
              int *arrived,                    // arrival counter (zero between launches)
              int *__restrict__ ids,           // [NTOK, TOPK]
              float *__restrict__ wts,         // [NTOK, TOPK]
              int *__restrict__ count,         // launch counter
              float eps, float scaling, int x_stride) {
    __shared__ __align__(16) u32 xs[NTOK][H / 2];  // normalised x, bf16 pairs (exact: the reference's values)
    __shared__ float partial[NTOK][WARPS];
    __shared__ int last;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int e0 = (blockIdx.x * WARPS + warp) * EPW;

    uint4 row[EPW][NCH];
#pragma unroll
    for (int j = 0; j < EPW; ++j)
#pragma unroll
        for (int c = 0; c < NCH; ++c) {
            const int col = c * 256 + lane * 8;  // bf16 columns
            row[j][c] = col < H ? ld_stream(w + (size_t)(e0 + j) * H + col) : uint4{0u, 0u, 0u, 0u};
        }
    // the weights do not depend on the previous kernel; everything below does
    asm volatile("griddepcontrol.wait;" ::: "memory");
    if (blockIdx.x == 0 && threadIdx.x == 0) atomicAdd(count, 1);

    // x and the norm weight, every load issued before the first is used
    uint4 xv[NTOK][PIECES], nv[PIECES];
#pragma unroll
    for (int p = 0; p < PIECES; ++p) {
        const int i = p * THREADS + threadIdx.x;
#pragma unroll
        for (int r = 0; r < NTOK; ++r)
            xv[r][p] = i < H / 8 ? ld_fresh(x + (size_t)r * x_stride + i * 8) : uint4{0u, 0u, 0u, 0u};
        nv[p] = i < H / 8 ? *reinterpret_cast<const uint4 *>(nw + i * 8) : uint4{0u, 0u, 0u, 0u};
    }
    float rstd[NTOK];
    block_rstd<NTOK, PIECES, WARPS>(xv, partial, H, eps, rstd);
#pragma unroll
    for (int r = 0; r < NTOK; ++r) {
#pragma unroll
        for (int p = 0; p < PIECES; ++p) {
            const int i = p * THREADS + threadIdx.x;
            if (i >= H / 8) continue;
            u32 out[4];
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                const u32 xq = word(xv[r][p], j), nq = word(nv[p], j);
                out[j] = bf16_pair(rms_value(xq & 0xFFFFu, rstd[r], nq & 0xFFFFu), rms_value(xq >> 16, rstd[r], nq >> 16));
            }
            const uint4 packed = uint4{out[0], out[1], out[2], out[3]};
            *reinterpret_cast<uint4 *>(&xs[r][i * 4]) = packed;
            if (blockIdx.x == 0) *reinterpret_cast<uint4 *>(xn + (size_t)r * H + i * 8) = packed;
        }
    }
    __syncthreads();

#pragma unroll
    for (int j = 0; j < EPW; ++j) {
        float acc[NTOK];
#pragma unroll
        for (int r = 0; r < NTOK; ++r) acc[r] = 0.0f;
#pragma unroll
        for (int c = 0; c < NCH; ++c) {
            const int col = c * 256 + lane * 8;
            if (col < H) {
                const uint4 v = row[j][c];
#pragma unroll
                for (int r = 0; r < NTOK; ++r) {
                    const uint4 xq = *reinterpret_cast<const uint4 *>(&xs[r][col / 2]);
                    acc[r] = dot2(v.x, bf16_to_float(xq.x & 0xFFFFu), bf16_to_float(xq.x >> 16), acc[r]);
                    acc[r] = dot2(v.y, bf16_to_float(xq.y & 0xFFFFu), bf16_to_float(xq.y >> 16), acc[r]);
                    acc[r] = dot2(v.z, bf16_to_float(xq.z & 0xFFFFu), bf16_to_float(xq.z >> 16), acc[r]);
                    acc[r] = dot2(v.w, bf16_to_float(xq.w & 0xFFFFu), bf16_to_float(xq.w >> 16), acc[r]);
                }
            }
        }
#pragma unroll
        for (int r = 0; r < NTOK; ++r) {
            const float total = warp_sum(acc[r]);
            if (lane == 0) scores[r * E + e0 + j] = 1.0f / (1.0f + __expf(-total));
        }
        if (lane == 0) __threadfence();  // visible to the last block before this one counts itself in
    }

    // ---- the last block to arrive selects, warp r for tokens r, r + WARPS, ...; the next kernel may launch now
    asm volatile("griddepcontrol.launch_dependents;");
    __syncthreads();
    if (threadIdx.x == 0) {
        __threadfence();
        last = atomicAdd(arrived, 1) == (int)gridDim.x - 1;
    }
    __syncthreads();
    if (!last) return;
    __threadfence();
#pragma unroll
    for (int k = 0; k < (NTOK + WARPS - 1) / WARPS; ++k) {
        const int tok = warp + k * WARPS;
        if (tok < NTOK) select_token(scores + tok * E, bias, ids + tok * TOPK, wts + tok * TOPK, lane, scaling);
    }
    __syncthreads();
    if (threadIdx.x == 0) atomicExch(arrived, 0);
}

// MoE router of the decode step (one token) and of NEXTN verification (a few) in one launch
// (solo/kernels/cuda_step.py): RMSNorm, router GEMV, sigmoid, grouped top-k, the semantics of
// solo/kernels/fused_router.py.
//
// Why CUDA: the router reads 2.6 MB, so its time is latency, and the Triton kernel spent it in a
// chain of dependent steps. Here every warp loads its expert row(s) in one go before
// griddepcontrol.wait (the weights do not depend on the previous kernel), each block normalises x once
// into shared memory (block 0 also writes it for the experts; a warp's row meets every token, so NTOK
// tokens read the weights once) and publishes its experts' scores; then block b < NTOK selects token b
// once every block has counted itself in, with E / 32 warps, one expert per lane:
//   biased = score + bias (for the choice only); groups of E / GROUPS experts ranked by the sum of
//   their two largest biased scores, the best KEEP kept (ties: lower index first); the TOPK largest
//   biased scores among them in order (ties: lower index first); weights = their unbiased scores,
//   renormalised if RENORM (summed in rank order), times the routed scaling factor.
// The selection is branch-free rank counting (router_select.cuh), so the tokens' selections run side
// by side in their own blocks; the earlier kernel selected every token in the last block, one warp per
// token by repeated arg-max, and at four tokens that tail was most of the launch.
// The arrival counters are reset by the last selector, so graph replays need no memset.
// The selecting blocks wait for every block of the grid (E / WARPS blocks: 32 at 512 experts), so the
// whole grid must be resident at once, as it is on a whole GPU (one block per SM by registers here);
// a GPU share with fewer SMs (MPS) would need the last NTOK blocks to arrive as the selectors instead.
//
// Defines: NTOK (tokens, 1..8), H (hidden, multiple of 256), E (experts, 32 <= E <= 1024, power of two),
// GROUPS (<= 32), KEEP, TOPK (<= 32), RENORM, WARPS (per block, >= E / 32), EPW (experts per warp).

#include "step_common.cuh"

#define THREADS (WARPS * 32)
#define NCH ((H * 2 + 511) / 512)  // 16-byte loads per lane per expert row (bf16)
#define PIECES ((H / 8 + THREADS - 1) / THREADS)  // 8-element pieces of x per thread
#define SEL_WARPS (E / 32)
#define SEL_BARRIER 1  // named barrier of the selecting warps (0 is __syncthreads)

#include "router_select.cuh"

#if WARPS < SEL_WARPS
#error "the router's blocks need at least E / 32 warps: one expert per lane selects"
#endif

__device__ __forceinline__ float dot2(u32 w, float a, float b, float acc) {
    acc = fmaf(__uint_as_float(w << 16), a, acc);
    return fmaf(__uint_as_float(w & 0xFFFF0000u), b, acc);
}

__device__ __forceinline__ int ld_acquire(const int *p) {
    int v;
    asm volatile("ld.acquire.gpu.global.b32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
    return v;
}

extern "C" __global__ void __launch_bounds__(THREADS)
router_decode(const u16 *__restrict__ x,       // [NTOK, H] bf16 residual stream (rows x_stride apart)
              const u16 *__restrict__ nw,      // [H] post-attention norm weight
              const u16 *__restrict__ w,       // [E, H] bf16 router weight
              const float *__restrict__ bias,  // [E] expert bias (selection only)
              u16 *__restrict__ xn,            // [NTOK, H] normalised x for the experts (written by block 0)
              float *scores,                   // [NTOK, E] scratch
              int *arrived,                    // [2] arrivals, selectors done (zero between launches)
              int *__restrict__ ids,           // [NTOK, TOPK]
              float *__restrict__ wts,         // [NTOK, TOPK]
              int *__restrict__ count,         // launch counter
              float eps, float scaling, int x_stride) {
    __shared__ __align__(16) u32 xs[NTOK][H / 2];  // normalised x, bf16 pairs (exact: the reference's values)
    __shared__ float partial[NTOK][WARPS];
    __shared__ SelectScratch sel;
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
    }
    if (lane == 0) __threadfence();  // the scores visible before this block counts itself in

    // ---- the next kernel may launch now; block b < NTOK selects token b once every block is in
    asm volatile("griddepcontrol.launch_dependents;");
    __syncthreads();
    if (threadIdx.x == 0) atomicAdd(&arrived[0], 1);
    if (blockIdx.x >= NTOK) return;
    if (threadIdx.x == 0)
        while (ld_acquire(&arrived[0]) != (int)gridDim.x) __nanosleep(32);
    __syncthreads();
    const int tok = blockIdx.x;
    if (warp < SEL_WARPS) {
        const int me = warp * 32 + lane;
        const float sc = __ldcg(scores + tok * E + me);
        select_top(sel, sc, sc + __ldg(bias + me), warp, lane);
        if (warp == 0) {
            float my_w;
            const int my_id = selected_weight(sel, lane, my_w);
            if (lane < TOPK) {
                ids[tok * TOPK + lane] = my_id;
                wts[tok * TOPK + lane] = my_w * scaling;
            }
        }
    }
    // the last selector resets the counters (every selector has seen all arrivals by then)
    if (threadIdx.x == 0 && atomicAdd(&arrived[1], 1) == NTOK - 1) {
        atomicExch(&arrived[0], 0);
        atomicExch(&arrived[1], 0);
    }
}

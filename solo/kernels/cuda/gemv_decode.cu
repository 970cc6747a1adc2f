// One-token FP8 GEMV of the decode step, with its neighbours fused in (solo/kernels/cuda_step.py).
//
// out[r] = epilogue(sum_k W[r, k] * prologue(x)[k] * scale) for one token. Why CUDA and not the
// Triton kernel (solo/kernels/fused_gemv.py): at batch size 1 a projection is a stream of weight
// bytes, and the Triton kernel recomputed the activation side (norm, rounding, scales) for every
// weight tile in every program and kept one 16-byte load in flight per thread; here
//   - each block computes the prologue once into shared memory (fp32), then its warps stream rows;
//   - a warp owns RPW whole rows at a time (a task): every lane holds RPW x NCHUNK 16-byte loads in
//     flight, and the next task's loads are issued before the current one is reduced (two buffers);
//   - the first task's weights (and scales) are loaded before griddepcontrol.wait: under
//     programmatic dependent launch they stream while the previous kernel finishes (weights do not
//     depend on it; x does);
//   - products on the CUDA cores: e4m3 pairs widened to f16x2 (exact), then fp32 FMAs against the
//     fp32 activations; the block scale multiplies each lane's 16-product partial (one 128-column
//     block), the row scale the row's sum.
// The grid is persistent: at most as many blocks as fit at once; warp w takes tasks w, w + total
// warps, ... (balanced to one task). Block 0 bumps the launch counter (start-up checks read it).
//
// Defines: K (input width, multiple of 16), ROWS (output rows; SwiGLU: the gate rows, W holds
// [gate; up]), NORM (0 none, 1 RMSNorm over K, 2 gated per-group RMSNorm of GROUP), SCALE (1 block
// 128x128, 2 one per row), EPI (0 store, 1 residual (+ addend if ADD), 2 SwiGLU (+ clamp if
// HAS_LIMIT)), OUT_F32 (EPI 0: fp32 output), WRITE_XN (block 0 writes the prologue's x as bf16),
// WARPS (per block), RPW (rows per task), BUFFERS (2: the next task's loads are issued before the
// current one is reduced; 1: one task at a time, for wide rows that would not fit twice in registers).

typedef unsigned int u32;
typedef unsigned short u16;

#define THREADS (WARPS * 32)
#define NCHUNK ((K + 511) / 512)  // 512 columns per chunk: 32 lanes x 16 bytes
#define KB ((K + 127) / 128)      // 128-column scale blocks
#define PAIR (EPI == 2 ? 2 : 1)   // weight rows per output row (SwiGLU: gate and up)
#define WROWS (RPW * PAIR)
#define TASKS ((ROWS + RPW - 1) / RPW)

__device__ __forceinline__ float bf16_to_float(u16 b) { return __uint_as_float((u32)b << 16); }

// fp32 -> nearest bf16 (ties to even), kept in fp32: the reference's rounding
__device__ __forceinline__ float round_bf16(float f) {
    u32 b = __float_as_uint(f);
    b = (b + 0x7FFFu + ((b >> 16) & 1u)) & 0xFFFF0000u;
    return __uint_as_float(b);
}

__device__ __forceinline__ u16 to_bf16(float f) { return (u16)(__float_as_uint(round_bf16(f)) >> 16); }

__device__ __forceinline__ uint4 ld_stream(const uint4 *p) {
    uint4 v;
    asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                 : "l"(p));
    return v;
}

// two e4m3 codes (low byte first) -> f16x2 (exact)
__device__ __forceinline__ u32 e4m3x2_to_f16x2(u32 pair) {
    u32 r;
    asm("{\n\t.reg .b16 t;\n\tcvt.u16.u32 t, %1;\n\tcvt.rn.f16x2.e4m3x2 %0, t;\n\t}" : "=r"(r) : "r"(pair));
    return r;
}

__device__ __forceinline__ float f16_lo(u32 h2) {
    float f;
    asm("{\n\t.reg .b16 lo, hi;\n\tmov.b32 {lo, hi}, %1;\n\tcvt.f32.f16 %0, lo;\n\t}" : "=f"(f) : "r"(h2));
    return f;
}

__device__ __forceinline__ float f16_hi(u32 h2) {
    float f;
    asm("{\n\t.reg .b16 lo, hi;\n\tmov.b32 {lo, hi}, %1;\n\tcvt.f32.f16 %0, hi;\n\t}" : "=f"(f) : "r"(h2));
    return f;
}

// 4 e4m3 codes in a word against 4 activations
__device__ __forceinline__ float dot4(u32 w, float4 x, float acc) {
    const u32 lo = e4m3x2_to_f16x2(w), hi = e4m3x2_to_f16x2(w >> 16);
    acc = fmaf(f16_lo(lo), x.x, acc);
    acc = fmaf(f16_hi(lo), x.y, acc);
    acc = fmaf(f16_lo(hi), x.z, acc);
    return fmaf(f16_hi(hi), x.w, acc);
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xFFFFFFFFu, v, o);
    return v;
}

struct Task {
    uint4 w[WROWS][NCHUNK];
#if SCALE == 1
    float s[WROWS][NCHUNK];
#endif
};

// Issue the loads of task t (rows t*RPW ..; SwiGLU: and their up rows ROWS further on).
__device__ __forceinline__ void load_task(Task &task, int t, const unsigned char *__restrict__ w,
                                          const float *__restrict__ s, int lane) {
#pragma unroll
    for (int p = 0; p < RPW; ++p) {
        const int row = t * RPW + p;
#pragma unroll
        for (int h = 0; h < PAIR; ++h) {
            const int wrow = row + h * ROWS;
#pragma unroll
            for (int c = 0; c < NCHUNK; ++c) {
                const int col = c * 512 + lane * 16;
                const bool ok = row < ROWS && (K % 512 == 0 || col < K);
                task.w[p * PAIR + h][c] =
                    ok ? ld_stream(reinterpret_cast<const uint4 *>(w + (size_t)wrow * K + col)) : uint4{0u, 0u, 0u, 0u};
#if SCALE == 1
                task.s[p * PAIR + h][c] = ok ? __ldg(s + (wrow / 128) * KB + col / 128) : 0.0f;
#endif
            }
        }
    }
}

// The products of a loaded task (rows cur*RPW ..), reduced over the warp, and their epilogue (lane p: row p).
__device__ __forceinline__ void finish_task(const Task &task, int cur, const float *xs, const float *__restrict__ s,
                                            void *out, const u16 *residual, const u16 *__restrict__ addend, int lane,
                                            float limit) {
    float y[WROWS];
#pragma unroll
    for (int q = 0; q < WROWS; ++q) {
        float acc = 0.0f;
#pragma unroll
        for (int c = 0; c < NCHUNK; ++c) {
            const int col = c * 512 + lane * 16;
            if (K % 512 == 0 || col < K) {
                const float4 *xv = reinterpret_cast<const float4 *>(xs + col);
                const uint4 v = task.w[q][c];
                float part = dot4(v.x, xv[0], 0.0f);
                part = dot4(v.y, xv[1], part);
                part = dot4(v.z, xv[2], part);
                part = dot4(v.w, xv[3], part);
#if SCALE == 1
                acc = fmaf(part, task.s[q][c], acc);
#else
                acc += part;
#endif
            }
        }
        y[q] = warp_sum(acc);
    }
#pragma unroll
    for (int p = 0; p < RPW; ++p) {
        const int row = cur * RPW + p;
        if (lane != p || row >= ROWS) continue;
        float v = y[p * PAIR];
#if SCALE == 2
        v *= __ldg(s + row);
#endif
#if EPI == 2
        float u = y[p * PAIR + 1];
#if SCALE == 2
        u *= __ldg(s + row + ROWS);
#endif
        float act = v / (1.0f + __expf(-v));
#if HAS_LIMIT
        act = fminf(act, limit);
        u = fminf(fmaxf(u, -limit), limit);
#endif
        reinterpret_cast<u16 *>(out)[row] = to_bf16(act * u);
#elif EPI == 1
        // the reference adds in the stream's dtype: the projection's output is rounded first
        float o = bf16_to_float(residual[row]) + round_bf16(v);
#if ADD
        o += bf16_to_float(addend[row]);
#endif
        reinterpret_cast<u16 *>(out)[row] = to_bf16(o);
#else
#if OUT_F32
        reinterpret_cast<float *>(out)[row] = v;
#else
        reinterpret_cast<u16 *>(out)[row] = to_bf16(v);
#endif
#endif
    }
}

extern "C" __global__ void __launch_bounds__(THREADS)
gemv_decode(const u16 *__restrict__ x,        // [K] bf16
            const u16 *__restrict__ nw,       // norm weight: [K] (NORM 1), [GROUP] (NORM 2)
            const u16 *__restrict__ gate,     // [K] (NORM 2: the sigmoid gate)
            const unsigned char *__restrict__ w,  // [ROWS * PAIR, K] e4m3
            const float *__restrict__ s,      // [ceil(rows/128), KB] (SCALE 1) or [rows] (SCALE 2)
            void *out,                        // [ROWS] bf16 (fp32 with OUT_F32)
            const u16 *residual,              // [ROWS] (EPI 1; may be out itself)
            const u16 *__restrict__ addend,   // [ROWS] (EPI 1 with ADD)
            u16 *__restrict__ xn_out,         // [K] (WRITE_XN)
            int *__restrict__ count,          // launch counter
            float eps, float limit) {
    extern __shared__ __align__(16) float xs[];  // [K] the prologue's x, fp32
    __shared__ float partial[WARPS];
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int first = blockIdx.x * WARPS + warp, stride = gridDim.x * WARPS;

    Task a;
#if BUFFERS == 2
    Task b;
#endif
    if (first < TASKS) load_task(a, first, w, s, lane);
    // weights and scales do not depend on the previous kernel; everything below does
    asm volatile("griddepcontrol.launch_dependents;");
    asm volatile("griddepcontrol.wait;" ::: "memory");
    if (blockIdx.x == 0 && threadIdx.x == 0) atomicAdd(count, 1);

    // ---- prologue: x into shared memory, once per block
#if NORM == 1
    float ss = 0.0f;
    for (int k = threadIdx.x; k < K; k += THREADS) {
        const float v = bf16_to_float(x[k]);
        xs[k] = v;
        ss = fmaf(v, v, ss);
    }
    ss = warp_sum(ss);
    if (lane == 0) partial[warp] = ss;
    __syncthreads();
    ss = 0.0f;
#pragma unroll
    for (int i = 0; i < WARPS; ++i) ss += partial[i];
    const float rstd = __frcp_rn(__fsqrt_rn(__fdiv_rn(ss, (float)K) + eps));
    for (int k = threadIdx.x; k < K; k += THREADS) {
        const float v = round_bf16(round_bf16(xs[k] * rstd) * bf16_to_float(nw[k]));
        xs[k] = v;
#if WRITE_XN
        if (blockIdx.x == 0) xn_out[k] = to_bf16(v);
#endif
    }
#elif NORM == 2
    // groups of GROUP columns, 16 per thread: a group spans GROUP / 16 consecutive lanes
    for (int base = threadIdx.x * 16; base - threadIdx.x * 16 < K; base += THREADS * 16) {
        float v[16];
        float sq = 0.0f;
        const bool ok = base < K;
#pragma unroll
        for (int j = 0; j < 16; ++j) {
            v[j] = ok ? bf16_to_float(x[base + j]) : 0.0f;
            sq = fmaf(v[j], v[j], sq);
        }
#pragma unroll
        for (int o = 1; o < GROUP / 16; o <<= 1) sq += __shfl_xor_sync(0xFFFFFFFFu, sq, o);
        const float r = __frcp_rn(__fsqrt_rn(__fdiv_rn(sq, (float)GROUP) + eps));
        if (ok) {
#pragma unroll
            for (int j = 0; j < 16; ++j) {
                const float g = bf16_to_float(gate[base + j]);
                const float sig = 1.0f / (1.0f + __expf(-g));
                const float y = round_bf16(bf16_to_float(nw[(base + j) % GROUP]) * (v[j] * r) * sig);
                xs[base + j] = y;
#if WRITE_XN
                if (blockIdx.x == 0) xn_out[base + j] = to_bf16(y);
#endif
            }
        }
    }
#else
    for (int k = threadIdx.x; k < K; k += THREADS) {
        const float v = bf16_to_float(x[k]);
        xs[k] = v;
#if WRITE_XN
        if (blockIdx.x == 0) xn_out[k] = x[k];
#endif
    }
#endif
    __syncthreads();

    // ---- weight rows: a task's products, reduced over the warp; lane p finishes row p
#if BUFFERS == 2
    for (int t = first; t < TASKS; t += 2 * stride) {
        if (t + stride < TASKS) load_task(b, t + stride, w, s, lane);
        finish_task(a, t, xs, s, out, residual, addend, lane, limit);
        if (t + stride >= TASKS) break;
        if (t + 2 * stride < TASKS) load_task(a, t + 2 * stride, w, s, lane);
        finish_task(b, t + stride, xs, s, out, residual, addend, lane, limit);
    }
#else
    for (int t = first; t < TASKS; t += stride) {
        if (t != first) load_task(a, t, w, s, lane);
        finish_task(a, t, xs, s, out, residual, addend, lane, limit);
    }
#endif
}

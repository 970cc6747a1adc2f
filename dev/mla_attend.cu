// MLA decode attention over the latent cache, one split of the filled positions per block (lab kernel,
// dev/mla_attend_cuda.py). It writes the same partials as _mla_attend in solo/kernels/fused_mla.py, in the
// same layout, so FusedMLA's combine merges them: the question is whether a block that streams its chunk
// through a ring of bulk copies beats Triton's single pipelined block, which Nsight Compute shows
// latency-bound at 32K (docs/results/h200_ncu_mla_attend.txt). Measured (h200_mla_attend_cuda.log): correct,
// one token 25.3 us at 32K against Triton's 27.4; it is bound by its instructions on mma.sync (about one an
// SM a cycle, h200_ncu_mla_attend_cuda.txt), not by its loads: the next form is the warpgroup MMA.
//
// Block = one split of one token's 32 heads (blockIdx.x = token * SPLITS + split): 8 consumer warps and one
// producer warp. The producer copies each step's L positions (latent rows and rope rows, one bulk copy
// per row into padded rows: conflict-free shared-memory reads) into a ring of STAGES slots, the
// consumers wait on the slot's mbarrier and release it when done. Per step:
//   1. scores [32 heads x L] = q [32 x 576] . keys^T on the tensor cores (mma.m16n8k16, bf16 in, fp32
//      sums), K split over the 8 warps (each holds its q fragments in registers for the whole split),
//      the warps' partial sums reduced in shared memory in a fixed order;
//   2. online softmax, 8 threads per head: scaled, masked (past the split's end or the token's position),
//      running max and sum as _mla_attend keeps them; p rounded to bf16 for the values' product;
//   3. out [32 x 512] += p . values (the same latent rows) on the tensor cores, each warp 64 columns.
// Then each warp's columns and each head's max and sum are stored as _mla_attend stores them.
//
// Defines: HEADS (32), RANK (512), ROPE (64), SPLITS, MIN_CHUNK, BLOCK_M (rows of the partials' layout),
// NTOK (tokens, for the length), STAGES, PDL (0/1).

typedef unsigned int u32;
typedef unsigned short u16;
typedef unsigned long long u64;

#if HEADS != 32
#error "the lab kernel computes 32 heads (two 16-row MMA tiles) per block"
#endif
#define L 32                              // positions per step
#define CWARPS 8                          // consumer warps
#define PRODUCER CWARPS
#define THREADS ((CWARPS + 1) * 32)
#define QK (RANK + ROPE)
#define KSTEPS (QK / 16)                  // 16-column steps of the scores' product
#define LAT_STRIDE (RANK * 2 + 16)        // bytes per latent row in shared memory (padded)
#define ROPE_STRIDE (ROPE * 2 + 16)
#define LAT_BYTES (L * LAT_STRIDE)
#define STAGE_BYTES (L * LAT_STRIDE + L * ROPE_STRIDE)
#define RED_STRIDE (L + 4)                // floats per row of the scores' partials
#define P_STRIDE (L * 2 + 16)             // bytes per row of p (bf16)
#define DW (RANK / CWARPS)                // value columns per consumer warp
#define NT (DW / 8)                       // their n8 tiles
#define MAXK ((KSTEPS + CWARPS - 1) / CWARPS)
#define NEG_INF __int_as_float(0xff800000)

struct Smem {
    float red[CWARPS][HEADS][RED_STRIDE];
    float alpha[HEADS];
    u64 full[STAGES];
    u64 empty[STAGES];
    __align__(16) unsigned char p[HEADS * P_STRIDE];
};
#define RING_OFFSET ((sizeof(Smem) + 127) / 128 * 128)

__device__ __forceinline__ u32 smem_addr(const void *p) { return (u32)__cvta_generic_to_shared(p); }

__device__ __forceinline__ void mbar_wait(u32 bar, u32 parity) {
    asm volatile(
        "{\n.reg .pred p;\nWAIT_%=:\n"
        "mbarrier.try_wait.parity.shared::cta.b64 p, [%0], %1;\n"
        "@!p bra WAIT_%=;\n}\n" ::"r"(bar),
        "r"(parity)
        : "memory");
}

__device__ __forceinline__ void bulk_copy(u32 dst, const void *src, u32 bytes, u32 bar) {
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(dst),
                 "l"(src), "r"(bytes), "r"(bar)
                 : "memory");
}

__device__ __forceinline__ void mma_bf16(float *c, u32 a0, u32 a1, u32 a2, u32 a3, u32 b0, u32 b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

__device__ __forceinline__ void ldmatrix_x4_trans(u32 addr, u32 &r0, u32 &r1, u32 &r2, u32 &r3) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3)
                 : "r"(addr));
}

__device__ __forceinline__ u32 lds32(u32 addr) {
    u32 v;
    asm volatile("ld.shared.b32 %0, [%1];" : "=r"(v) : "r"(addr));
    return v;
}

// fp32 -> bf16 bits, nearest, ties to even (the reference's rounding; values here are finite)
__device__ __forceinline__ u32 bf16_bits(float f) {
    u32 b = __float_as_uint(f);
    return (b + 0x7FFFu + ((b >> 16) & 1u)) >> 16;
}

__device__ __forceinline__ void consumers_sync() { asm volatile("bar.sync 1, %0;" ::"n"(CWARPS * 32) : "memory"); }

extern "C" __global__ void __launch_bounds__(THREADS, 1)
    mla_attend(const u16 *__restrict__ q, const long long *__restrict__ positions, const u16 *__restrict__ latent,
               const u16 *__restrict__ rope, float *__restrict__ part, float *__restrict__ ml, int *__restrict__ counter,
               float scale) {
    extern __shared__ __align__(128) unsigned char smem_raw[];
    Smem &sm = *reinterpret_cast<Smem *>(smem_raw);
    unsigned char *ring = smem_raw + RING_OFFSET;
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    const int s = blockIdx.x % SPLITS, t = blockIdx.x / SPLITS;  // split, token (a 1-D grid of SPLITS x NTOK)
#if PDL
    asm volatile("griddepcontrol.wait;" ::: "memory");
    asm volatile("griddepcontrol.launch_dependents;");
#endif
    if (s == 0 && t == 0 && tid == 0) atomicAdd(counter, 1);
    long long top = -1;
#pragma unroll
    for (int i = 0; i < NTOK; ++i) top = positions[i] > top ? positions[i] : top;
    const int length = (int)top + 1;
    const int used = min((length + MIN_CHUNK - 1) / MIN_CHUNK, SPLITS);
    if (s >= used) return;  // the combine reads only the splits in use
    int chunk = (length + used - 1) / used;
    chunk = (chunk + L - 1) / L * L;
    const int start = s * chunk;
    const int end = min(start + chunk, length);
    const int steps = end > start ? (end - start + L - 1) / L : 0;
    const int row_pos = (int)positions[t];

    // zero the ring (a partly filled last step reads rows no copy wrote: they must be finite), then
    // order those writes before the bulk copies' (async proxy) and set up the barriers
    for (int i = tid; i < STAGES * STAGE_BYTES / 16; i += THREADS)
        reinterpret_cast<uint4 *>(ring)[i] = make_uint4(0u, 0u, 0u, 0u);
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
    if (tid == 0) {
        for (int b = 0; b < STAGES; ++b) {
            asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(smem_addr(&sm.full[b])));
            asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smem_addr(&sm.empty[b])), "n"(CWARPS));
        }
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    }
    __syncthreads();

    if (warp == PRODUCER) {
        for (int c = 0; c < steps; ++c) {
            const int stage = c % STAGES;
            if (c >= STAGES) mbar_wait(smem_addr(&sm.empty[stage]), ((c / STAGES) - 1) & 1);
            const int l0 = start + c * L;
            const int rows = min(L, end - l0);
            const u32 full = smem_addr(&sm.full[stage]);
            if (lane == 0)
                asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(full),
                             "r"((u32)(rows * (RANK * 2 + ROPE * 2)))
                             : "memory");
            __syncwarp();
            if (lane < rows) {
                const u32 slot = smem_addr(ring + stage * STAGE_BYTES);
                bulk_copy(slot + lane * LAT_STRIDE, latent + (long long)(l0 + lane) * RANK, RANK * 2, full);
                bulk_copy(slot + LAT_BYTES + lane * ROPE_STRIDE, rope + (long long)(l0 + lane) * ROPE, ROPE * 2, full);
            }
        }
        return;
    }

    // ---- consumers
    const int g = lane >> 2, cc = lane & 3;
    const int ks0 = warp * KSTEPS / CWARPS, ks1 = (warp + 1) * KSTEPS / CWARPS;
    // this warp's q fragments (rows m*16 + g (+8), columns k0 + 2cc (+1, +8, +9)) for its K steps
    u32 qa[MAXK][2][4];
    const u32 *qw = reinterpret_cast<const u32 *>(q + (long long)t * HEADS * QK);
#pragma unroll
    for (int i = 0; i < MAXK; ++i) {
        const int ks = ks0 + i;
#pragma unroll
        for (int m = 0; m < 2; ++m) {
            if (ks < ks1) {
                const int r = m * 16 + g, k = ks * 16 + 2 * cc;
                qa[i][m][0] = qw[(r * QK + k) >> 1];
                qa[i][m][1] = qw[((r + 8) * QK + k) >> 1];
                qa[i][m][2] = qw[(r * QK + k + 8) >> 1];
                qa[i][m][3] = qw[((r + 8) * QK + k + 8) >> 1];
            } else {
                qa[i][m][0] = qa[i][m][1] = qa[i][m][2] = qa[i][m][3] = 0u;
            }
        }
    }
    float acc[2][NT][4];
#pragma unroll
    for (int m = 0; m < 2; ++m)
#pragma unroll
        for (int n = 0; n < NT; ++n) acc[m][n][0] = acc[m][n][1] = acc[m][n][2] = acc[m][n][3] = 0.0f;
    // softmax role: head sr, columns 4 * sq .. + 3 of each step
    const int sr = tid >> 3, sq = tid & 7;
    float m_run = NEG_INF, l_run = 0.0f;

    for (int c = 0; c < steps; ++c) {
        const int stage = c % STAGES;
        mbar_wait(smem_addr(&sm.full[stage]), (c / STAGES) & 1);
        const u32 lat = smem_addr(ring + stage * STAGE_BYTES);
        const u32 rp = lat + LAT_BYTES;
        // 1. partial scores over this warp's K steps
        float sc[2][4][4];
#pragma unroll
        for (int m = 0; m < 2; ++m)
#pragma unroll
            for (int n = 0; n < 4; ++n) sc[m][n][0] = sc[m][n][1] = sc[m][n][2] = sc[m][n][3] = 0.0f;
#pragma unroll
        for (int i = 0; i < MAXK; ++i) {
            const int ks = ks0 + i;
            if (ks < ks1) {
                const int k = ks * 16 + 2 * cc;
#pragma unroll
                for (int n = 0; n < 4; ++n) {
                    const int pos = n * 8 + g;
                    u32 b0, b1;
                    if (k < RANK) {
                        b0 = lds32(lat + pos * LAT_STRIDE + k * 2);
                        b1 = lds32(lat + pos * LAT_STRIDE + (k + 8) * 2);
                    } else {
                        b0 = lds32(rp + pos * ROPE_STRIDE + (k - RANK) * 2);
                        b1 = lds32(rp + pos * ROPE_STRIDE + (k + 8 - RANK) * 2);
                    }
#pragma unroll
                    for (int m = 0; m < 2; ++m) mma_bf16(sc[m][n], qa[i][m][0], qa[i][m][1], qa[i][m][2], qa[i][m][3], b0, b1);
                }
            }
        }
#pragma unroll
        for (int m = 0; m < 2; ++m)
#pragma unroll
            for (int n = 0; n < 4; ++n) {
                const int r = m * 16 + g, col = n * 8 + 2 * cc;
                *reinterpret_cast<float2 *>(&sm.red[warp][r][col]) = make_float2(sc[m][n][0], sc[m][n][1]);
                *reinterpret_cast<float2 *>(&sm.red[warp][r + 8][col]) = make_float2(sc[m][n][2], sc[m][n][3]);
            }
        consumers_sync();
        // 2. online softmax: 8 threads per head, 4 positions each; the warps' sums in a fixed order
        {
            float4 v = *reinterpret_cast<const float4 *>(&sm.red[0][sr][4 * sq]);
#pragma unroll
            for (int w = 1; w < CWARPS; ++w) {
                const float4 u = *reinterpret_cast<const float4 *>(&sm.red[w][sr][4 * sq]);
                v.x += u.x;
                v.y += u.y;
                v.z += u.z;
                v.w += u.w;
            }
            float x[4] = {v.x * scale, v.y * scale, v.z * scale, v.w * scale};
            const int p0 = start + c * L + 4 * sq;
            float mx = NEG_INF;
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                const bool visible = (p0 + j < end) && (p0 + j <= row_pos);
                x[j] = visible ? x[j] : NEG_INF;
                mx = fmaxf(mx, x[j]);
            }
            mx = fmaxf(mx, __shfl_xor_sync(0xFFFFFFFFu, mx, 1));
            mx = fmaxf(mx, __shfl_xor_sync(0xFFFFFFFFu, mx, 2));
            mx = fmaxf(mx, __shfl_xor_sync(0xFFFFFFFFu, mx, 4));
            const float m_new = fmaxf(m_run, mx);
            const float m_safe = m_new == NEG_INF ? 0.0f : m_new;
            float sum = 0.0f;
            u32 pb[4];
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                const float p = __expf(x[j] - m_safe);
                sum += p;
                pb[j] = bf16_bits(p);
            }
            sum += __shfl_xor_sync(0xFFFFFFFFu, sum, 1);
            sum += __shfl_xor_sync(0xFFFFFFFFu, sum, 2);
            sum += __shfl_xor_sync(0xFFFFFFFFu, sum, 4);
            const float alpha = __expf(m_run - m_safe);
            l_run = l_run * alpha + sum;
            m_run = m_new;
            *reinterpret_cast<uint2 *>(sm.p + sr * P_STRIDE + 8 * sq) = make_uint2(pb[0] | (pb[1] << 16), pb[2] | (pb[3] << 16));
            if (sq == 0) sm.alpha[sr] = alpha;
        }
        consumers_sync();
        // 3. out = out * alpha + p . values, this warp's DW columns
        {
            float al[2][2];
#pragma unroll
            for (int m = 0; m < 2; ++m) {
                al[m][0] = sm.alpha[m * 16 + g];
                al[m][1] = sm.alpha[m * 16 + g + 8];
            }
#pragma unroll
            for (int m = 0; m < 2; ++m)
#pragma unroll
                for (int n = 0; n < NT; ++n) {
                    acc[m][n][0] *= al[m][0];
                    acc[m][n][1] *= al[m][0];
                    acc[m][n][2] *= al[m][1];
                    acc[m][n][3] *= al[m][1];
                }
            const u32 pbase = smem_addr(sm.p);
#pragma unroll
            for (int kk = 0; kk < L / 16; ++kk) {
                u32 pa[2][4];
#pragma unroll
                for (int m = 0; m < 2; ++m) {
                    const int r = m * 16 + g, k = kk * 16 + 2 * cc;
                    pa[m][0] = lds32(pbase + r * P_STRIDE + k * 2);
                    pa[m][1] = lds32(pbase + (r + 8) * P_STRIDE + k * 2);
                    pa[m][2] = lds32(pbase + r * P_STRIDE + (k + 8) * 2);
                    pa[m][3] = lds32(pbase + (r + 8) * P_STRIDE + (k + 8) * 2);
                }
                const int mat = lane >> 3, rr = lane & 7;
#pragma unroll
                for (int n = 0; n < NT; n += 2) {
                    // matrices: (positions 0-7, columns n), (8-15, n), (0-7, n + 1), (8-15, n + 1)
                    const int pos = kk * 16 + 8 * (mat & 1) + rr;
                    const int col = warp * DW + (n + (mat >> 1)) * 8;
                    u32 b00, b01, b10, b11;
                    ldmatrix_x4_trans(lat + pos * LAT_STRIDE + col * 2, b00, b01, b10, b11);
#pragma unroll
                    for (int m = 0; m < 2; ++m) {
                        mma_bf16(acc[m][n], pa[m][0], pa[m][1], pa[m][2], pa[m][3], b00, b01);
                        mma_bf16(acc[m][n + 1], pa[m][0], pa[m][1], pa[m][2], pa[m][3], b10, b11);
                    }
                }
            }
        }
        __syncwarp();
        if (lane == 0) asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(smem_addr(&sm.empty[stage])) : "memory");
    }

    // partials as _mla_attend stores them: rows t * HEADS + head of split s
    const long long row0 = (long long)s * BLOCK_M + (long long)t * HEADS;
#pragma unroll
    for (int m = 0; m < 2; ++m)
#pragma unroll
        for (int n = 0; n < NT; ++n) {
            const int r = m * 16 + g, col = warp * DW + n * 8 + 2 * cc;
            *reinterpret_cast<float2 *>(part + (row0 + r) * RANK + col) = make_float2(acc[m][n][0], acc[m][n][1]);
            *reinterpret_cast<float2 *>(part + (row0 + r + 8) * RANK + col) = make_float2(acc[m][n][2], acc[m][n][3]);
        }
    if (sq == 0) {
        ml[(row0 + sr) * 2] = m_run;
        ml[(row0 + sr) * 2 + 1] = l_run;
    }
}

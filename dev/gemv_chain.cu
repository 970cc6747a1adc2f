// Lab (dev/gemv_chain_probe.py): a chain of one-token FP8 GEMVs in ONE persistent launch, the weights
// streaming across the grid-wide waits between them.
//
// The question it answers: at a kernel boundary of the decode step every SM waits for all of the
// previous kernel (about 2-3 us a boundary in a chain of separate kernels under PDL), and HBM idles
// meanwhile, because a successor's blocks become resident only as the predecessor's exit and then hold
// only a few loads a lane. Here the blocks stay resident across the whole chain, and each warp streams
// its weights through its own ring of shared memory (cp.async, D steps of 1 KB ahead) in the order it
// will consume them, crossing the stage boundaries: while a warp waits for the previous stage's last
// block, its next stage's first D steps are already landing.
//
// Stage kinds (STAGE_* below, compiled into the kernel as templates): the KDA projections (RMSNorm
// prologue, store), the shared expert's gate_up (SwiGLU with clamp) and down (residual + addend). The
// arithmetic is gemv_decode.cu's for one token (its 16-byte weight loads as A fragments of m16n8k16
// products, x in f16 pairs from shared memory, block scales per 64-column step). A task's 8 rows are
// shared by a team of G_* warps of a block that split its K (1: one warp sums all of K), summed in warp
// order through shared memory; the sums' order is not gemv_decode's, so results agree with it to
// rounding, not bit for bit. Tasks go round-robin over the grid's teams, team-major over the blocks
// (see team()), so that the SMs share them evenly. Grid-wide wait between stages: per stage an arrival
// counter (release after the block's stores), acquire-polled by thread 0 of each block; the block last
// to leave resets the counters for the next launch.
//
// Measured (docs/performance.md section 0, thirteenth session, H100): it loses to the product's separate
// kernels under PDL (33.9 against 26.9 us a layer); its waits cost 0.8-2.4 us each
// (the chain with and without them).
//
// Defines: WARPS (per block), D (ring steps per warp), STAGES (stage descriptors in `desc`), G_QKV, G_GATE_UP,
// G_DOWN (the warps of a task per stage kind; each divides WARPS and the kind's K / 64), POLL_NS (a
// back-off in the wait's polling, 0: none), NOWAIT (a timing probe: no stage waits for the previous one,
// which the probe's stages, with inputs of their own, do not need: the streaming alone).

#include "step_common.cuh"

#define THREADS (WARPS * 32)
#ifndef POLL_NS
#define POLL_NS 0
#endif
#ifndef NOWAIT
#define NOWAIT 0
#endif
#ifndef G_QKV  // warps a task of each stage kind (they split its K)
#define G_QKV 1
#endif
#ifndef G_GATE_UP
#define G_GATE_UP 1
#endif
#ifndef G_DOWN
#define G_DOWN 1
#endif
#define SLOT 1024  // bytes of one warp step: 16 bytes a lane of the gate row, 16 of the up row
#define KMAX 4096

enum { STAGE_QKV = 0, STAGE_GATE_UP = 1, STAGE_DOWN = 2 };

struct Stage {
    const unsigned char *w;  // [rows * (1 + swiglu), K] e4m3
    const float *s;          // [ceil(rows * (1 + swiglu) / 128), K / 128] block scales
    const u16 *x;            // [K] bf16
    const u16 *nw;           // [K] RMSNorm weight (STAGE_QKV)
    u16 *out;                // [rows]
    const u16 *residual;     // [rows] (STAGE_DOWN)
    const u16 *addend;       // [rows] (STAGE_DOWN)
    int kind, k, rows, pad;
    float limit, eps;
};

struct Shared {
    u32 xh[KMAX / 2];
    float red[WARPS];
    float part[2][WARPS][2][8];  // per round parity, warp, gate/up, row: a K slice's sum
    Stage st[STAGES];
};

__device__ __forceinline__ u32 smem_addr(const void *p) { return (u32)__cvta_generic_to_shared(p); }

__device__ __forceinline__ void cp16(u32 dst, const void *src, bool ok) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(dst), "l"(src), "r"(ok ? 16 : 0) : "memory");
}
__device__ __forceinline__ void commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
template <int N>
__device__ __forceinline__ void wait_groups() {
    asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory");
}

// Warp teams: in a stage of kind K, a task (8 rows) is shared by team_of(K) consecutive warps of a block,
// each its slice of K (team_of(K) divides K / 64 and WARPS); the teams of the grid take the tasks
// round-robin, team-major over the blocks (team j of block b is team j * gridDim.x + b), so that the SMs
// share them evenly. The block's warps pass its rounds together (one barrier a round, for the sum).
__device__ __forceinline__ int team_of(int kind) {
    return kind == STAGE_QKV ? G_QKV : kind == STAGE_GATE_UP ? G_GATE_UP : G_DOWN;
}

struct Team {
    int id, count, member, spw;  // global team, teams in the grid, this warp's place in it, steps a warp
};

__device__ __forceinline__ Team team(const Stage &st, int warp) {
    const int g = team_of(st.kind);
    return Team{(warp / g) * (int)gridDim.x + (int)blockIdx.x, (WARPS / g) * (int)gridDim.x, warp % g, st.k / 64 / g};
}

// the team's n-th task of the stage, or -1
__device__ __forceinline__ int task_of(const Stage &st, const Team &tm, int n) {
    const int task = tm.id + n * tm.count;
    return task * 8 < st.rows ? task : -1;
}

// The issuing side of a warp: a cursor over (stage, the team's n-th task of it, step of the warp's slice),
// walked D steps ahead of the consuming side. Each step copies a lane's 16 bytes of row g (and of up row g).
struct Cursor {
    int stage, n, step;
    Team tm;
};

// the first stage from `stage` on in which the warp's team has a task
__device__ __forceinline__ void enter(const Shared &sm, Cursor &c, int stage, int warp) {
    for (c.stage = stage; c.stage < STAGES; ++c.stage) {
        c.tm = team(sm.st[c.stage], warp);
        if (task_of(sm.st[c.stage], c.tm, 0) >= 0) break;
    }
    c.n = 0;
    c.step = 0;
}

__device__ __forceinline__ void advance(const Shared &sm, Cursor &c, int warp) {
    if (++c.step < c.tm.spw) return;
    c.step = 0;
    if (task_of(sm.st[c.stage], c.tm, ++c.n) >= 0) return;
    enter(sm, c, c.stage + 1, warp);
}

// Issue the copies of the cursor's step into ring slot `slot` (a commit group always, empty past the end)
__device__ __forceinline__ void issue(const Shared &sm, const Cursor &c, unsigned char *ring, int slot, int lane) {
    if (c.stage < STAGES) {
        const Stage &st = sm.st[c.stage];
        const int task = task_of(st, c.tm, c.n);
        const int row = task * 8 + (lane >> 2);
        const int col = (c.tm.member * c.tm.spw + c.step) * 64 + (lane & 3) * 16;
        const bool ok = row < st.rows;
        const u32 dst = smem_addr(ring + slot * SLOT + lane * 16);
        cp16(dst, st.w + (size_t)(ok ? row : 0) * st.k + col, ok);
        if (st.kind == STAGE_GATE_UP) cp16(dst + 512, st.w + (size_t)(ok ? row + st.rows : 0) * st.k + col, ok);
    }
    commit();
}

// x -> xh (f16 pairs), RMSNorm'd for STAGE_QKV; every thread of the block
template <int K, bool NORM>
__device__ __forceinline__ void prologue(Shared &sm, const Stage &st) {
    constexpr int PIECES = (K / 8 + THREADS - 1) / THREADS;
    const int tid = threadIdx.x;
    uint4 xv[1][PIECES], nv[PIECES];
#pragma unroll
    for (int p = 0; p < PIECES; ++p) {
        const int i = p * THREADS + tid;
        const bool ok = i < K / 8;
        xv[0][p] = ok ? ld_fresh(st.x + i * 8) : uint4{0u, 0u, 0u, 0u};
        if (NORM) nv[p] = ok ? *reinterpret_cast<const uint4 *>(st.nw + i * 8) : uint4{0u, 0u, 0u, 0u};
    }
    float rstd[1] = {1.0f};
    if (NORM) block_rstd<1, PIECES, WARPS>(xv, reinterpret_cast<float(*)[WARPS]>(sm.red), K, st.eps, rstd);
#pragma unroll
    for (int p = 0; p < PIECES; ++p) {
        const int i = p * THREADS + tid;
        if (i >= K / 8) continue;
        float v[8];
#pragma unroll
        for (int q = 0; q < 4; ++q) {
            const u32 xq = word(xv[0][p], q);
            if (NORM) {
                const u32 nq = word(nv[p], q);
                v[2 * q] = rms_value(xq & 0xFFFFu, rstd[0], nq & 0xFFFFu);
                v[2 * q + 1] = rms_value(xq >> 16, rstd[0], nq >> 16);
            } else {
                v[2 * q] = bf16_to_float(xq & 0xFFFFu);
                v[2 * q + 1] = bf16_to_float(xq >> 16);
            }
        }
        *reinterpret_cast<uint4 *>(sm.xh + i * 4) =
            uint4{f16x2(v[0], v[1]), f16x2(v[2], v[3]), f16x2(v[4], v[5]), f16x2(v[6], v[7])};
    }
    __syncthreads();
}

// A stage's rounds for this block: each warp consumes its slice of its team's task from the ring, keeping
// D steps in flight (refilled from the cursor); the slices' sums meet in shared memory, summed in warp
// order by the team's first warp, whose 8 lanes run the epilogue.
template <int K, int KIND>
__device__ __forceinline__ void run_stage(Shared &sm, const Stage &st, unsigned char *ring, int &head, Cursor &cur,
                                          int warp, int lane) {
    constexpr int G = KIND == STAGE_QKV ? G_QKV : KIND == STAGE_GATE_UP ? G_GATE_UP : G_DOWN;
    constexpr int NSTEP = K / 64, KB = K / 128, SPW = NSTEP / G;
    static_assert(NSTEP % G == 0 && WARPS % G == 0, "a team splits K and the block evenly");
    constexpr bool SWIGLU = KIND == STAGE_GATE_UP;
    const int g = lane >> 2, t = lane & 3;
    const Team tm = team(st, warp);
    const int tasks = (st.rows + 7) / 8, rounds = (tasks + tm.count - 1) / tm.count;
    for (int n = 0; n < rounds; ++n) {
        const int task = task_of(st, tm, n);
        const int row = task * 8 + g;
        const bool row_ok = task >= 0 && row < st.rows;
        float acc = 0.0f, acc_up = 0.0f;
        if (task >= 0) {
            const float *srow = st.s + (size_t)(row_ok ? row / 128 : 0) * KB;
            const float *urow = st.s + (size_t)(row_ok ? (row + st.rows) / 128 : 0) * KB;
#pragma unroll 4
            for (int s = 0; s < SPW; ++s) {
                wait_groups<D - 1>();
                const unsigned char *slot = ring + head * SLOT;
                const uint4 v = *reinterpret_cast<const uint4 *>(slot + lane * 16);
                uint4 vu = uint4{0u, 0u, 0u, 0u};
                if (SWIGLU) vu = *reinterpret_cast<const uint4 *>(slot + 512 + lane * 16);
                const int step = tm.member * SPW + s;
                const int col = step * 64 + t * 16;
                const uint4 xa = *reinterpret_cast<const uint4 *>(sm.xh + col / 2);
                const uint4 xb = *reinterpret_cast<const uint4 *>(sm.xh + col / 2 + 4);
                const u32 xw[8] = {xa.x, xa.y, xa.z, xa.w, xb.x, xb.y, xb.z, xb.w};
                const u32 wv[4] = {v.x, v.y, v.z, v.w};
                const u32 uv[4] = {vu.x, vu.y, vu.z, vu.w};
                float c[4] = {0.0f, 0.0f, 0.0f, 0.0f}, d[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
                for (int j = 0; j < 4; ++j) {
                    const u32 a0 = e4m3x2_to_f16x2(wv[j]), a2 = e4m3x2_to_f16x2(wv[j] >> 16);
                    const u32 a1 = SWIGLU ? e4m3x2_to_f16x2(uv[j]) : 0u;
                    const u32 a3 = SWIGLU ? e4m3x2_to_f16x2(uv[j] >> 16) : 0u;
                    mma(j & 1 ? d : c, a0, a1, a2, a3, xw[2 * j], xw[2 * j + 1]);
                }
                // the slot refilled D steps ahead only after its values are used (each lane reads only
                // the 16-byte pieces it copied itself, so no warp barrier is needed)
                issue(sm, cur, ring, head, lane);
                advance(sm, cur, warp);
                head = head + 1 == D ? 0 : head + 1;
                const int kb = step / 2;
                acc = fmaf(c[0] + d[0], row_ok ? __ldg(srow + kb) : 0.0f, acc);
                if (SWIGLU) acc_up = fmaf(c[2] + d[2], row_ok ? __ldg(urow + kb) : 0.0f, acc_up);
            }
        }
        if (G > 1) {
            if (t == 0) {
                sm.part[n & 1][warp][0][g] = acc;
                sm.part[n & 1][warp][1][g] = acc_up;
            }
            __syncthreads();
            if (tm.member == 0 && t == 0) {
                acc = 0.0f;
                acc_up = 0.0f;
#pragma unroll
                for (int i = 0; i < G; ++i) {
                    acc += sm.part[n & 1][warp + i][0][g];
                    acc_up += sm.part[n & 1][warp + i][1][g];
                }
            }
        }
        if (tm.member == 0 && t == 0 && row_ok) {
            if (KIND == STAGE_GATE_UP) {
                float act = acc / (1.0f + __expf(-acc));
                act = fminf(act, st.limit);
                const float u = fminf(fmaxf(acc_up, -st.limit), st.limit);
                st.out[row] = to_bf16(act * u);
            } else if (KIND == STAGE_DOWN) {
                float sum = bf16_to_float(ld_fresh_u16(st.residual + row)) + round_bf16(acc);
                sum += bf16_to_float(ld_fresh_u16(st.addend + row));
                st.out[row] = to_bf16(sum);
            } else {
                st.out[row] = to_bf16(acc);
            }
        }
    }
}

__device__ __forceinline__ u32 ld_acquire(const int *p) {
    u32 v;
    asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
    return v;
}

extern "C" __global__ void __launch_bounds__(THREADS, 1)
gemv_chain(const Stage *__restrict__ desc, int *__restrict__ counters,  // [STAGES + 1] zeros between launches
           int *__restrict__ count) {                                   // launch counter
    extern __shared__ __align__(128) unsigned char smem_raw[];
    Shared &sm = *reinterpret_cast<Shared *>(smem_raw);
    unsigned char *rings = smem_raw + (sizeof(Shared) + 127) / 128 * 128;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    unsigned char *ring = rings + (size_t)warp * D * SLOT;

    for (int i = threadIdx.x; i < STAGES * (int)(sizeof(Stage) / 4); i += THREADS)
        reinterpret_cast<int *>(sm.st)[i] = reinterpret_cast<const int *>(desc)[i];
    __syncthreads();

    // the first D steps of the warp's stream, before anything this launch computes is needed
    Cursor cur;
    enter(sm, cur, 0, warp);
    for (int j = 0; j < D; ++j) {
        issue(sm, cur, ring, j, lane);
        advance(sm, cur, warp);
    }
    int head = 0;
    asm volatile("griddepcontrol.wait;" ::: "memory");
    if (blockIdx.x == 0 && threadIdx.x == 0) atomicAdd(count, 1);

    for (int s = 0; s < STAGES; ++s) {
        const Stage &st = sm.st[s];
        if (s > 0) {  // the previous stage's outputs, from every block
#if !NOWAIT
            if (threadIdx.x == 0)
                while ((int)ld_acquire(counters + s - 1) < (int)gridDim.x) {
#if POLL_NS
                    __nanosleep(POLL_NS);
#endif
                }
#endif
            __syncthreads();
        }
        if (s == STAGES - 1) asm volatile("griddepcontrol.launch_dependents;");
        switch (st.kind) {
        case STAGE_QKV:
            prologue<2560, true>(sm, st);
            run_stage<2560, STAGE_QKV>(sm, st, ring, head, cur, warp, lane);
            break;
        case STAGE_GATE_UP:
            prologue<2560, false>(sm, st);
            run_stage<2560, STAGE_GATE_UP>(sm, st, ring, head, cur, warp, lane);
            break;
        default:
            prologue<768, false>(sm, st);
            run_stage<768, STAGE_DOWN>(sm, st, ring, head, cur, warp, lane);
            break;
        }
        __syncthreads();  // the block's stores, then one release for the block
        if (threadIdx.x == 0) {
            __threadfence();
            atomicAdd(counters + s, 1);
        }
    }
    if (threadIdx.x == 0) {
        if (atomicAdd(counters + STAGES, 1) == (int)gridDim.x - 1) {  // every block is past every wait
            for (int s = 0; s <= STAGES; ++s) counters[s] = 0;
            __threadfence();
        }
    }
    wait_groups<0>();
}

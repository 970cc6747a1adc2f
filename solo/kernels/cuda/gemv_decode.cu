// FP8 GEMV of the decode step (one token) and of NEXTN verification (a few), with its neighbours fused
// in (solo/kernels/cuda_step.py).
//
// out[t, r] = epilogue(sum_k W[r, k] * prologue(x)[t, k] * scale) for NTOK <= 8 tokens. At batch size 1 a
// projection is a stream of weight bytes; what costs is everything around the stream. Here:
//   - each block computes the prologue (norm, gate, rounding) once into shared memory, with every
//     load of x issued before the first is used (a loop of dependent loads cost 5-10 us);
//   - a block task is 8 output rows (SwiGLU: 8 gate + 8 up rows) over all of K, K split evenly over
//     the block's warps; the grid is persistent (at most what fits at once), so the prologue is paid
//     once per block and the tasks spread to within one per block;
//   - products on the tensor cores: a lane's 16-byte load (16 e4m3 codes of one row) widens to eight
//     f16x2 registers (exact) that are exactly its A fragments of four m16n8k16 products, because
//     K is permuted consistently for W and x (a sum does not care about order): lane (g, t) takes row
//     g and columns 16t..16t+15 of each 64-column step; the x fragments come from shared memory in
//     the same order, every B column equal to x; fp32 accumulation; rows g + 8 of the product are
//     the SwiGLU up rows, or zero. About one instruction per weight byte instead of three. B column n
//     is token n's x (n < NTOK; the others repeat the last token and are never read back), so NTOK tokens
//     cost the same products and weight bytes as one: lane (g, t) ends with tokens 2t and 2t + 1;
//   - the block scale multiplies each 64-column step's fp32 partial, the row scale the row's sum;
//   - each warp keeps PF loads in flight, continuing into its next task, and the first task's
//     weights are loaded before griddepcontrol.wait: under programmatic dependent launch they stream
//     while the previous kernel finishes (weights do not depend on it; x does). A block lets the next
//     kernel launch when it starts its last task.
// Block 0 bumps the launch counter (start-up checks read it).
//
// LATE_WAIT: the inputs (x, gate) were written two or more kernels back, so they are final when this
// kernel may start (every kernel lets its successor launch only after its own griddepcontrol.wait):
// the blocks compute as soon as they are resident, while the previous kernel ends, and wait for it only
// at their end, so that this kernel still ends after it (the shared expert's gate_up reads x, written
// before the MoE kernel, and the shared down after it reads the MoE kernel's output).
//
// Hand-off (SIGNAL > 0): the tasks run in the order ROTATE, ROTATE + 1, ... (mod TASKS), and each block,
// once the rows of its last task among the first SIGNAL of that order are stored, makes them visible
// and adds 1 to *signal. A consumer that needs only those rows (the KDA recurrence needs q, k, v, f and
// b, not the output gate g) waits for min(grid, SIGNAL) signals instead of this kernel's end, and runs
// while the remaining tasks (g, ordered last) still stream.
//
// DYNAMIC (GemvLaunch.dynamic): a block's first two tasks are fixed (blockIdx.x and blockIdx.x + gridDim.x,
// so that the first one's weights can be loaded before the wait), every later one is taken from a
// counter (*dyn) as the block goes, so blocks that start early (under PDL they become resident as the
// previous kernel's blocks leave their SM) or stream faster take more tasks, and the grid ends together.
// Thread 0 takes the task after next at the start of each task (the atomic's latency hidden behind
// the products) and leaves it in a ring of three ids for the block's warps, whose loads of the next
// task's first steps need it during the current one. The block last to end resets the counter and the
// exit count (dyn[1]) for the next launch. A task's products and sums are those of the fixed order,
// so every result is the same bit for bit. Not with BULK, ROTATE, SIGNAL or LATE_WAIT.
//
// BULK (a lab variant, GemvLaunch.bulk): the weights stream into a ring of SLOTS task-sized slots of
// shared memory by bulk copies (cp.async.bulk, one per row, completing on the slot's mbarrier), instead
// of PF 16-byte loads per lane into registers: the bytes in flight per SM are bounded by shared memory
// (about 200 KB), not by registers (a lane's ring). Warp 0 fills the first SLOTS slots before
// griddepcontrol.wait and refills a slot once the block's warps have passed the task's barrier; the
// products, their order and so every result are those of the register path.
//
// L2_AHEAD (a lab variant, GemvLaunch.l2_ahead): the registers hold PF loads a lane (about 61 KB an SM), which may
// bound the stream where HBM's latency under load is long (the H200's KDA projections reach 67% of the copy
// bandwidth, the H100's 79%). So a block also asks the L2 for whole tasks' weights ahead with bulk
// prefetches (cp.async.bulk.prefetch.L2: no registers, no result): thread 0, before griddepcontrol.wait, for
// the block's first L2_AHEAD tasks; then (L2_LOOP) lane 31 of warp 0, as each task's sums are stored, for the
// task L2_AHEAD positions later (in the loop's head the ask made the build spill). A hint only:
// every product and result is the register path's.
//
// Defines: NTOK (tokens, 1..8; row strides of x, gate, out, residual, addend and xn_out are arguments),
// K (input width, multiple of 64), ROWS (output rows; SwiGLU: the gate rows, W holds
// [gate; up]), NORM (0 none, 1 RMSNorm over K, 2 gated per-group RMSNorm of GROUP <= 256), SCALE
// (1 block 128x128, 2 one per row), EPI (0 store, 1 residual (+ addend if ADD), 2 SwiGLU (+ clamp if
// HAS_LIMIT)), OUT_F32 (EPI 0: fp32 output), WRITE_XN (block 0 writes the prologue's x as bf16),
// WARPS (per block; divides K / 64), PF (loads in flight per lane; divides K / 64 / WARPS).

#include "step_common.cuh"

#define THREADS (WARPS * 32)
#define NSTEP (K / 64)           // 64-column steps
#define SPW (NSTEP / WARPS)      // steps per warp
#define KB ((K + 127) / 128)     // 128-column scale blocks
#define SWIGLU (EPI == 2)
#define TASKS ((ROWS + 7) / 8)   // block tasks of 8 rows
#define PIECES ((K / 8 + THREADS - 1) / THREADS)  // 8-element pieces of a token's x per thread
#define LIVE ((NTOK + 1) / 2)       // lanes t < LIVE hold tokens of the product (2t, 2t + 1)
#ifndef BULK
#define BULK 0
#endif
#ifndef ROTATE
#define ROTATE 0
#endif
#ifndef LATE_WAIT
#define LATE_WAIT 0
#endif
#ifndef SIGNAL
#define SIGNAL 0
#endif
#ifndef DYNAMIC
#define DYNAMIC 0
#endif
#ifndef L2_AHEAD
#define L2_AHEAD 0
#endif
#ifndef L2_LOOP
#define L2_LOOP 1
#endif
#if L2_AHEAD && (BULK || DYNAMIC)
#error "L2_AHEAD runs on the register path with the fixed tasks"
#endif
#if DYNAMIC && (BULK || ROTATE || SIGNAL || LATE_WAIT)
#error "DYNAMIC tasks run on the register path with the plain order and wait only"
#endif
// the task at position `seq` of the block tasks' order
#define TASK_AT(seq) (ROTATE ? ((seq) + ROTATE) % TASKS : (seq))
#if BULK
// a row's bytes in a slot: K + 64, so that rows g and g + 1 (lanes 4g..4g+7, one 8-lane phase of a
// 16-byte shared load) fall in opposite halves of the banks
#define RS (K + 64)
// SCALE_IN_SLOT (set by the host where the block scales' rows are whole, aligned 16-byte pieces): the
// task's row of block scales (SwiGLU: and its up rows') travels in the slot too, read from shared memory;
// beside a ring the L1 is 28 KB
#ifndef SCALE_IN_SLOT
#define SCALE_IN_SLOT 0
#endif
#if SCALE_IN_SLOT && (SCALE != 1 || KB % 4 || ROWS % 8)
#error "SCALE_IN_SLOT needs block scales in rows of whole 16-byte pieces and ROWS a multiple of 8"
#endif
#define WEIGHT_BYTES ((1 + SWIGLU) * 8 * RS)
#define SLOT_BYTES (WEIGHT_BYTES + (SCALE_IN_SLOT ? (1 + SWIGLU) * KB * 4 : 0))
#endif

__device__ __forceinline__ uint4 ld_vec(const void *p) { return *reinterpret_cast<const uint4 *>(p); }

struct Shared {
    u32 xh[NTOK][K / 2];                // the prologue's x as f16 pairs
    float part[2][WARPS][2][8][NTOK];   // per task parity, warp, gate/up, row, token: the K slices' sums
    float red[NTOK][WARPS];
#if DYNAMIC
    int ids[3];                         // a ring of the block's next task ids
#endif
#if BULK
    unsigned long long full[SLOTS];     // per slot: its task's bytes have landed
#endif
};
#define RING_OFFSET ((sizeof(Shared) + 127) / 128 * 128)

// ---- the prologue: x -> xh (f16 pairs), every load of every token issued before the first is used
__device__ __forceinline__ void prologue(Shared &sm, const u16 *__restrict__ x, int x_stride,
                                         const u16 *__restrict__ nw, const u16 *__restrict__ gate, int gate_stride,
                                         u16 *__restrict__ xn_out, int xn_stride, float eps) {
    const int tid = threadIdx.x;
    uint4 xv[NTOK][PIECES];
#if NORM == 1
    uint4 nv[PIECES];
#elif NORM == 2
    uint4 gv[NTOK][PIECES], nv[PIECES];
#endif
#pragma unroll
    for (int p = 0; p < PIECES; ++p) {
        const int i = p * THREADS + tid;
        const bool ok = i < K / 8;
#pragma unroll
        for (int r = 0; r < NTOK; ++r) {
            xv[r][p] = ok ? ld_fresh(x + (size_t)r * x_stride + i * 8) : uint4{0u, 0u, 0u, 0u};
#if NORM == 2
            gv[r][p] = ok ? ld_fresh(gate + (size_t)r * gate_stride + i * 8) : uint4{0u, 0u, 0u, 0u};
#endif
        }
#if NORM == 1
        nv[p] = ok ? ld_vec(nw + i * 8) : uint4{0u, 0u, 0u, 0u};
#elif NORM == 2
        nv[p] = ok ? ld_vec(nw + (i * 8) % GROUP) : uint4{0u, 0u, 0u, 0u};
#endif
    }
#if NORM == 1
    float rstd[NTOK];
    block_rstd<NTOK, PIECES, WARPS>(xv, sm.red, K, eps, rstd);
#endif
#pragma unroll
    for (int r = 0; r < NTOK; ++r) {
#pragma unroll
        for (int p = 0; p < PIECES; ++p) {
            const int i = p * THREADS + tid;
            float v[8];
            bf16x8_to_float(xv[r][p], v);
#if NORM == 1
#pragma unroll
            for (int q = 0; q < 4; ++q) {
                const u32 xq = word(xv[r][p], q), nq = word(nv[p], q);
                v[2 * q] = rms_value(xq & 0xFFFFu, rstd[r], nq & 0xFFFFu);
                v[2 * q + 1] = rms_value(xq >> 16, rstd[r], nq >> 16);
            }
#elif NORM == 2
            gated_rms_piece<GROUP>(v, gv[r][p], nv[p], eps);
#endif
            if (i < K / 8) {
                uint4 packed;
                packed.x = f16x2(v[0], v[1]);
                packed.y = f16x2(v[2], v[3]);
                packed.z = f16x2(v[4], v[5]);
                packed.w = f16x2(v[6], v[7]);
                *reinterpret_cast<uint4 *>(sm.xh[r] + i * 4) = packed;
#if WRITE_XN
                if (blockIdx.x == 0) {
                    *reinterpret_cast<uint4 *>(xn_out + (size_t)r * xn_stride + i * 8) = uint4{
                        bf16_pair(v[0], v[1]), bf16_pair(v[2], v[3]), bf16_pair(v[4], v[5]), bf16_pair(v[6], v[7])};
                }
#endif
            }
        }
    }
    __syncthreads();
}

// The weights of (task, warp step s): row g (and its up row) at columns 64 * (warp's first step + s) + 16 t.
__device__ __forceinline__ void issue(uint4 &gate_v, uint4 &up_v, const unsigned char *__restrict__ w, int task,
                                      int s, int warp, int lane) {
    const int row = task * 8 + (lane >> 2);
    const int col = (warp * SPW + s) * 64 + (lane & 3) * 16;
    const bool ok = row < ROWS;
    gate_v = ok ? ld_stream(w + (size_t)row * K + col) : uint4{0u, 0u, 0u, 0u};
#if SWIGLU
    up_v = ok ? ld_stream(w + (size_t)(row + ROWS) * K + col) : uint4{0u, 0u, 0u, 0u};
#endif
}

#if L2_AHEAD
// The weights of the task at position `seq` (its 8 rows; SwiGLU: and their up rows, 8 * K contiguous bytes
// each) asked of the L2; rows past ROWS are not asked for.
__device__ __forceinline__ void ask_l2(const unsigned char *__restrict__ w, int seq) {
    if (seq >= TASKS) return;
    const int task = TASK_AT(seq);
    const u32 bytes = (u32)((ROWS - task * 8 < 8 ? ROWS - task * 8 : 8) * K);
    asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(w + (size_t)task * 8 * K), "r"(bytes) : "memory");
#if SWIGLU
    asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(w + (size_t)(ROWS + task * 8) * K), "r"(bytes)
                 : "memory");
#endif
}
#endif

#if BULK
// The weight rows of the task at position `seq` (its 8 rows; SwiGLU: and their up rows) into ring slot `slot`, completing
// on the slot's mbarrier; called by every lane of warp 0: lane 0 arms the barrier, then lane r copies row
// r (SwiGLU: lane 8 + r its up row) and, with SCALE_IN_SLOT, lane 16 (and 17) the scale rows. Rows past
// ROWS are not copied (their products are zeroed).
__device__ __forceinline__ void fill_slot(unsigned char *ring, unsigned long long *full,
                                          const unsigned char *__restrict__ w, const float *__restrict__ s,
                                          int seq, int slot, int lane) {
    if (seq >= TASKS) return;
    const int task = TASK_AT(seq);
    const int rows = ROWS - task * 8 < 8 ? ROWS - task * 8 : 8;
    const u32 bar = smem_addr(&full[slot]);
    const u32 dst = smem_addr(ring + (size_t)slot * SLOT_BYTES);
    if (lane == 0) bar_expect_bytes(bar, (u32)((1 + SWIGLU) * (rows * K + (SCALE_IN_SLOT ? KB * 4 : 0))));
    __syncwarp();
#if SCALE_IN_SLOT
    if (lane == 16 || (SWIGLU && lane == 17)) {  // the 8 rows (and their up rows) share one row of scales
        const float *src = s + (size_t)((lane == 16 ? task * 8 : ROWS + task * 8) / 128) * KB;
        bulk_to_shared(dst + WEIGHT_BYTES + (lane - 16) * KB * 4, src, (u32)(KB * 4), bar);
    }
#endif
    const int r = lane & 7;
    if (lane < 8 * (1 + SWIGLU) && r < rows) {
        const size_t src_row = (size_t)(lane < 8 ? 0 : ROWS) + task * 8 + r;
        bulk_to_shared(dst + lane * RS, w + src_row * K, (u32)K, bar);
    }
}
#endif

// MIN_BLOCKS: a variant (hand-off, late wait) kept to the product's blocks per SM (its registers capped)
#ifdef MIN_BLOCKS
#define GEMV_BOUNDS __launch_bounds__(THREADS, MIN_BLOCKS)
#else
#define GEMV_BOUNDS __launch_bounds__(THREADS)
#endif

extern "C" __global__ void GEMV_BOUNDS
gemv_decode(const u16 *__restrict__ x,            // [NTOK, K] bf16 (rows x_stride apart)
            const u16 *__restrict__ nw,           // norm weight: [K] (NORM 1), [GROUP] (NORM 2)
            const u16 *__restrict__ gate,         // [NTOK, K] (NORM 2: the sigmoid gate)
            const unsigned char *__restrict__ w,  // [ROWS * (1 + SWIGLU), K] e4m3
            const float *__restrict__ s,          // [ceil(rows / 128), KB] (SCALE 1) or [rows] (SCALE 2)
            void *out,                            // [NTOK, ROWS] bf16 (fp32 with OUT_F32)
            const u16 *residual,                  // [NTOK, ROWS] (EPI 1; may be out itself)
            const u16 *__restrict__ addend,       // [NTOK, ROWS] (EPI 1 with ADD)
            u16 *__restrict__ xn_out,             // [NTOK, K] (WRITE_XN)
            int *__restrict__ count,              // launch counter
            float eps, float limit, int x_stride, int gate_stride, int out_stride, int residual_stride,
            int addend_stride, int xn_stride,
            int *__restrict__ signal,             // SIGNAL: the hand-off counter
            int *__restrict__ dyn) {              // DYNAMIC: [next task, blocks ended], zeros between launches
    extern __shared__ __align__(16) unsigned char smem_raw[];
    Shared &sm = *reinterpret_cast<Shared *>(smem_raw);
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int g = lane >> 2, t = lane & 3;
    const u32 *xrow = sm.xh[g < NTOK ? g : NTOK - 1];  // this lane's B column: token g

    int seq = blockIdx.x;  // this block's position in the tasks' order
#if BULK
    unsigned char *ring = smem_raw + RING_OFFSET;
    if (warp == 0) {
        if (lane == 0) {
            for (int b = 0; b < SLOTS; ++b)
                asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(smem_addr(&sm.full[b])));
            asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
        }
        __syncwarp();
        for (int j = 0; j < SLOTS; ++j) fill_slot(ring, sm.full, w, s, seq + j * gridDim.x, j, lane);
    }
#else
    uint4 ring[PF], ring_up[PF];
#pragma unroll
    for (int s0 = 0; s0 < PF; ++s0)
        if (seq < TASKS) issue(ring[s0], ring_up[s0], w, TASK_AT(seq), s0, warp, lane);
#endif
#if L2_AHEAD
    if (threadIdx.x == 0)
        for (int j = 0; j < L2_AHEAD; ++j) ask_l2(w, seq + j * (int)gridDim.x);
#endif
    // the weights do not depend on the previous kernel; everything below does (LATE_WAIT: not on it)
#if !LATE_WAIT
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
    if (blockIdx.x == 0 && threadIdx.x == 0) atomicAdd(count, 1);
#if DYNAMIC
    int ring_next = 1;  // where the next task's id is (the prologue's barrier publishes the first)
    if (threadIdx.x == 0) sm.ids[1] = seq + (int)gridDim.x;
#endif
    prologue(sm, x, x_stride, nw, gate, gate_stride, xn_out, xn_stride, eps);

    for (int parity = 0, j = 0, next = 0; seq < TASKS; seq = next, parity ^= 1, ++j) {
        const int task = TASK_AT(seq);
#if DYNAMIC
        next = sm.ids[ring_next];
        int after_next = TASKS;  // thread 0: the task after next, stored before this task's barrier
        if (threadIdx.x == 0 && next < TASKS) after_next = 2 * (int)gridDim.x + atomicAdd(dyn, 1);
#else
        next = seq + gridDim.x;  // (a position in the order)
#endif
        if (next >= TASKS) asm volatile("griddepcontrol.launch_dependents;");  // this block's last task
#if BULK
        bar_wait_parity(smem_addr(&sm.full[j % SLOTS]), (u32)(j / SLOTS) & 1u);
        const unsigned char *slot_base = ring + (size_t)(j % SLOTS) * SLOT_BYTES;
        const unsigned char *slot_row = slot_base + g * RS;
#if SCALE_IN_SLOT
        const float *slot_scales = reinterpret_cast<const float *>(slot_base + WEIGHT_BYTES);
#endif
        const bool row_ok = task * 8 + g < ROWS;
#endif
        // tokens 2t and 2t + 1 of gate row g (acc) and up row g (acc_up)
        float acc[2] = {0.0f, 0.0f}, acc_up[2] = {0.0f, 0.0f};
#pragma unroll
        for (int st = 0; st < SPW; ++st) {
            const int col = (warp * SPW + st) * 64 + t * 16;
#if BULK
            const uint4 v = row_ok ? *reinterpret_cast<const uint4 *>(slot_row + col) : uint4{0u, 0u, 0u, 0u};
#if SWIGLU
            const uint4 vu = row_ok ? *reinterpret_cast<const uint4 *>(slot_row + 8 * RS + col) : uint4{0u, 0u, 0u, 0u};
#endif
#else
            const uint4 v = ring[st % PF];
#if SWIGLU
            const uint4 vu = ring_up[st % PF];
#endif
            // keep PF loads in flight: this task's step st + PF, else the next task's first steps
            if (st + PF < SPW)
                issue(ring[st % PF], ring_up[st % PF], w, task, st + PF, warp, lane);
            else if (next < TASKS)
                issue(ring[st % PF], ring_up[st % PF], w, TASK_AT(next), st + PF - SPW, warp, lane);
#endif
            const uint4 xa = *reinterpret_cast<const uint4 *>(xrow + col / 2);
            const uint4 xb = *reinterpret_cast<const uint4 *>(xrow + col / 2 + 4);
            const u32 xw[8] = {xa.x, xa.y, xa.z, xa.w, xb.x, xb.y, xb.z, xb.w};
            const u32 wv[4] = {v.x, v.y, v.z, v.w};
#if SWIGLU
            const u32 uv[4] = {vu.x, vu.y, vu.z, vu.w};
#endif
            float c[4] = {0.0f, 0.0f, 0.0f, 0.0f}, d[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                const u32 a0 = e4m3x2_to_f16x2(wv[j]), a2 = e4m3x2_to_f16x2(wv[j] >> 16);
#if SWIGLU
                const u32 a1 = e4m3x2_to_f16x2(uv[j]), a3 = e4m3x2_to_f16x2(uv[j] >> 16);
#else
                const u32 a1 = 0u, a3 = 0u;
#endif
                mma(j & 1 ? d : c, a0, a1, a2, a3, xw[2 * j], xw[2 * j + 1]);
            }
#if SCALE == 1
            const int row = task * 8 + g;
            const int kb = ((warp * SPW + st) * 64) / 128;
#if BULK && SCALE_IN_SLOT
            const float sg = row < ROWS ? slot_scales[kb] : 0.0f;
#else
            const float sg = row < ROWS ? __ldg(s + (row / 128) * KB + kb) : 0.0f;
#endif
            acc[0] = fmaf(c[0] + d[0], sg, acc[0]);
            if (NTOK > 1) acc[1] = fmaf(c[1] + d[1], sg, acc[1]);
#if SWIGLU
#if BULK && SCALE_IN_SLOT
            const float su = row < ROWS ? slot_scales[KB + kb] : 0.0f;
#else
            const float su = row < ROWS ? __ldg(s + ((row + ROWS) / 128) * KB + kb) : 0.0f;
#endif
            acc_up[0] = fmaf(c[2] + d[2], su, acc_up[0]);
            if (NTOK > 1) acc_up[1] = fmaf(c[3] + d[3], su, acc_up[1]);
#endif
#else
            acc[0] += c[0] + d[0];
            if (NTOK > 1) acc[1] += c[1] + d[1];
#if SWIGLU
            acc_up[0] += c[2] + d[2];
            if (NTOK > 1) acc_up[1] += c[3] + d[3];
#endif
#endif
        }
        // the K slices of the block's warps, summed in warp order; lanes t < LIVE hold rows g
        if (t < LIVE) {
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const int tok = 2 * t + h;
                if (tok < NTOK) {
                    sm.part[parity][warp][0][g][tok] = acc[h];
                    sm.part[parity][warp][1][g][tok] = acc_up[h];
                }
            }
        }
#if DYNAMIC
        const int ring_after = ring_next == 2 ? 0 : ring_next + 1;
        if (threadIdx.x == 0) sm.ids[ring_after] = after_next < TASKS ? after_next : TASKS;
        ring_next = ring_after;
#endif
        __syncthreads();
#if BULK
        if (warp == 0) {  // every warp has read this task's slot: refill it, SLOTS tasks ahead
            asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
            fill_slot(ring, sm.full, w, s, seq + SLOTS * gridDim.x, j % SLOTS, lane);
        }
#endif
        if (warp == 0) {
#if L2_AHEAD && L2_LOOP
            if (lane == 31) ask_l2(w, seq + L2_AHEAD * (int)gridDim.x);  // (lane 31 stores no sum)
#endif
#pragma unroll
            for (int tok0 = 0; tok0 < NTOK; tok0 += 4) {
                const int r8 = lane & 7, tok = tok0 + (lane >> 3);
                const int row = task * 8 + r8;
                if (tok >= NTOK || row >= ROWS) continue;
                float y = 0.0f, u = 0.0f;
#pragma unroll
                for (int i = 0; i < WARPS; ++i) {
                    y += sm.part[parity][i][0][r8][tok];
                    u += sm.part[parity][i][1][r8][tok];
                }
#if SCALE == 2
                y *= __ldg(s + row);
#if SWIGLU
                u *= __ldg(s + row + ROWS);
#endif
#endif
                const size_t o = (size_t)tok * out_stride + row;
#if SWIGLU
                float act = y / (1.0f + __expf(-y));
#if HAS_LIMIT
                act = fminf(act, limit);
                u = fminf(fmaxf(u, -limit), limit);
#endif
                reinterpret_cast<u16 *>(out)[o] = to_bf16(act * u);
#elif EPI == 1
                // the reference adds in the stream's dtype: the projection's output is rounded first
                float sum = bf16_to_float(ld_fresh_u16(residual + (size_t)tok * residual_stride + row)) + round_bf16(y);
#if ADD
                sum += bf16_to_float(ld_fresh_u16(addend + (size_t)tok * addend_stride + row));
#endif
                reinterpret_cast<u16 *>(out)[o] = to_bf16(sum);
#elif OUT_F32
                reinterpret_cast<float *>(out)[o] = y;
#else
                reinterpret_cast<u16 *>(out)[o] = to_bf16(y);
#endif
            }
#if SIGNAL
            // the block's last task among the first SIGNAL: its rows (warp 0 stored them) made visible
            // to the whole GPU, then one signal
            if (seq < SIGNAL && next >= SIGNAL) {
                __threadfence();
                __syncwarp();
                if (lane == 0) atomicAdd(signal, 1);
            }
#endif
        }
    }
#if LATE_WAIT
    asm volatile("griddepcontrol.wait;" ::: "memory");  // (this kernel ends after the previous one)
#endif
#if DYNAMIC
    // every block's last take is done before it counts itself ended: the last one resets for the next launch
    if (threadIdx.x == 0 && atomicAdd(dyn + 1, 1) == (int)gridDim.x - 1) {
        dyn[0] = 0;
        dyn[1] = 0;
    }
#endif
}

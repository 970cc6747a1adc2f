// One token's KDA layer front in one launch: RMSNorm, the q|k|v|f|g|b projection (FP8, 128x128 block
// scales), the short convolutions, the gates and the delta-rule recurrence (solo/kernels/cuda_kda.py). The H100's
// product with RING 3 and GLAST (-41 us a decode step at 32K against the GEMV + Triton recurrence it replaces; its
// register builds lost: docs/performance.md section 0).
//
// Why: the decode step runs the projection (a GEMV over every SM) and then the recurrence (a kernel per head)
// with a grid-wide boundary between them, though everything the recurrence of a head needs is that head's 641
// rows. Here SPLIT blocks own one head: block j computes the rows of value columns [j CH, (j + 1) CH) of v and
// g, a quarter of q, k and f, and the b row; the head's blocks exchange q, k and the decay (a cluster's
// distributed shared memory, or with XCHG global memory and counters) and every block runs the recurrence on
// its [DK, CH] slice of the head's state. The state slice is copied into shared memory before the wait for the
// previous kernel, with the first PF steps of weights.
//
// The stream: a block's tasks are 16 rows each ([q0 q1 k0 k1 v0 v1 f0 f1 g0 g1 b]: 2 x 16 rows of each part,
// then the b row alone), K split over the WARPS warps (SPW 64-column steps a warp), each warp keeping PF steps'
// loads in flight across tasks (PF = TA tasks' steps; the weights do not depend on the previous kernel, so
// the first PF are issued before griddepcontrol.wait). A lane's 16-byte load of row g and one of row g + 8
// are the A fragments of four m16n8k16 products (gemv_decode.cu's scheme: K permuted consistently for W and
// x); fp32 sums, the block scale per 64-column step, the warps' slices summed in warp order, rounded to bf16
// as the reference stores the projection (and stored to proj, whose g rows the output projection reads).
//
// Defines: K (hidden, a multiple of 64 * WARPS), H (heads), DK (head dim = value dim), SPLIT (blocks a head,
// the cluster's size; DK / SPLIT = 32), WARPS, TA (tasks' loads in flight a lane: 1 or 2), L2A (tasks asked
// of the L2 beyond them), RING (task slots of shared memory filled by bulk copies instead of the registers' loads),
// MIN_BLOCKS (the build's blocks an SM), XCHG (1: the exchange through global memory
// and counters, no cluster: the grid must be one wave), SAFE_GATE, LAZY (the state lives in slot
// source - 1 of the history when the int32 *source is not 0), GLAST (with a ring: the g tasks, which only the output
// projection reads, after the exchange and the recurrence, their slots filled meanwhile; the same bits), OPROJ (below:
// HID, OSL; a lab build, it lost 7-21 us), L2O (1: after the b task, 2: before the wait, each block asks the L2 for its
// share of l2_bytes at l2w, the weights of the next kernel (the output projection's), which cannot become resident
// beside the front's blocks to load them itself; a hint, no result changes).
//
// OPROJ (thirty-third session; with XCHG and RING): the layer's output projection inside the same launch. Block b owns
// output rows [OR b, OR (b + 1)) of o_proj (OR = HID / (H SPLIT): 20 at Ling's shape); their weights stream into the
// ring's slots as the projection's last tasks free them (fill_slot's tasks NT, NT + 1, ...), so HBM keeps streaming
// through the exchange and the recurrence. After its recurrence a block publishes its o (and, before, its g rows),
// every block waits for all (a grid-wide count: the grid is one wave), computes the gated per-head RMSNorm of all of
// o into shared memory (gemv_decode.cu's NORM 2 prologue, the same operations in the same order) and its rows' sums,
// each K slice of OSL (the output projection GEMV's warps) summed as that GEMV sums it, then adds the residual (x,
// which every block has read before the wait) like its EPI 1: the same bf16 bits as the two launches it replaces.

#include "step_common.cuh"

#define D (H * DK)
#define CH (DK / SPLIT)           // a block's channels of each part
#define THREADS (WARPS * 32)
#define NSTEP (K / 64)
#define SPW (NSTEP / WARPS)       // 64-column steps a warp, per task
#define KB (K / 128)              // 128-column scale blocks
#define NT 11                     // tasks a block: 2 of each of q k v f g, then b
#define PF (TA * SPW)             // steps in flight a lane
#define PIECES ((K / 8 + THREADS - 1) / THREADS)
#ifndef MIN_BLOCKS
#define MIN_BLOCKS 1
#endif
#ifndef L2A
#define L2A 0
#endif
#ifndef RING
#define RING 0
#endif
#if RING
// a slot holds one task's 16 rows, each K + 64 bytes apart so that rows g and g + 1 (one 8-lane phase of a 16-byte
// shared load) fall in opposite halves of the banks (gemv_decode.cu's BULK layout)
#define RS (K + 64)
#define SLOT (16 * RS)
#endif

#ifndef OPROJ
#define OPROJ 0
#endif
#ifndef GLAST
#define GLAST 0
#endif
#ifndef L2O
#define L2O 0
#endif
#if GLAST && !RING
#error "GLAST: the g tasks last, with a ring"
#endif
// the task at position pos of the block's stream (GLAST: q k v f, b, then the g tasks after the recurrence)
#define TASK_OF(pos) (GLAST ? ((pos) < NT - 3 ? (pos) : (pos) == NT - 3 ? NT - 1 : (pos) - 1) : (pos))
#if OPROJ
#define OR (HID / (H * SPLIT))          // output projection rows a block
#define RS2 (D + 64)                    // a row's bytes in a slot (opposite halves of the banks for rows g, g + 1)
#define ORPS (SLOT / RS2)               // rows a slot
#define OSLOTS ((OR + ORPS - 1) / ORPS) // slots they fill: ring tasks NT .. NT + OSLOTS - 1
#define OCH ((OR + 15) / 16)            // 16-row products
#define OPIECES ((D / 8 + THREADS - 1) / THREADS)
#define OSTEPS (D / 64 / OSL)           // 64-column steps a K slice
#if !XCHG || RING < OSLOTS || HID % (H * SPLIT) || (D / 64) % OSL || THREADS % 16 || DK > 256 || OR > 32
#error "OPROJ: the global exchange, a ring of OSLOTS or more, HID a multiple of the blocks, OSL dividing D / 64"
#endif
#endif

#if CH != 32 || NSTEP % WARPS || K % 128 || WARPS < 8 || (TA != 1 && TA != 2)
#error "kda_front.cu: DK / SPLIT must be 32, K / 64 a multiple of WARPS (>= 8), K a multiple of 128, TA 1 or 2"
#endif

struct Shared {
    u32 xh[K / 2];                 // the normalised x as f16 pairs
    float part[2][WARPS][2][8];    // per task parity, warp, rows g / g + 8, row: the K slices' sums
    float red[1][WARPS];
    float proj[NT * 16];           // this block's projected rows (bf16 values): q k v f g chunks, then b
    float q[DK], k[DK], decay[DK]; // the head's, exchanged: conv + SiLU of q and k, exp(gate)
    float v[CH];
    float sums[2];                 // sums of squares of q and k
    float part_kv[8][CH], part_o[8][CH];
    __align__(16) float state[DK][CH];  // this block's slice of the head's state
#if RING
    unsigned long long full[RING];      // per ring slot: its task's rows have landed
#endif
#if OPROJ
    __align__(16) u32 oh[D / 2];        // the gated RMSNorm of the whole o, as f16 pairs (read as uint4)
    float opart[OSL][OCH * 16];         // per K slice, row: the output projection's sums
#endif
};

__device__ __forceinline__ void st_cluster(const float *local, u32 rank, float v) {
    u32 remote;
    asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(remote) : "r"(smem_addr(local)), "r"(rank));
    asm volatile("st.shared::cluster.f32 [%0], %1;" ::"r"(remote), "f"(v) : "memory");
}

// the first row of task `task` of head h's block j (task 10: the b row)
__device__ __forceinline__ int task_row(int task, int h, int j) {
    return task < 10 ? (task >> 1) * D + h * DK + j * CH + (task & 1) * 16 : 5 * D + h;
}

// The weights of (task, warp step st): rows g and g + 8 of the task at columns 64 * (warp's first step + st) + 16 t.
__device__ __forceinline__ void issue(uint4 &a, uint4 &b, const unsigned char *__restrict__ w, int task, int st,
                                      int h, int j, int warp, int lane) {
    const int g = lane >> 2, t = lane & 3;
    const int col = (warp * SPW + st) * 64 + t * 16;
    const int row = task_row(task, h, j) + g;
    const bool lo = task < 10 || g == 0, hi = task < 10;
    a = lo ? ld_stream(w + (size_t)row * K + col) : uint4{0u, 0u, 0u, 0u};
    b = hi ? ld_stream(w + (size_t)(row + 8) * K + col) : uint4{0u, 0u, 0u, 0u};
}

// One 64-column step's products of two rows (lane (g, t): va of row g, vb of row g + 8, columns 16t..16t+15 of the
// step at col) with x's f16 pairs in xh (gemv_decode.cu's scheme): c0 and c1 hold the even and odd k-chunks' sums,
// rows g in [0], g + 8 in [2].
__device__ __forceinline__ void step_products(const uint4 &va, const uint4 &vb, const u32 *xh, int col, float (&c0)[4],
                                              float (&c1)[4]) {
    const uint4 xa = *reinterpret_cast<const uint4 *>(xh + col / 2);
    const uint4 xb = *reinterpret_cast<const uint4 *>(xh + col / 2 + 4);
    const u32 xw[8] = {xa.x, xa.y, xa.z, xa.w, xb.x, xb.y, xb.z, xb.w};
    const u32 wa[4] = {va.x, va.y, va.z, va.w}, wb[4] = {vb.x, vb.y, vb.z, vb.w};
#pragma unroll
    for (int q = 0; q < 4; ++q) {
        const u32 a0 = e4m3x2_to_f16x2(wa[q]), a2 = e4m3x2_to_f16x2(wa[q] >> 16);
        const u32 a1 = e4m3x2_to_f16x2(wb[q]), a3 = e4m3x2_to_f16x2(wb[q] >> 16);
        mma(q & 1 ? c1 : c0, a0, a1, a2, a3, xw[2 * q], xw[2 * q + 1]);
    }
}

// L2A > 0: the registers hold TA tasks' loads (about 41 KB an SM at TA 1), too few to stream at the copy rate from
// HBM; a task's 16 rows are 40 KB in one piece, so thread 0 also asks the L2 for the task L2A beyond the registers'
// reach, one bulk prefetch (no registers, a hint: no result changes).
__device__ __forceinline__ void ask_l2_task(const unsigned char *__restrict__ w, int task, int h, int j) {
    if (task >= NT) return;
    const u32 bytes = (u32)((task < NT - 1 ? 16 : 1) * K);
    asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(w + (size_t)task_row(task, h, j) * K), "r"(bytes)
                 : "memory");
}

// L2O: this block's share of the l2_bytes at l2w (one bulk prefetch: a hint)
__device__ __forceinline__ void ask_l2_share(const unsigned char *l2w, int l2_bytes) {
    const int share = (l2_bytes / (int)gridDim.x + 15) / 16 * 16, first = (int)blockIdx.x * share;
    const int n = min(share, l2_bytes - first);
    if (n > 0) asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(l2w + first), "r"(n) : "memory");
}

#if RING
// RING > 0: the weights stream through RING task-sized slots of shared memory, each filled by 16 bulk copies (a row
// each, completing on the slot's mbarrier) instead of the registers' loads: RING x 41 KB in flight a block, no
// registers held (the register path holds 41 KB an SM at TA 1). Warp 0 fills the first RING slots before the wait
// and refills a slot with the task RING later once every warp has read it. Same products, order and results.
__device__ __forceinline__ void fill_slot(unsigned char *ring, unsigned long long *full,
                                          const unsigned char *__restrict__ w, int pos, int h, int j, int lane,
                                          const unsigned char *__restrict__ ow) {
#if OPROJ
    if (pos >= NT && pos < NT + OSLOTS) {  // piece p of this block's output projection rows
        const int p = pos - NT, first = p * ORPS, rows = min(ORPS, OR - first);
        const u32 bar = smem_addr(&full[pos % RING]);
        const u32 dst = smem_addr(ring + (size_t)(pos % RING) * SLOT);
        if (lane == 0) bar_expect_bytes(bar, (u32)(rows * D));
        __syncwarp();
        if (lane < rows) bulk_to_shared(dst + lane * RS2, ow + (size_t)(blockIdx.x * OR + first + lane) * D, (u32)D, bar);
        return;
    }
#endif
    if (pos >= NT) return;
    const int task = TASK_OF(pos);  // (the slot is the position's; the rows are its task's)
    const int rows = task < NT - 1 ? 16 : 1;
    const u32 bar = smem_addr(&full[pos % RING]);
    const u32 dst = smem_addr(ring + (size_t)(pos % RING) * SLOT);
    if (lane == 0) bar_expect_bytes(bar, (u32)(rows * K));
    __syncwarp();
    if (lane < rows) bulk_to_shared(dst + lane * RS, w + (size_t)(task_row(task, h, j) + lane) * K, (u32)K, bar);
}
#endif

// Task `task` of the block (HALF: its parity, which ring slots hold it): its SPW steps, each issuing the same
// step of task + TA into the slot it frees (RING: read from its shared-memory slot, refilled after); then the
// warps' K slices summed in warp order, rounded to bf16 and stored (shared memory and proj).
template <int HALF>
__device__ __forceinline__ void run_task(Shared &sm, uint4 (&ra)[PF], uint4 (&rb)[PF], const unsigned char *__restrict__ w,
                                         const float *__restrict__ s, u16 *__restrict__ proj, int pos, int h, int j,
                                         int warp, int lane, unsigned char *ring, const unsigned char *__restrict__ ow) {
    const int g = lane >> 2, t = lane & 3;
    const int task = TASK_OF(pos);
#if RING
    bar_wait_parity(smem_addr(&sm.full[pos % RING]), (u32)(pos / RING) & 1u);
    const unsigned char *slot_rows = ring + (size_t)(pos % RING) * SLOT + g * RS;
    const bool lo = task < NT - 1 || g == 0, hi = task < NT - 1;  // (the b task's slot holds its row 0 only)
#endif
    const float *scales = s + (task_row(task, h, j) / 128) * KB;  // (the 16 rows share one 128-row scale block)
    if (L2A > 0 && threadIdx.x == 0) ask_l2_task(w, task + TA + L2A, h, j);
    float acc = 0.0f, acc_hi = 0.0f;
#pragma unroll
    for (int st = 0; st < SPW; ++st) {
        const int col = (warp * SPW + st) * 64 + t * 16;
#if RING
        const uint4 va = lo ? *reinterpret_cast<const uint4 *>(slot_rows + col) : uint4{0u, 0u, 0u, 0u};
        const uint4 vb = hi ? *reinterpret_cast<const uint4 *>(slot_rows + 8 * RS + col) : uint4{0u, 0u, 0u, 0u};
#else
        constexpr int base = (HALF * SPW) % PF;
        const int slot = (base + st) % PF;
        const uint4 va = ra[slot], vb = rb[slot];
        if (task + TA < NT) issue(ra[slot], rb[slot], w, task + TA, st, h, j, warp, lane);
#endif
        float c0[4] = {0.0f, 0.0f, 0.0f, 0.0f}, c1[4] = {0.0f, 0.0f, 0.0f, 0.0f};
        step_products(va, vb, sm.xh, col, c0, c1);
        const float sc = __ldg(scales + ((warp * SPW + st) * 64) / 128);
        acc = fmaf(c0[0] + c1[0], sc, acc);
        acc_hi = fmaf(c0[2] + c1[2], sc, acc_hi);
    }
    if (t == 0) {
        sm.part[HALF][warp][0][g] = acc;
        sm.part[HALF][warp][1][g] = acc_hi;
    }
    __syncthreads();
#if RING
    if (warp == 0) {  // every warp has read this task's slot: refill it with the task RING later
        asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
        fill_slot(ring, sm.full, w, pos + RING, h, j, lane, ow);
    }
#endif
    if (warp == 0 && lane < 16) {
        float y = 0.0f;
#pragma unroll
        for (int i = 0; i < WARPS; ++i) y += sm.part[HALF][i][lane >> 3][lane & 7];
        y = round_bf16(y);
        if (task < NT - 1 || lane == 0) {
            sm.proj[task * 16 + lane] = y;
            if (task < NT - 1 || j == 0) proj[task_row(task, h, j) + lane] = to_bf16(y);
        }
    }
}

#ifndef XCHG
#define XCHG 0
#endif
#if XCHG
#define CLUSTER_DIMS
#else
#define CLUSTER_DIMS __cluster_dims__(SPLIT, 1, 1)
#endif

extern "C" __global__ void CLUSTER_DIMS __launch_bounds__(THREADS, MIN_BLOCKS)
kda_front(u16 *x,                               // [K] bf16: the layer's input (OPROJ: its output, in place)
          const u16 *__restrict__ nw,           // [K] bf16: the attention norm's weight
          const unsigned char *__restrict__ w,  // [5 D + H, K] e4m3: q|k|v|f|g|b rows
          const float *__restrict__ s,          // [ceil((5 D + H) / 128), KB] block scales
          u16 *__restrict__ proj,               // [5 D + H] bf16 out: the projection (the output projection reads g)
          const float *__restrict__ convw,      // [3 D, 4] the short convolutions' weights
          float *__restrict__ conv,             // [3 D, 3] their windows (oldest first), updated
          float *__restrict__ state,            // [H, DK, DK] fp32, updated (LAZY: where *source says)
          float *__restrict__ slots,            // LAZY: [W, H, DK, DK] the verification history's states
          const int *__restrict__ source,       // LAZY: 0 -> state, n -> slots[n - 1]
          const float *__restrict__ alog,       // [H]
          const float *__restrict__ dtb,        // [D]
          u16 *__restrict__ o,                  // [D] bf16 out: the recurrence's output
          int *__restrict__ count,              // launch counter
          float *__restrict__ xch,              // XCHG: [H, 3, DK] the heads' q, k and decay, exchanged
          int *__restrict__ flags,              // XCHG: [2 H] arrivals and departures a head, zeros between launches
          float eps, float lower_bound,
          const unsigned char *__restrict__ ow, // OPROJ: [HID, D] e4m3, the output projection
          const float *__restrict__ os,         // OPROJ: [ceil(HID / 128), D / 128] its block scales
          const u16 *__restrict__ onw,          // OPROJ: [DK] bf16, the output norm's weight
          float oeps,                           // OPROJ: the output norm's epsilon
          const unsigned char *__restrict__ l2w,  // L2O: the weights asked of the L2 (the next kernel's)
          int l2_bytes) {                       // L2O: how many (a multiple of 16)
    __shared__ Shared sm;
    extern __shared__ __align__(128) unsigned char ring[];  // RING: the slots (dynamic shared memory)
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, tid = threadIdx.x;
    const int g = lane >> 2, t = lane & 3;
    const int h = blockIdx.x / SPLIT;
#if XCHG
    const u32 j = blockIdx.x % SPLIT;
#else
    u32 j;
    asm("mov.u32 %0, %%cluster_ctarank;" : "=r"(j));
    asm volatile("barrier.cluster.arrive.relaxed.aligned;" ::: "memory");  // (waited for before the exchange)
#endif

    // ---- before the wait: the first PF steps of weights, the state slice, the conv windows and weights
    uint4 ra[PF], rb[PF];
#if RING
    if (warp == 0) {
        if (lane == 0) {
            for (int b = 0; b < RING; ++b)
                asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(smem_addr(&sm.full[b])));
            asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
        }
        __syncwarp();
        for (int i = 0; i < RING; ++i) fill_slot(ring, sm.full, w, i, h, j, lane, ow);  // tasks 0 .. RING - 1
    }
#else
#pragma unroll
    for (int i = 0; i < PF; ++i) issue(ra[i], rb[i], w, i / SPW, i % SPW, h, j, warp, lane);  // tasks 0 .. TA - 1
#endif
    if (L2A > 0 && tid == 0)
        for (int i = TA; i < TA + L2A; ++i) ask_l2_task(w, i, h, j);
    if (L2O == 2 && tid == 0) ask_l2_share(l2w, l2_bytes);
    float *st_base = state;
#if LAZY
    const int src = *source;
    if (src > 0) st_base = slots + (size_t)(src - 1) * H * DK * DK;
#endif
    st_base += (size_t)h * DK * DK + j * CH;  // row k of the slice: st_base + k * DK
    for (int p = tid; p < DK * CH / 4; p += THREADS) {
        const int k = p / (CH / 4), c4 = (p % (CH / 4)) * 4;
        asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(smem_addr(&sm.state[k][c4])),
                     "l"(st_base + (size_t)k * DK + c4)
                     : "memory");
    }
    asm volatile("cp.async.commit_group;" ::: "memory");
    // thread tid < 4 CH takes channel c = tid % CH of part tid / CH: the conv of q, k and v, the decay of f
    const int part = tid / CH, c = tid % CH;
    const int ch = part * D + h * DK + j * CH + c;
    float cw[4] = {0.0f, 0.0f, 0.0f, 0.0f}, cwin[3] = {0.0f, 0.0f, 0.0f};
    if (tid < 3 * CH) {
#pragma unroll
        for (int i = 0; i < 4; ++i) cw[i] = convw[ch * 4 + i];
#pragma unroll
        for (int i = 0; i < 3; ++i) cwin[i] = conv[ch * 3 + i];
    }
    float bias = 0.0f, rate = 0.0f;
    if (tid >= 3 * CH && tid < 4 * CH) {
        bias = dtb[h * DK + j * CH + c];
        rate = __expf(alog[h]);
    }

    asm volatile("griddepcontrol.wait;" ::: "memory");  // x is the previous kernels' output
    if (blockIdx.x == 0 && tid == 0) atomicAdd(count, 1);

    // ---- the prologue: RMSNorm of x into f16 pairs
    {
        uint4 xv[1][PIECES], nv[PIECES];
#pragma unroll
        for (int p = 0; p < PIECES; ++p) {
            const int i = p * THREADS + tid;
            const bool ok = i < K / 8;
            xv[0][p] = ok ? ld_fresh(x + i * 8) : uint4{0u, 0u, 0u, 0u};
            nv[p] = ok ? *reinterpret_cast<const uint4 *>(nw + i * 8) : uint4{0u, 0u, 0u, 0u};
        }
        float rstd[1];
        block_rstd<1, PIECES, WARPS>(xv, sm.red, K, eps, rstd);
#pragma unroll
        for (int p = 0; p < PIECES; ++p) {
            const int i = p * THREADS + tid;
            if (i < K / 8) {
                float v[8];
#pragma unroll
                for (int q = 0; q < 4; ++q) {
                    const u32 xq = word(xv[0][p], q), nq = word(nv[p], q);
                    v[2 * q] = rms_value(xq & 0xFFFFu, rstd[0], nq & 0xFFFFu);
                    v[2 * q + 1] = rms_value(xq >> 16, rstd[0], nq >> 16);
                }
                *reinterpret_cast<uint4 *>(sm.xh + i * 4) =
                    uint4{f16x2(v[0], v[1]), f16x2(v[2], v[3]), f16x2(v[4], v[5]), f16x2(v[6], v[7])};
            }
        }
        __syncthreads();
    }

    // ---- the stream: NT tasks of 16 rows, TA tasks' loads in flight a lane
    constexpr int PAIRED = GLAST ? NT - 3 : NT - 1;  // (GLAST: the g tasks run after the recurrence)
#pragma unroll 1
    for (int pos = 0; pos < PAIRED; pos += 2) {
        run_task<0>(sm, ra, rb, w, s, proj, pos, h, j, warp, lane, ring, ow);
        run_task<1>(sm, ra, rb, w, s, proj, pos + 1, h, j, warp, lane, ring, ow);
    }
    asm volatile("griddepcontrol.launch_dependents;");  // (the b row is left, and GLAST's g rows)
    if (L2O == 1 && tid == 0) ask_l2_share(l2w, l2_bytes);
    run_task<0>(sm, ra, rb, w, s, proj, PAIRED, h, j, warp, lane, ring, ow);
    asm volatile("cp.async.wait_all;" ::: "memory");
    __syncthreads();

    // ---- this block's channels: conv + SiLU of q, k (for the cluster) and v (its own), the decay of f
    float val = 0.0f;
    if (tid < 3 * CH) {
        const float xin = sm.proj[tid];
        const float y = cw[0] * cwin[0] + cw[1] * cwin[1] + cw[2] * cwin[2] + cw[3] * xin;
        val = y / (1.0f + __expf(-y));
        conv[ch * 3 + 0] = cwin[1];
        conv[ch * 3 + 1] = cwin[2];
        conv[ch * 3 + 2] = xin;
    } else if (tid < 4 * CH) {
        const float f = sm.proj[tid] + bias;  // (the f rows follow v's in sm.proj)
#if SAFE_GATE
        const float gate = lower_bound / (1.0f + __expf(-rate * f));
#else
        const float gate = -rate * (f > 20.0f ? f : __logf(1.0f + __expf(f)));
#endif
        val = __expf(gate);
    }
#if XCHG
    // through global memory: this block's q, k and decay, a release of the head's arrivals, an acquire of all
    // SPLIT, then the head's 3 DK values read back (the grid is one wave: CudaKdaFront checks that it fits);
    // the last block of the head to have read them zeroes both counters for the next launch
    if (part == 2) {
        sm.v[c] = val;
    } else if (tid < 4 * CH) {
        xch[(h * 3 + (part == 3 ? 2 : part)) * DK + j * CH + c] = val;
        __threadfence();
    }
    __syncthreads();
    if (tid == 0) {
        __threadfence();
        atomicAdd(flags + h, 1);
        int arrived;
        do {
            asm volatile("ld.acquire.gpu.global.s32 %0, [%1];" : "=r"(arrived) : "l"(flags + h) : "memory");
        } while (arrived < SPLIT);
    }
    __syncthreads();
    for (int i = tid; i < 3 * DK; i += THREADS) {
        float v;
        asm volatile("ld.global.cg.f32 %0, [%1];" : "=f"(v) : "l"(xch + h * 3 * DK + i) : "memory");
        (i < DK ? sm.q : i < 2 * DK ? sm.k : sm.decay)[i % DK] = v;
    }
    __syncthreads();
    if (tid == 0 && atomicAdd(flags + H + h, 1) == SPLIT - 1) {
        flags[h] = 0;
        flags[H + h] = 0;
    }
#else
    asm volatile("barrier.cluster.wait.aligned;" ::: "memory");  // every block of the cluster has started
    if (part == 2) {
        sm.v[c] = val;
    } else if (tid < 4 * CH) {
        float *dst = part == 0 ? sm.q : part == 1 ? sm.k : sm.decay;
#pragma unroll
        for (u32 r = 0; r < SPLIT; ++r) st_cluster(dst + j * CH + c, r, val);
    }
    asm volatile("barrier.cluster.arrive.release.aligned;\nbarrier.cluster.wait.acquire.aligned;" ::: "memory");
#endif

    // ---- the recurrence on the [DK, CH] slice: warp kw < 8 takes rows 16 kw .. 16 kw + 15, lane the column
    if (warp < 2) {  // the sums of squares of q (warp 0) and k (warp 1)
        const float *src = warp == 0 ? sm.q : sm.k;
        float ss = 0.0f;
#pragma unroll
        for (int i = 0; i < DK / 32; ++i) ss = fmaf(src[i * 32 + lane], src[i * 32 + lane], ss);
        ss = warp_sum(ss);
        if (lane == 0) sm.sums[warp] = ss;
    }
    __syncthreads();
    constexpr int R = DK / 8;  // rows a thread
    float S[R];
    const float beta = 1.0f / (1.0f + __expf(-sm.proj[10 * 16]));
    const float rq = __fdiv_rn(1.0f, __fsqrt_rn(sm.sums[0] + 1e-6f)) * (1.0f / sqrtf((float)DK));
    const float rk = __fdiv_rn(1.0f, __fsqrt_rn(sm.sums[1] + 1e-6f));
    if (warp < 8) {
        float p = 0.0f;
#pragma unroll
        for (int i = 0; i < R; ++i) {
            const int k = warp * R + i;
            S[i] = sm.state[k][lane] * sm.decay[k];
            p = fmaf(S[i], sm.k[k] * rk, p);
        }
        sm.part_kv[warp][lane] = p;
    }
    __syncthreads();
    if (warp < 8) {
        float kv = 0.0f;
#pragma unroll
        for (int i = 0; i < 8; ++i) kv += sm.part_kv[i][lane];
        const float u = beta * (sm.v[lane] - kv);
        float p = 0.0f;
#pragma unroll
        for (int i = 0; i < R; ++i) {
            const int k = warp * R + i;
            S[i] = fmaf(sm.k[k] * rk, u, S[i]);
            p = fmaf(S[i], sm.q[k] * rq, p);
            st_base[(size_t)k * DK + lane] = S[i];
        }
        sm.part_o[warp][lane] = p;
    }
    __syncthreads();
    if (warp == 0) {
        float y = 0.0f;
#pragma unroll
        for (int i = 0; i < 8; ++i) y += sm.part_o[i][lane];
        o[h * DK + j * CH + lane] = to_bf16(y);
    }
#if GLAST
    // ---- the g rows, which only the output projection reads: their slots filled while the block exchanged and ran
    // the recurrence
    run_task<1>(sm, ra, rb, w, s, proj, NT - 2, h, j, warp, lane, ring, ow);
    run_task<0>(sm, ra, rb, w, s, proj, NT - 1, h, j, warp, lane, ring, ow);
#endif
#if OPROJ
    // ---- every block's o and g: a grid-wide count (flags[2 H]: arrivals, [2 H + 1]: departures), then the gated
    // per-head RMSNorm of all of o into f16 pairs, exactly as the output projection GEMV's prologue (NORM 2)
    if (warp == 0) __threadfence();  // (warp 0 stored this block's o and its g rows of proj)
    __syncthreads();
    int *grid = flags + 2 * H;
    if (tid == 0) {
        __threadfence();
        atomicAdd(grid, 1);
        int arrived;
        do {
            asm volatile("ld.acquire.gpu.global.s32 %0, [%1];" : "=r"(arrived) : "l"(grid) : "memory");
        } while (arrived < (int)gridDim.x);
    }
    __syncthreads();
    {
        uint4 xv[OPIECES], gv[OPIECES], nv[OPIECES];
#pragma unroll
        for (int p = 0; p < OPIECES; ++p) {
            const int i = p * THREADS + tid;
            const bool ok = i < D / 8;
            xv[p] = ok ? ld_fresh(o + i * 8) : uint4{0u, 0u, 0u, 0u};
            gv[p] = ok ? ld_fresh(proj + 4 * D + i * 8) : uint4{0u, 0u, 0u, 0u};
            nv[p] = ok ? *reinterpret_cast<const uint4 *>(onw + (i * 8) % DK) : uint4{0u, 0u, 0u, 0u};
        }
#pragma unroll
        for (int p = 0; p < OPIECES; ++p) {
            const int i = p * THREADS + tid;
            float v[8];
            bf16x8_to_float(xv[p], v);
            gated_rms_piece<DK>(v, gv[p], nv[p], oeps);  // (a head's DK columns: DK / 8 lanes of one warp)
            if (i < D / 8)
                *reinterpret_cast<uint4 *>(sm.oh + i * 4) =
                    uint4{f16x2(v[0], v[1]), f16x2(v[2], v[3]), f16x2(v[4], v[5]), f16x2(v[6], v[7])};
        }
    }
    __syncthreads();
    if (tid == 0 && atomicAdd(grid + 1, 1) == (int)gridDim.x - 1) {  // the last to have read them resets the count
        grid[0] = 0;
        grid[1] = 0;
    }
    // ---- this block's OR rows: 16-row products (rows g and g + 8 of each), K slice sl of OSL taken by warp
    // sl % WARPS, its OSTEPS steps summed in order as the GEMV's warp sl sums them, the slices in order after
#pragma unroll
    for (int p = 0; p < OSLOTS; ++p) bar_wait_parity(smem_addr(&sm.full[(NT + p) % RING]), (u32)((NT + p) / RING) & 1u);
    const unsigned char *orow[OCH][2];
    const float *oscale[OCH][2];
    bool oval[OCH][2];
#pragma unroll
    for (int c = 0; c < OCH; ++c)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
            const int r = c * 16 + e * 8 + g;
            oval[c][e] = r < OR;
            const int rr = oval[c][e] ? r : 0;
            orow[c][e] = ring + (size_t)((NT + rr / ORPS) % RING) * SLOT + (size_t)(rr % ORPS) * RS2;
            oscale[c][e] = os + ((blockIdx.x * OR + rr) / 128) * (D / 128);
        }
    for (int sl = warp; sl < OSL; sl += WARPS) {
        float acc[OCH][2];
#pragma unroll
        for (int c = 0; c < OCH; ++c) acc[c][0] = acc[c][1] = 0.0f;
#pragma unroll
        for (int st = 0; st < OSTEPS; ++st) {
            const int col = (sl * OSTEPS + st) * 64 + t * 16;
            const int kb = ((sl * OSTEPS + st) * 64) / 128;
#pragma unroll
            for (int c = 0; c < OCH; ++c) {
                const uint4 va = oval[c][0] ? *reinterpret_cast<const uint4 *>(orow[c][0] + col) : uint4{0u, 0u, 0u, 0u};
                const uint4 vb = oval[c][1] ? *reinterpret_cast<const uint4 *>(orow[c][1] + col) : uint4{0u, 0u, 0u, 0u};
                float c0[4] = {0.0f, 0.0f, 0.0f, 0.0f}, c1[4] = {0.0f, 0.0f, 0.0f, 0.0f};
                step_products(va, vb, sm.oh, col, c0, c1);
                const float sa = oval[c][0] ? __ldg(oscale[c][0] + kb) : 0.0f;
                const float sb = oval[c][1] ? __ldg(oscale[c][1] + kb) : 0.0f;
                acc[c][0] = fmaf(c0[0] + c1[0], sa, acc[c][0]);
                acc[c][1] = fmaf(c0[2] + c1[2], sb, acc[c][1]);
            }
        }
        if (t == 0) {
#pragma unroll
            for (int c = 0; c < OCH; ++c) {
                sm.opart[sl][c * 16 + g] = acc[c][0];
                sm.opart[sl][c * 16 + 8 + g] = acc[c][1];
            }
        }
    }
    __syncthreads();
    if (warp == 0 && lane < OR) {
        float y = 0.0f;
#pragma unroll
        for (int sl = 0; sl < OSL; ++sl) y += sm.opart[sl][lane];
        const int row = blockIdx.x * OR + lane;
        // the reference adds in the stream's dtype: the projection's output is rounded first
        const float sum = bf16_to_float(ld_fresh_u16(x + row)) + round_bf16(y);
        x[row] = to_bf16(sum);
    }
#endif
}

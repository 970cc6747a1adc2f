"""One token's MLA decode attention on Hopper, written in Gluon: the cache's steps copied by the tensor memory
accelerator into a ring of shared-memory buffers, products on the warpgroup MMA (`AttendLaunch.gluon`).

Why not Triton: at the 2 stages that fit in shared memory, Triton's software pipeline issues a step's cache
copies after the products of the step before and waits for them at the next step's top (cp.async and TMA
descriptors alike, docs/kernels.md, MLA), so no copy overlaps a product: the attention reads the cache at about
half the copy bandwidth. Here every buffer of the ring is filled as soon as the products that read it are done,
so while a step computes the next one is already in flight, and the split's first steps are copied before the
wait for the previous kernel (the prep) wherever they hold only rows earlier steps wrote.

Same cut, arithmetic and outputs as `fused_mla._mla_attend_t` for one token (positions on the MMA's M side,
the heads on N; bf16 operands, fp32 sums in another order): the combine reads its partials unchanged.
"""

from __future__ import annotations

import torch
import triton

try:  # Gluon is Triton's explicit-layout dialect (Triton 3.5 and later); without it the option is unavailable
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (
        fence_async_shared,
        mbarrier,
        tma,
        warpgroup_mma,
        warpgroup_mma_wait,
    )
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
except ImportError:  # pragma: no cover - depends on the installed Triton
    gluon = None

from solo.kernels.triton_fp8 import interpreter_mode


def gluon_unavailable(device: torch.device | str) -> str | None:
    """Why the Gluon attention cannot run on `device`, or None when it can."""
    device = torch.device(device)
    if gluon is None:
        return f"this Triton ({triton.__version__}) has no Gluon with Hopper TMA and warpgroup MMA; install Triton 3.6"
    if interpreter_mode():
        return "Triton's CPU interpreter (TRITON_INTERPRET=1) runs no Gluon kernels"
    if device.type != "cuda" or not torch.cuda.is_available():
        return f"the Gluon MLA attention needs an NVIDIA GPU; the model is on '{device.type}'"
    if torch.cuda.get_device_capability(device)[0] != 9:
        return "the Gluon MLA attention needs a Hopper GPU (compute capability 9.x: TMA and the warpgroup MMA)"
    return None


if gluon is not None:

    @gluon.jit
    def _grid_dependency(PDL: gl.constexpr):
        """Under PDL: wait for the previous kernel (its writes visible), then let the next one launch."""
        if PDL:
            gl.inline_asm_elementwise("griddepcontrol.wait; // $0", "=r", [], dtype=gl.int32, is_pure=False, pack=1)
            gl.inline_asm_elementwise(
                "griddepcontrol.launch_dependents; // $0", "=r", [], dtype=gl.int32, is_pure=False, pack=1
            )

    @gluon.jit
    def _copy_step(latent_desc, rope_desc, bar, kv_buf, kr_buf, row, go):
        """One step's latent and rope rows from `row` into a buffer, completing on `bar` (when `go`)."""
        mbarrier.expect(bar, latent_desc.block_type.nbytes + rope_desc.block_type.nbytes, pred=go)
        tma.async_copy_global_to_shared(latent_desc, [row, 0], bar, kv_buf, pred=go)
        tma.async_copy_global_to_shared(rope_desc, [row, 0], bar, kr_buf, pred=go)

    @gluon.jit
    def _ask_rows(ptr, row, rows, WIDTH: gl.constexpr, BLOCK_L: gl.constexpr, WARPS: gl.constexpr):
        """Ask the L2 for `rows` (at most BLOCK_L; none when <= 0) rows of WIDTH bf16 from row `row` of `ptr`: bulk
        prefetches, a request per thread, no registers held and nothing waited for (a hint)."""
        lanes: gl.constexpr = gl.BlockedLayout([1], [32], [WARPS], [0])
        share: gl.constexpr = BLOCK_L * WIDTH * 2 // (32 * WARPS)
        t = gl.arange(0, 32 * WARPS, layout=lanes)
        size = gl.minimum(gl.maximum(rows * (WIDTH * 2) - t * share, 0), share)
        base = (ptr + row.to(gl.int64) * WIDTH).to(gl.int64, bitcast=True)
        gl.inline_asm_elementwise(
            "{ .reg .pred p; setp.ne.u32 p, $2, 0; @p cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0; }",
            "=r,l,r",
            [base + t * share, size],
            dtype=gl.int32,
            is_pure=False,
            pack=1,
        )

    @gluon.jit
    def _ask_l2(
        latent_ptr,
        rope_ptr,
        row,
        rows,
        RANK: gl.constexpr,
        ROPE: gl.constexpr,
        BLOCK_L: gl.constexpr,
        WARPS: gl.constexpr,
    ):
        """Ask the L2 for `rows` latent and rope rows from `row` (_ask_rows)."""
        _ask_rows(latent_ptr, row, rows, RANK, BLOCK_L, WARPS)
        _ask_rows(rope_ptr, row, rows, ROPE, BLOCK_L, WARPS)

    @gluon.jit
    def _mla_attend_ring(
        q_ptr,
        pos_ptr,
        latent_ptr,
        rope_ptr,
        latent_desc,
        rope_desc,
        part_ptr,
        ml_ptr,
        count_ptr,
        scale,
        HEADS: gl.constexpr,
        RANK: gl.constexpr,
        ROPE: gl.constexpr,
        SPLITS: gl.constexpr,
        BLOCK_M: gl.constexpr,
        BLOCK_L: gl.constexpr,
        MIN_CHUNK: gl.constexpr,
        BUFFERS: gl.constexpr,
        EARLY: gl.constexpr,
        PDL: gl.constexpr,
        AHEAD: gl.constexpr = 0,
        WARPS: gl.constexpr = 4,
        T: gl.constexpr = 1,
        T_POW2: gl.constexpr = 1,
        ROWS: gl.constexpr = 0,
    ):
        """Split s of the call's filled positions for the ROWS rows (token x head) of row block program_id(1):
        scores^T = keys . q^T [BLOCK_L, ROWS] and out^T += values^T . p^T [RANK, ROWS] per step of BLOCK_L positions,
        an online softmax between; the partial output, running max and sum into part / ml as _mla_attend_t writes
        them. One token (T 1): its HEADS heads are the rows. Several (a verification window): each row sees the
        positions up to its token's, rows past the T x HEADS are padding (masked, their partials never read). A box
        past the split's end reads rows that later positions left (finite: the caches start zeroed) or zeros past
        the cache: the mask drops them."""
        N: gl.constexpr = HEADS if T == 1 else ROWS  # the products' N side
        s = gl.program_id(0)
        # the call's positions (final two kernels back: read before the wait); the prep writes rows first..pos
        if T == 1:
            rp = 0
            pos = gl.load(pos_ptr).to(gl.int32)
            first = pos
        else:
            rp = gl.program_id(1)
            tokens: gl.constexpr = gl.BlockedLayout([1], [32], [WARPS], [0])
            rt = gl.arange(0, T_POW2, layout=tokens)
            window = gl.load(pos_ptr + rt, mask=rt < T, other=-1).to(gl.int32)
            pos = gl.max(window, axis=0)
            first = gl.min(gl.where(rt < T, window, pos), axis=0)
        length = pos + 1
        used = gl.minimum((length + MIN_CHUNK - 1) // MIN_CHUNK, SPLITS)
        chunk = (length + used - 1) // used
        chunk = (chunk + BLOCK_L - 1) // BLOCK_L * BLOCK_L
        start = s * chunk
        end = gl.minimum(start + chunk, length)
        steps = gl.where(s < used, (end - start + BLOCK_L - 1) // BLOCK_L, 0)

        kv_ring = gl.allocate_shared_memory(gl.bfloat16, [BUFFERS, BLOCK_L, RANK], latent_desc.layout)
        kr_ring = gl.allocate_shared_memory(gl.bfloat16, [BUFFERS, BLOCK_L, ROPE], rope_desc.layout)
        bars = gl.allocate_shared_memory(gl.int64, [BUFFERS, 1], mbarrier.MBarrierLayout())
        for b in gl.static_range(BUFFERS):
            mbarrier.init(bars.index(b), count=1)
        # the ring's first steps: those holding only rows earlier steps wrote before the wait for the prep (which
        # writes this token's row), the rest after it
        if EARLY > 0:
            for b in gl.static_range(BUFFERS):
                row = start + b * BLOCK_L
                early = (b < steps) & (row + BLOCK_L <= first)
                _copy_step(latent_desc, rope_desc, bars.index(b), kv_ring.index(b), kr_ring.index(b), row, early)
            for b in gl.static_range(BUFFERS, EARLY):  # (steps past the ring: asked of the L2, old rows only)
                row = start + b * BLOCK_L
                old_rows = gl.where(b < steps, gl.minimum(gl.minimum(end, first) - row, BLOCK_L), 0)
                _ask_l2(latent_ptr, rope_ptr, row, old_rows, RANK, ROPE, BLOCK_L, WARPS)
        _grid_dependency(PDL)
        if (s == 0) & (rp == 0):
            gl.atomic_add(count_ptr, 1)
        for b in gl.static_range(BUFFERS):
            row = start + b * BLOCK_L
            late = (b < steps) & (row + BLOCK_L > first) if EARLY > 0 else b < steps
            _copy_step(latent_desc, rope_desc, bars.index(b), kv_ring.index(b), kr_ring.index(b), row, late)

        # the products' layouts: positions (scores) or latent columns (output) on M, the rows on N; with two
        # warpgroups each takes half of the output's columns and half of the scores' rows
        mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[WARPS, 1], instr_shape=[16, N, 16])
        mma_s: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[4, WARPS // 4], instr_shape=[16, N // (WARPS // 4), 16]
        )
        rows_of: gl.constexpr = gl.SliceLayout(0, mma)
        rows_s: gl.constexpr = gl.SliceLayout(0, mma_s)
        # the query once into shared memory, [N, RANK] and [N, ROPE] (the B operand, K-major); q is [T, HEADS,
        # RANK + ROPE], so the block's rows are consecutive rows of width RANK + ROPE
        q_load: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [WARPS, 1], [1, 0])
        rq = rp * N + gl.arange(0, N, layout=gl.SliceLayout(1, q_load))
        q_at = q_ptr + rq[:, None] * (RANK + ROPE)
        rd_q = gl.arange(0, RANK, layout=gl.SliceLayout(0, q_load))[None, :]
        rr_q = RANK + gl.arange(0, ROPE, layout=gl.SliceLayout(0, q_load))[None, :]
        if T == 1:
            q_lat = gl.load(q_at + rd_q)
            q_rope = gl.load(q_at + rr_q)
        else:  # (padding rows past the window's T x HEADS: zeros)
            q_ok = (rq < T * HEADS)[:, None]
            q_lat = gl.load(q_at + rd_q, mask=q_ok, other=0.0)
            q_rope = gl.load(q_at + rr_q, mask=q_ok, other=0.0)
        q_smem = gl.allocate_shared_memory(
            gl.bfloat16, [N, RANK], gl.NVMMASharedLayout.get_default_for([N, RANK], gl.bfloat16), q_lat
        )
        qr_smem = gl.allocate_shared_memory(
            gl.bfloat16, [N, ROPE], gl.NVMMASharedLayout.get_default_for([N, ROPE], gl.bfloat16), q_rope
        )
        p_smem = gl.allocate_shared_memory(
            gl.bfloat16, [BLOCK_L, N], gl.NVMMASharedLayout.get_default_for([BLOCK_L, N], gl.bfloat16)
        )
        fence_async_shared()

        m_i = gl.full([N], float("-inf"), gl.float32, layout=rows_s)
        l_i = gl.zeros([N], gl.float32, layout=rows_s)
        acc = gl.zeros([RANK, N], gl.float32, layout=mma)
        zero_scores = gl.zeros([BLOCK_L, N], gl.float32, layout=mma_s)
        offsets = gl.arange(0, BLOCK_L, layout=gl.SliceLayout(1, mma_s))
        if T > 1:  # each row's token position (padding rows: -1, nothing visible)
            r_s = rp * N + gl.arange(0, N, layout=rows_s)
            row_pos = gl.load(pos_ptr + r_s // HEADS, mask=r_s < T * HEADS, other=-1).to(gl.int32)
        for i in range(steps):
            slot = i % BUFFERS
            kv = kv_ring.index(slot)
            kr = kr_ring.index(slot)
            mbarrier.wait(bars.index(slot), (i // BUFFERS) & 1)
            if AHEAD > 0:
                row = start + (i + AHEAD) * BLOCK_L
                _ask_l2(latent_ptr, rope_ptr, row, gl.minimum(end - row, BLOCK_L), RANK, ROPE, BLOCK_L, WARPS)
            scores = warpgroup_mma(kv, q_smem.permute((1, 0)), zero_scores, use_acc=False, is_async=True)
            scores = warpgroup_mma(kr, qr_smem.permute((1, 0)), scores, is_async=True)
            scores = warpgroup_mma_wait(num_outstanding=0, deps=(scores,))
            at = start + i * BLOCK_L + offsets
            if T == 1:
                scores = gl.where((at < end)[:, None], scores * scale, float("-inf"))
                m_new = gl.maximum(m_i, gl.max(scores, axis=0))  # (every step has a visible position: finite)
                m_safe = m_new
            else:  # a row may see nothing of a step (positions past its token's) or of its split so far
                visible = (at < end)[:, None] & (at[:, None] <= row_pos[None, :])
                scores = gl.where(visible, scores * scale, float("-inf"))
                m_new = gl.maximum(m_i, gl.max(scores, axis=0))
                m_safe = gl.where(m_new == float("-inf"), 0.0, m_new)
            p = gl.exp(scores - m_safe[None, :])
            alpha = gl.exp(m_i - m_safe)
            l_i = l_i * alpha + gl.sum(p, axis=0)
            p_smem.store(p.to(gl.bfloat16))
            fence_async_shared()
            rescale = gl.convert_layout(alpha, rows_of)[None, :]
            acc = warpgroup_mma(kv.permute((1, 0)), p_smem, acc * rescale, is_async=True)
            m_i = m_new
            acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
            # the buffer is free again: the step BUFFERS later into it
            later = i + BUFFERS
            _copy_step(latent_desc, rope_desc, bars.index(slot), kv, kr, start + later * BLOCK_L, later < steps)
        for b in gl.static_range(BUFFERS):
            mbarrier.invalidate(bars.index(b))
        if s < used:
            out_rows = s * BLOCK_M + rp * N + gl.arange(0, N, layout=rows_of)
            rd = gl.arange(0, RANK, layout=gl.SliceLayout(1, mma))
            gl.store(part_ptr + out_rows[None, :] * RANK + rd[:, None], acc)
            ml_rows = s * BLOCK_M + rp * N + gl.arange(0, N, layout=rows_s)
            gl.store(ml_ptr + ml_rows * 2, m_i)
            gl.store(ml_ptr + ml_rows * 2 + 1, l_i)


def cache_descriptors(latent_cache: torch.Tensor, rope_cache: torch.Tensor, block_l: int) -> tuple:
    """TMA descriptors of a layer's latent [positions, rank] and rope [positions, rope] caches, boxes of block_l
    rows in the swizzled layout the warpgroup MMA reads."""
    descriptors = []
    for cache in (latent_cache, rope_cache):
        block = [block_l, cache.shape[1]]
        layout = gl.NVMMASharedLayout.get_default_for(block, gl.bfloat16)
        descriptors.append(TensorDescriptor.from_tensor(cache, block, layout))
    return tuple(descriptors)


def attend_ring(
    q: torch.Tensor,
    positions: torch.Tensor,
    latent_cache: torch.Tensor,
    rope_cache: torch.Tensor,
    descriptors: tuple,
    part: torch.Tensor,
    ml: torch.Tensor,
    counter: torch.Tensor,
    scale: float,
    *,
    splits: int,
    min_chunk: int,
    block_l: int,
    buffers: int,
    early: int,
    ahead: int,
    warps: int,
    pdl: bool,
    launch_options: dict,
    rows: int = 0,
) -> object:
    """Launch _mla_attend_ring for the call's q [T, heads, rank + rope]: one token's heads in one program a split; T > 1
    tokens' T x heads rows in programs of `rows` each (AttendLaunch.rows_per_program: 16, 32 or 64, dividing part's
    rows). `early` > 0, the split's first steps of old rows requested before the wait for the previous kernel
    (the ring's copied, up to `early` asked of the L2); `ahead` > 0, each step asks the L2 for the step that many
    later. Returns what Triton's launch returned."""
    tokens, heads, width = q.shape
    latent_desc, rope_desc = descriptors
    rank = latent_desc.block_shape[1]
    window = {}
    if tokens > 1:
        if rows not in (16, 32, 64) or part.shape[1] % rows:
            raise ValueError(f"{tokens} tokens' attention takes 16, 32 or 64 rows a program, dividing {part.shape[1]}")
        window = dict(T=tokens, T_POW2=triton.next_power_of_2(tokens), ROWS=rows)
    grid = (splits, triton.cdiv(tokens * heads, rows) if tokens > 1 else 1)
    return _mla_attend_ring[grid](
        q,
        positions,
        latent_cache,
        rope_cache,
        latent_desc,
        rope_desc,
        part,
        ml,
        counter,
        scale,
        HEADS=heads,
        RANK=rank,
        ROPE=width - rank,
        SPLITS=splits,
        BLOCK_M=part.shape[1],
        BLOCK_L=block_l,
        MIN_CHUNK=min_chunk,
        BUFFERS=buffers,
        EARLY=early,
        PDL=pdl,
        AHEAD=ahead,
        WARPS=warps,
        **window,
        num_warps=warps,
        **launch_options,
    )

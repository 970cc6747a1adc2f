"""The MoE router of the decode step in one kernel: norm, router GEMV, sigmoid, grouped top-k.

Every program normalises its tokens (post-attention RMSNorm, program 0 also writes the normalised
rows for the experts), computes the fp32 sigmoid scores of its block of experts and parks them; the
last program to arrive selects, per token: expert_bias added for selection only, groups ranked by
the sum of their top-2 biased scores, the best `topk_group` kept, the top-k experts among them
(by repeated arg-max: k is 8), weights = their unbiased scores, renormalised, times the routed
scaling factor. Ids and weights are written for the expert kernels; the counter is reset, so the
kernel replays from a CUDA graph without a memset.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from solo.kernels.fused_gemv import MAX_TOKENS, round_bf16, store_rounded
from solo.kernels.pdl import PLAIN, LaunchPolicy, after_previous_kernel
from solo.kernels.prefetch import prefetch_to_l2, prefetch_unavailable


@triton.jit
def _select_token(
    sc,
    bias,
    ids_ptr,
    wts_ptr,
    t,
    scaling,
    E: tl.constexpr,
    GROUPS: tl.constexpr,
    KEEP_GROUPS: tl.constexpr,
    TOPK: tl.constexpr,
    RENORM: tl.constexpr,
):
    """Grouped top-k of one token's sigmoid scores `sc` [E]; writes its ids and weights (row `t`)."""
    ra = tl.arange(0, E)
    rg = tl.arange(0, GROUPS)
    rk8 = tl.arange(0, TOPK)
    biased = sc + bias
    if KEEP_GROUPS < GROUPS:
        grouped = tl.reshape(biased, (GROUPS, E // GROUPS))
        first = tl.max(grouped, axis=1)
        at = tl.argmax(grouped, axis=1)
        cols = tl.arange(0, E // GROUPS)
        second = tl.max(tl.where(cols[None, :] == at[:, None], float("-inf"), grouped), axis=1)
        gscore = first + second
        keep = tl.zeros((GROUPS,), dtype=tl.int1)
        for _ in tl.static_range(KEEP_GROUPS):
            g = tl.argmax(gscore, axis=0)
            keep = keep | (rg == g)
            gscore = tl.where(rg == g, float("-inf"), gscore)
        kept = tl.reshape(tl.broadcast_to(keep[:, None], (GROUPS, E // GROUPS)), (E,))
        biased = tl.where(kept, biased, float("-inf"))
    ids = tl.zeros((TOPK,), dtype=tl.int32)
    wts = tl.zeros((TOPK,), dtype=tl.float32)
    for i in tl.static_range(TOPK):
        best = tl.argmax(biased, axis=0)
        ids = tl.where(rk8 == i, best, ids)
        wts = tl.where(rk8 == i, tl.sum(tl.where(ra == best, sc, 0.0), axis=0), wts)
        biased = tl.where(ra == best, float("-inf"), biased)
    if RENORM:
        wts = wts / (tl.sum(wts, axis=0) + 1e-20)
    tl.store(ids_ptr + t * TOPK + rk8, ids)
    tl.store(wts_ptr + t * TOPK + rk8, wts * scaling)


@triton.jit
def _router_chunk(
    x_ptr, stride_x, nw_ptr, w_ptr, xn_ptr, rstd, rt, t_ok, re, pid, k0, HID: tl.constexpr, BLOCK_K: tl.constexpr
):
    """Scores of this program's experts over one K chunk (program 0 also writes the normalised x)."""
    rk = k0 + tl.arange(0, BLOCK_K)
    xv = tl.load(x_ptr + rt[:, None] * stride_x + rk[None, :], mask=t_ok[:, None], other=0.0).to(tl.float32)
    nw = tl.load(nw_ptr + rk).to(tl.float32)
    xn = round_bf16(round_bf16(xv * rstd[:, None]) * nw[None, :])
    if pid == 0:
        store_rounded(xn_ptr + rt[:, None] * HID + rk[None, :], xn, t_ok[:, None])
    w = tl.load(w_ptr + re[:, None] * HID + rk[None, :]).to(tl.float32)  # [BLOCK_E, BLOCK_K]
    return tl.sum(xn[:, None, :] * w[None, :, :], axis=2)


@triton.jit
def _router(
    x_ptr,
    stride_x,
    nw_ptr,
    w_ptr,
    bias_ptr,
    xn_ptr,
    scores_ptr,
    cnt_ptr,
    ids_ptr,
    wts_ptr,
    count_ptr,
    eps,
    scaling,
    T: tl.constexpr,
    BLOCK_T: tl.constexpr,
    HID: tl.constexpr,
    E: tl.constexpr,
    GROUPS: tl.constexpr,
    KEEP_GROUPS: tl.constexpr,
    TOPK: tl.constexpr,
    RENORM: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_K: tl.constexpr,
    HID_POW2: tl.constexpr,
    SELECT: tl.constexpr,
    PDL: tl.constexpr,
    PREFETCH: tl.constexpr,  # threads of a program (32 x warps) that prefetch its expert rows; 0: none
    UNROLL: tl.constexpr,
):
    pid = tl.program_id(0)
    re = pid * BLOCK_E + tl.arange(0, BLOCK_E)
    if PREFETCH:  # this program's expert rows, before waiting for the residual stream
        prefetch_to_l2(w_ptr + (pid * BLOCK_E).to(tl.int64) * HID, BLOCK_E * HID * 2, PREFETCH)
    after_previous_kernel(PDL)
    if pid == 0:
        tl.atomic_add(count_ptr, 1)
    rt = tl.arange(0, BLOCK_T)
    t_ok = rt < T
    rk_all = tl.arange(0, HID_POW2)
    ok = t_ok[:, None] & (rk_all < HID)[None, :]
    x_all = tl.load(x_ptr + rt[:, None] * stride_x + rk_all[None, :], mask=ok, other=0.0).to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(x_all * x_all, axis=1) / HID + eps)
    acc = tl.zeros((BLOCK_T, BLOCK_E), dtype=tl.float32)
    if UNROLL:  # straight-line code: every chunk's loads can be issued before the first is used
        for k0 in tl.static_range(0, HID, BLOCK_K):
            acc += _router_chunk(x_ptr, stride_x, nw_ptr, w_ptr, xn_ptr, rstd, rt, t_ok, re, pid, k0, HID, BLOCK_K)
    else:
        for k0 in range(0, HID, BLOCK_K):
            acc += _router_chunk(x_ptr, stride_x, nw_ptr, w_ptr, xn_ptr, rstd, rt, t_ok, re, pid, k0, HID, BLOCK_K)
    scores = tl.sigmoid(acc)
    tl.store(scores_ptr + rt[:, None] * E + re[None, :], scores, mask=t_ok[:, None])
    if SELECT:  # one token: the last program to arrive selects, in this launch
        tl.debug_barrier()
        arrived = tl.atomic_add(cnt_ptr, 1, sem="acq_rel", scope="gpu")
        if arrived == tl.num_programs(0) - 1:
            ra = tl.arange(0, E)
            bias = tl.load(bias_ptr + ra).to(tl.float32)
            for t in tl.static_range(T):
                sc = tl.load(scores_ptr + t * E + ra, cache_modifier=".cg")
                _select_token(sc, bias, ids_ptr, wts_ptr, t, scaling, E, GROUPS, KEEP_GROUPS, TOPK, RENORM)
            tl.atomic_xchg(cnt_ptr, 0, sem="relaxed", scope="gpu")


@triton.jit
def _router_select(
    scores_ptr,
    bias_ptr,
    ids_ptr,
    wts_ptr,
    count_ptr,
    scaling,
    E: tl.constexpr,
    GROUPS: tl.constexpr,
    KEEP_GROUPS: tl.constexpr,
    TOPK: tl.constexpr,
    RENORM: tl.constexpr,
    PDL: tl.constexpr,
):
    """Several tokens: one program per token selects, after the scores kernel (verification)."""
    after_previous_kernel(PDL)
    t = tl.program_id(0)
    if t == 0:
        tl.atomic_add(count_ptr, 1)
    ra = tl.arange(0, E)
    sc = tl.load(scores_ptr + t * E + ra)
    bias = tl.load(bias_ptr + ra).to(tl.float32)
    _select_token(sc, bias, ids_ptr, wts_ptr, t, scaling, E, GROUPS, KEEP_GROUPS, TOPK, RENORM)


class FusedRouter:
    """Router of one MoE layer (weights [E, H] bf16, expert_bias [E]) with its fixed scratch.

    One warp per program: the selection at the end is a chain of arg-max reductions over E values,
    each a few shuffles in one warp (several warps would pay a shared-memory round trip for each,
    about 1 us; 8 groups x 2 + 4 + 8 of them made the router 40 us on the H200). One token selects in
    the same launch (its last program); several tokens (verification) select in a second launch, one
    program per token in parallel, instead of one program choosing for every token in turn (measured
    on the H200 before: 12.8 us for one token, 69 us for four)."""

    family = "router"  # its launch counter's kernel family (solo.fastpath.decode_step.FAMILIES)
    BLOCK_E = 4  # experts per program of the scores
    WARPS = 1  # warps per program of the scores (and of the selection when it runs in the same launch)
    # one token selects in the scores launch (its last program) unless this is set: then in a second
    # launch like verification (dev/launch_probe.py times both)
    select_separately = False
    unroll = False  # the scores' K loop as straight-line code (dev/launch_probe.py times it)

    def __init__(
        self,
        weight: torch.Tensor,
        expert_bias: torch.Tensor,
        norm_weight: torch.Tensor,
        eps: float,
        top_k: int,
        n_group: int,
        topk_group: int,
        renormalize: bool,
        scaling: float,
        counter: torch.Tensor,
        select_counter: torch.Tensor | None = None,
        launch: LaunchPolicy = PLAIN,
    ) -> None:
        self.num_experts, self.hidden = weight.shape
        self.block_k = min(512, self.hidden & -self.hidden)  # the largest power of two dividing H, at most 512
        if self.num_experts % self.BLOCK_E or self.block_k < 32 or top_k & (top_k - 1):
            raise ValueError("the fused router needs E % 4 == 0, H a multiple of 32 and a power-of-two top-k")
        if self.num_experts & (self.num_experts - 1) or n_group & (n_group - 1):
            raise ValueError("the fused router needs power-of-two expert and group counts")
        self.weight = weight.to(torch.bfloat16).contiguous()
        self.bias = expert_bias.float().contiguous()
        self.norm_weight = norm_weight
        self.eps, self.top_k, self.n_group, self.topk_group = float(eps), top_k, n_group, topk_group
        self.renormalize, self.scaling = renormalize, float(scaling)
        self.counter = counter
        self.select_counter = select_counter if select_counter is not None else counter
        self.launch = launch
        if launch.prefetch and (reason := prefetch_unavailable(self.weight, self.BLOCK_E * self.hidden * 2)):
            raise ValueError(f"the fused router cannot prefetch its weight into the L2: {reason}")
        self._scratch: dict[int, tuple[torch.Tensor, ...]] = {}

    def _selects_in_launch(self, tokens: int) -> bool:
        return tokens == 1 and not self.select_separately

    def __call__(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [T, H] (the residual stream) -> (normalised x [T, H] bf16, ids [T, k] int32, weights [T, k] fp32)."""
        t = x.shape[0]
        if not 1 <= t <= MAX_TOKENS:
            raise ValueError(f"the fused router takes 1..{MAX_TOKENS} tokens, got {t}")
        if t not in self._scratch:
            dev = x.device
            self._scratch[t] = (
                torch.empty((t, self.num_experts), dtype=torch.float32, device=dev),
                torch.zeros(1, dtype=torch.int32, device=dev),
            )
        scores, cnt = self._scratch[t]
        xn = torch.empty((t, self.hidden), dtype=torch.bfloat16, device=x.device)
        ids = torch.empty((t, self.top_k), dtype=torch.int32, device=x.device)
        wts = torch.empty((t, self.top_k), dtype=torch.float32, device=x.device)
        launch = self.launch.at(t)
        compiled = _router[(self.num_experts // self.BLOCK_E,)](
            x,
            x.stride(0),
            self.norm_weight,
            self.weight,
            self.bias,
            xn,
            scores,
            cnt,
            ids,
            wts,
            self.counter,
            self.eps,
            self.scaling,
            T=t,
            BLOCK_T=triton.next_power_of_2(t),
            HID=self.hidden,
            E=self.num_experts,
            GROUPS=self.n_group,
            KEEP_GROUPS=self.topk_group,
            TOPK=self.top_k,
            RENORM=self.renormalize,
            BLOCK_E=self.BLOCK_E,
            BLOCK_K=self.block_k,
            HID_POW2=triton.next_power_of_2(self.hidden),
            SELECT=self._selects_in_launch(t),
            PDL=launch.pdl,
            PREFETCH=32 * self.WARPS if launch.prefetch else 0,
            UNROLL=self.unroll,
            num_warps=self.WARPS,
            **launch.options,
        )
        launch.record("router", compiled)
        if not self._selects_in_launch(t):
            compiled = _router_select[(t,)](
                scores,
                self.bias,
                ids,
                wts,
                self.select_counter,
                self.scaling,
                E=self.num_experts,
                GROUPS=self.n_group,
                KEEP_GROUPS=self.topk_group,
                TOPK=self.top_k,
                RENORM=self.renormalize,
                PDL=launch.pdl,
                num_warps=1,
                **launch.options,
            )
            launch.record("router_select", compiled)
        return xn, ids, wts


@triton.jit
def _rmsnorm(
    x_ptr, stride_x, w_ptr, o_ptr, stride_o, count_ptr, eps, K: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr
):
    after_previous_kernel(PDL)
    t = tl.program_id(0)
    if t == 0:
        tl.atomic_add(count_ptr, 1)
    rk = tl.arange(0, BLOCK)
    ok = rk < K
    x = tl.load(x_ptr + t * stride_x + rk, mask=ok, other=0.0).to(tl.float32)
    r = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / K + eps)
    w = tl.load(w_ptr + rk, mask=ok, other=0.0).to(tl.float32)
    store_rounded(o_ptr + t * stride_o + rk, w * round_bf16(x * r), ok)


def rmsnorm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    counter: torch.Tensor,
    launch: LaunchPolicy = PLAIN,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """RMSNorm of each row of x [T, K] (bf16), rounded like solo.model.layers.RMSNorm, into `out` [T, K]
    (rows of unit stride, e.g. a column slice of a wider buffer) or a new tensor."""
    if out is None:
        out = torch.empty_like(x)
    elif out.shape != x.shape or out.stride(-1) != 1 or x.stride(-1) != 1:
        raise ValueError(f"rmsnorm: out {tuple(out.shape)} must match x {tuple(x.shape)}, rows of unit stride")
    k = x.shape[1]
    launch = launch.at(x.shape[0])
    compiled = _rmsnorm[(x.shape[0],)](
        x,
        x.stride(0),
        weight,
        out,
        out.stride(0),
        counter,
        eps,
        K=k,
        BLOCK=triton.next_power_of_2(k),
        PDL=launch.pdl,
        **launch.options,
    )
    launch.record("rmsnorm", compiled)
    return out

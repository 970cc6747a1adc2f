"""One GEMV kernel for every projection of the GPU decode step, with its neighbours fused in.

At batch size 1 a projection reads its weight once and does one multiply-add per weight, so it is a
stream of weight bytes; what kills it is the work around it when each piece is its own launch. This
kernel computes out[t] = epilogue(W prologue(x[t])) for T <= 16 tokens (decode, verification):

prologue (on the activation side, recomputed by every program from L2-resident x):
  NORM_NONE   x as given;
  NORM_RMS    RMSNorm over K with a weight (input/post-attention norms), rounded like the reference
              (normalise in fp32, round to bf16, multiply by the bf16 weight, round); program 0 can
              write the normalised x for later kernels (`xn_out`);
  NORM_GATED  per-group RMSNorm (groups of the norm weight's length, the KDA output norm: one
              group per head) times sigmoid(gate);
weights: FP8 E4M3 with 128x128 block scales (folded into x: every scale is a power of two, so the
  product is exact), FP8 with one scale per row (the LM head), or BF16;
products: one token on the CUDA cores; several FP8 tokens (verification) on the tensor cores, the
  weight tile as the left operand and the tokens padded to 16 columns (`GemvConfig.dot`);
epilogue:
  EPI_STORE   out = y;
  EPI_RESIDUAL out = residual + y (+ addend): the residual stream updated in place;
  EPI_SWIGLU  W = [gate rows; up rows]: out = silu(g) * u (Ling's optional clamp), half the rows.

Each program owns BLOCK_N rows (inside one 128-row scale block) and a slice of K; when K is split
(small N: too few programs to keep the memory system busy) the last program to arrive sums the
fp32 partials in a fixed order and applies the epilogue, then resets its counter (CUDA-graph
replays need no memset). Program (0, 0) bumps a launch counter: start-up checks read it to prove the
kernel ran inside captured graphs. Static shapes, no host synchronisation.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from dataclasses import dataclass
from importlib import resources

import torch
import triton
import triton.language as tl

from solo.kernels.pdl import PLAIN, LaunchPolicy, after_previous_kernel
from solo.kernels.triton_epilogues import round_bf16
from solo.kernels.triton_fp8 import interpreter_mode, require_triton_device

NORM_NONE, NORM_RMS, NORM_GATED = 0, 1, 2
SCALE_NONE, SCALE_BLOCK, SCALE_ROW = 0, 1, 2
EPI_STORE, EPI_RESIDUAL, EPI_SWIGLU = 0, 1, 2
MAX_TOKENS = 16


@triton.jit
def store_rounded(ptr, y, mask):
    """Store fp32 y into ptr's dtype, rounding to nearest for bf16 outputs (see round_bf16)."""
    if ptr.dtype.element_ty == tl.bfloat16:
        y = round_bf16(y)
    tl.store(ptr, y.to(ptr.dtype.element_ty), mask=mask)


@triton.jit
def _prologue(
    x_ptr,
    stride_x,
    nw_ptr,
    gate_ptr,
    stride_gate,
    rstd,
    rt,
    rk,
    t_ok,
    eps,
    NORM: tl.constexpr,
    K: tl.constexpr,
    GROUP: tl.constexpr,
):
    """x[rt, rk] after the prologue, in fp32 (values rounded to bf16 as the reference does)."""
    k_ok = rk < K
    ok = t_ok[:, None] & k_ok[None, :]
    x = tl.load(x_ptr + rt[:, None] * stride_x + rk[None, :], mask=ok, other=0.0).to(tl.float32)
    if NORM == 1:
        w = tl.load(nw_ptr + rk, mask=k_ok, other=0.0).to(tl.float32)
        x = round_bf16(round_bf16(x * rstd[:, None]) * w[None, :])
    elif NORM == 2:
        # this chunk is one group: its own RMS (the bf16 input, as the reference rounds o to bf16 first)
        x = round_bf16(x)
        ms = tl.sum(x * x, axis=1) / GROUP
        r = 1.0 / tl.sqrt(ms + eps)
        w = tl.load(nw_ptr + (rk % GROUP), mask=k_ok, other=0.0).to(tl.float32)
        g = tl.load(gate_ptr + rt[:, None] * stride_gate + rk[None, :], mask=ok, other=0.0).to(tl.float32)
        x = round_bf16(w[None, :] * (x * r[:, None]) * tl.sigmoid(g))
    return x


@triton.jit
def _accumulate(
    acc,
    w,
    x,
    s_ptr,
    scale_row,
    k0,
    rk,
    k_ok,
    KB: tl.constexpr,
    SCALE: tl.constexpr,
    DOT: tl.constexpr,
    BLOCK_T: tl.constexpr,
):
    """acc + this K chunk's products of weight rows w [BLOCK_N, BLOCK_K] (scale block row `scale_row`)
    with the tokens x [BLOCK_T, BLOCK_K], in the accumulator layout of the path (see _fused_gemv)."""
    if DOT:
        part = tl.dot(w.to(tl.float16), tl.trans(x.to(tl.float16)))
        if SCALE == 1:
            part = part * tl.load(s_ptr + scale_row * KB + k0 // 128)
    else:
        xs = x
        if SCALE == 1:
            s = tl.load(s_ptr + scale_row * KB + rk // 128, mask=k_ok, other=0.0)
            xs = x * s[None, :]
        if BLOCK_T == 1:
            part = w.to(tl.float32) * tl.sum(xs, axis=0)[None, :]
        else:
            part = w.to(tl.float32)[None, :, :] * xs[:, None, :]
    return acc + part


@triton.jit
def _fused_gemv(
    x_ptr,
    stride_x,
    nw_ptr,
    gate_ptr,
    stride_gate,
    w_ptr,
    s_ptr,
    o_ptr,
    stride_o,
    r_ptr,
    stride_r,
    a_ptr,
    stride_a,
    xn_ptr,
    stride_xn,
    part_ptr,
    cnt_ptr,
    count_ptr,
    eps,
    limit,
    T: tl.constexpr,
    N: tl.constexpr,
    K: tl.constexpr,
    HALF: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr,
    NORM: tl.constexpr,
    SCALE: tl.constexpr,
    EPI: tl.constexpr,
    ADD: tl.constexpr,
    HAS_LIMIT: tl.constexpr,
    WRITE_XN: tl.constexpr,
    K_POW2: tl.constexpr,
    DOT: tl.constexpr,
    PDL: tl.constexpr,
):
    after_previous_kernel(PDL)
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    if pid_n == 0 and pid_k == 0:
        tl.atomic_add(count_ptr, 1)
    ROWS: tl.constexpr = HALF if EPI == 2 else N
    KB: tl.constexpr = (K + 127) // 128
    K_PER: tl.constexpr = (K + SPLIT_K * BLOCK_K - 1) // (SPLIT_K * BLOCK_K) * BLOCK_K
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rt = tl.arange(0, BLOCK_T)
    n_ok = rn < ROWS
    t_ok = rt < T
    rn64 = rn.to(tl.int64)
    k_begin = pid_k * K_PER
    k_end = tl.minimum(k_begin + K_PER, K)

    rstd = tl.zeros((BLOCK_T,), dtype=tl.float32)
    if NORM == 1 and DOT:  # RMS over K in chunks: 16 padded rows of all of K would not fit in registers
        ss = tl.zeros((BLOCK_T,), dtype=tl.float32)
        for c0 in range(0, K, BLOCK_K):
            rc = c0 + tl.arange(0, BLOCK_K)
            c_ok = t_ok[:, None] & (rc < K)[None, :]
            xc = tl.load(x_ptr + rt[:, None] * stride_x + rc[None, :], mask=c_ok, other=0.0).to(tl.float32)
            ss += tl.sum(xc * xc, axis=1)
        rstd = 1.0 / tl.sqrt(ss / K + eps)
    elif NORM == 1:  # RMS over all of K first, in one load (x is a few KB and sits in L2)
        rk_all = tl.arange(0, K_POW2)
        x_ok = t_ok[:, None] & (rk_all < K)[None, :]
        xv = tl.load(x_ptr + rt[:, None] * stride_x + rk_all[None, :], mask=x_ok, other=0.0).to(tl.float32)
        rstd = 1.0 / tl.sqrt(tl.sum(xv * xv, axis=1) / K + eps)

    row_block = (pid_n * BLOCK_N) // 128  # the rows' FP8 scale block (BLOCK_N divides 128)
    up_block = (HALF + pid_n * BLOCK_N) // 128
    # otherwise: multiply-adds on the CUDA cores into [tokens, rows, K chunk] accumulators, summed once
    # after the loop (one token; and BF16 weights, which fp16 operands would round)
    # DOT (several tokens, FP8 weights): tensor cores with the weights as the left operand, [BLOCK_N,
    # BLOCK_K] x [BLOCK_K, BLOCK_T >= 16]; FP8 codes widen exactly to fp16, as do the bf16-rounded
    # activations in fp16's normal range (tinier ones lose bits far below the result's bf16 rounding);
    # the tile's block scale multiplies the fp32 product (one scale per tile: BLOCK_K divides 128)
    if DOT:
        acc = tl.zeros((BLOCK_N, BLOCK_T), dtype=tl.float32)
        acc_u = tl.zeros((BLOCK_N, BLOCK_T), dtype=tl.float32)
    elif BLOCK_T == 1:
        acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
        acc_u = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    else:
        acc = tl.zeros((BLOCK_T, BLOCK_N, BLOCK_K), dtype=tl.float32)
        acc_u = tl.zeros((BLOCK_T, BLOCK_N, BLOCK_K), dtype=tl.float32)
    for k0 in range(k_begin, k_end, BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K)
        k_ok = rk < K
        x = _prologue(x_ptr, stride_x, nw_ptr, gate_ptr, stride_gate, rstd, rt, rk, t_ok, eps, NORM, K, BLOCK_K)
        if WRITE_XN:  # noqa: SIM102 (a compile-time branch around a runtime one)
            if pid_n == 0:
                store_rounded(xn_ptr + rt[:, None] * stride_xn + rk[None, :], x, t_ok[:, None] & k_ok[None, :])
        w = tl.load(w_ptr + rn64[:, None] * K + rk[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        acc = _accumulate(acc, w, x, s_ptr, row_block, k0, rk, k_ok, KB, SCALE, DOT, BLOCK_T)
        if EPI == 2:
            wu = tl.load(
                w_ptr + (rn64 + HALF)[:, None] * K + rk[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0
            )
            acc_u = _accumulate(acc_u, wu, x, s_ptr, up_block, k0, rk, k_ok, KB, SCALE, DOT, BLOCK_T)

    if DOT:
        y = tl.trans(acc)  # [BLOCK_T, BLOCK_N]
        yu = tl.trans(acc_u)
    elif BLOCK_T == 1:
        y = tl.sum(acc, axis=1)[None, :]  # [1, BLOCK_N]
        yu = tl.sum(acc_u, axis=1)[None, :]
    else:
        y = tl.sum(acc, axis=2)  # [BLOCK_T, BLOCK_N]
        yu = tl.sum(acc_u, axis=2)

    TILE: tl.constexpr = BLOCK_T * BLOCK_N
    last = True
    if SPLIT_K > 1:  # park the partial; the last of the SPLIT_K programs of these rows finishes
        flat = tl.arange(0, TILE)
        base = part_ptr + pid_n * (SPLIT_K * 2 * TILE)
        tl.store(base + pid_k * TILE + flat, tl.reshape(y, (TILE,)))
        if EPI == 2:
            tl.store(base + (SPLIT_K + pid_k) * TILE + flat, tl.reshape(yu, (TILE,)))
        tl.debug_barrier()
        arrived = tl.atomic_add(cnt_ptr + pid_n, 1, sem="acq_rel", scope="gpu")
        last = arrived == SPLIT_K - 1
        if last:
            total = tl.zeros((TILE,), dtype=tl.float32)
            total_u = tl.zeros((TILE,), dtype=tl.float32)
            for j in tl.static_range(SPLIT_K):
                total += tl.load(base + j * TILE + flat, cache_modifier=".cg")
                if EPI == 2:
                    total_u += tl.load(base + (SPLIT_K + j) * TILE + flat, cache_modifier=".cg")
            y = tl.reshape(total, (BLOCK_T, BLOCK_N))
            yu = tl.reshape(total_u, (BLOCK_T, BLOCK_N))
            tl.atomic_xchg(cnt_ptr + pid_n, 0, sem="relaxed", scope="gpu")
    if last:
        if SCALE == 2:
            rs = tl.load(s_ptr + rn, mask=n_ok, other=0.0)
            y = y * rs[None, :]
        ok = t_ok[:, None] & n_ok[None, :]
        if EPI == 2:
            act = y / (1.0 + tl.exp(-y))
            if HAS_LIMIT:
                act = tl.minimum(act, limit)
                yu = tl.minimum(tl.maximum(yu, -limit), limit)
            out = act * yu
        elif EPI == 1:
            resid = tl.load(r_ptr + rt[:, None] * stride_r + rn[None, :], mask=ok, other=0.0).to(tl.float32)
            # the reference adds in the stream's dtype: round y first, like its bf16 projection output
            out = resid + round_bf16(y)
            if ADD:
                add = tl.load(a_ptr + rt[:, None] * stride_a + rn[None, :], mask=ok, other=0.0).to(tl.float32)
                out = out + add
        else:
            out = y
        store_rounded(o_ptr + rt[:, None] * stride_o + rn[None, :], out, ok)


@dataclass(frozen=True)
class GemvConfig:
    block_n: int = 32
    block_k: int = 128
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 3
    dot: bool = False  # tensor cores (several tokens, padded to 16)


TARGET_PROGRAMS = 264  # about two programs per SM on an H200 (132 SMs)
TUNED_TABLES = {(9, 0): "fused_gemv_sm90.json"}  # measured by dev/fused_gemv_sweep.py on the lent H200


def tuned_key(rows: int, k: int, tokens: int, kind: str) -> str:
    """The tuned table's key of one call shape: output rows, K, tokens, and plain / gated / swiglu."""
    return f"{rows}x{k}:T{tokens}:{kind}"


@functools.cache
def tuned_table(capability: tuple[int, int]) -> dict[str, GemvConfig]:
    """The measured best configuration per call shape for a GPU generation (empty if none shipped)."""
    name = TUNED_TABLES.get(capability)
    if name is None:
        return {}
    path = resources.files("solo.kernels.tuned").joinpath(name)
    if not path.is_file():
        return {}
    data = json.loads(path.read_text())
    return {key: GemvConfig(**cfg) for key, cfg in data["configs"].items()}


def choose_config(
    rows: int, k: int, tokens: int, kind: str = "plain", device: torch.device | None = None, fp8: bool = True
) -> GemvConfig:
    """The tuned configuration of this call shape on this GPU if one was measured (`dev/fused_gemv_sweep.py`
    writes the table), else a rule: one token on the CUDA cores with 32 rows per program (so the
    activation-side work of the prologue is small next to the weight work: with 8 rows it dominated,
    0.35-0.6 TB/s on the H200), several on the tensor cores (2.2-3.9x faster than the CUDA cores at 4
    tokens in the sweep), K split until about two programs per SM run. (Triton's CPU interpreter runs
    programs one after another: there, the fewest.) BF16 weights (`fp8=False`) stay on the CUDA cores:
    fp16 operands would round them."""
    if interpreter_mode():
        return GemvConfig(block_n=128 if tokens == 1 else 64, block_k=128, split_k=1, dot=tokens > 1 and fp8)
    if device is not None and device.type == "cuda":
        hit = tuned_table(torch.cuda.get_device_capability(device)).get(tuned_key(rows, k, tokens, kind))
        if hit is not None and (fp8 or not hit.dot):
            return hit
    if tokens > 1 and fp8:  # tensor cores
        block_n, block_k, stages, dot = 64, 128, 2, True
    else:
        block_n, block_k, stages, dot = 32, 128 if tokens == 1 else 64, 3, False
    chunks = triton.cdiv(k, block_k)
    split = 1
    while triton.cdiv(rows, block_n) * split < TARGET_PROGRAMS and split * 2 <= min(8, chunks // 2):
        split *= 2
    return GemvConfig(block_n=block_n, block_k=block_k, split_k=split, num_stages=stages, dot=dot)


class FusedGemv:
    """One projection of the decode step: its weight, how to run it, and its scratch.

    `weight` [N, K] float8_e4m3fn or bf16; `scale` the [ceil(N/128), ceil(K/128)] block scales
    (`scale_kind="block"`), [N] row scales ("row") or None (bf16). `swiglu_half`: W is [gate; up]
    with this many gate rows (the output has that many columns)."""

    family = "gemv"  # its launch counter's kernel family (solo.fastpath.decode_step.FAMILIES)

    def __init__(
        self,
        weight: torch.Tensor,
        scale: torch.Tensor | None,
        scale_kind: str = "block",
        swiglu_half: int | None = None,
        swiglu_limit: float | None = None,
        counter: torch.Tensor | None = None,
        name: str = "gemv",
        launch: LaunchPolicy = PLAIN,
    ) -> None:
        require_triton_device("the fused decode step", weight.device)
        if weight.ndim != 2 or not weight.is_contiguous():
            raise ValueError(f"{name}: weight must be a contiguous [N, K] matrix")
        if weight.dtype not in (torch.float8_e4m3fn, torch.bfloat16):
            raise ValueError(f"{name}: weight must be float8_e4m3fn or bfloat16, got {weight.dtype}")
        self.name = name
        self.launch = launch
        self.weight = weight
        self.n, self.k = weight.shape
        self.scale_mode = (
            {"block": SCALE_BLOCK, "row": SCALE_ROW}.get(scale_kind, SCALE_NONE) if scale is not None else 0
        )
        if weight.dtype == torch.float8_e4m3fn and self.scale_mode == SCALE_NONE:
            raise ValueError(f"{name}: an FP8 weight needs its scales")
        self.scale = scale.float().contiguous() if scale is not None else weight  # (unused pointer when none)
        self.half = swiglu_half
        if swiglu_half is not None and (2 * swiglu_half != self.n or swiglu_half % 128 and self.scale_mode == 1):
            raise ValueError(f"{name}: SwiGLU weights are [gate; up] with 128-row aligned halves")
        self.limit = swiglu_limit
        self.rows = swiglu_half if swiglu_half is not None else self.n
        self.out_features = self.rows
        self.counter = counter if counter is not None else torch.zeros(1, dtype=torch.int32, device=weight.device)
        self._configs: dict[int, GemvConfig] = {}
        self._scratch: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def config(self, tokens: int, gated: bool = False) -> GemvConfig:
        if tokens not in self._configs:
            kind = "swiglu" if self.half is not None else "gated" if gated else "plain"
            fp8 = self.weight.dtype == torch.float8_e4m3fn
            self._configs[tokens] = choose_config(self.rows, self.k, tokens, kind, self.weight.device, fp8)
        return self._configs[tokens]

    def set_config(self, tokens: int, config: GemvConfig) -> None:
        self._configs[tokens] = config
        self._scratch.pop(tokens, None)

    def nbytes(self) -> int:
        return self.weight.nbytes + (self.scale.nbytes if self.scale_mode else 0)

    def __call__(
        self,
        x: torch.Tensor,
        out: torch.Tensor | None = None,
        *,
        norm_weight: torch.Tensor | None = None,
        gate: torch.Tensor | None = None,
        eps: float = 1e-6,
        residual: torch.Tensor | None = None,
        addend: torch.Tensor | None = None,
        xn_out: torch.Tensor | None = None,
        out_dtype: torch.dtype = torch.bfloat16,
    ) -> torch.Tensor:
        """x [T, K] -> out [T, rows]; see the module docstring for the prologue and epilogue options."""
        t = x.shape[0]
        if x.ndim != 2 or x.shape[1] != self.k or x.stride(1) != 1:
            raise ValueError(f"{self.name}: x must be a row-major [T, {self.k}] tensor, got {tuple(x.shape)}")
        if not 1 <= t <= MAX_TOKENS:
            raise ValueError(f"{self.name}: the fused GEMV takes 1..{MAX_TOKENS} tokens, got {t}")
        if out is None:
            out = torch.empty((t, self.rows), dtype=out_dtype, device=x.device)
        norm = NORM_NONE
        if norm_weight is not None:
            norm = NORM_GATED if gate is not None else NORM_RMS
        epi = EPI_SWIGLU if self.half is not None else (EPI_RESIDUAL if residual is not None else EPI_STORE)
        cfg = self.config(t, gated=norm == NORM_GATED)
        if norm == NORM_GATED:  # one K chunk per norm group
            group = norm_weight.numel()
            if self.k % group or group & (group - 1):
                raise ValueError(f"{self.name}: the gated norm's group ({group}) must be a power of two dividing K")
            cfg = dataclasses.replace(cfg, block_k=group)
        if self.scale_mode == SCALE_BLOCK and 128 % cfg.block_n:
            raise ValueError(f"{self.name}: BLOCK_N must divide 128 for block scales")
        if cfg.dot and (128 % cfg.block_k or cfg.block_k < 16 or cfg.block_n < 16 or not self.scale_mode):
            raise ValueError(
                f"{self.name}: the tensor-core GEMV needs FP8 weights, 16 <= BLOCK_K dividing 128 and BLOCK_N >= 16"
            )
        block_t = max(16, triton.next_power_of_2(t)) if cfg.dot else triton.next_power_of_2(t)
        grid = (triton.cdiv(self.rows, cfg.block_n), cfg.split_k)
        part, cnt = self._scratch_for(t, cfg, grid[0], block_t)
        dummy = out
        launch = self.launch.at(t)
        compiled = _fused_gemv[grid](
            x,
            x.stride(0),
            norm_weight if norm_weight is not None else dummy,
            gate if gate is not None else dummy,
            gate.stride(0) if gate is not None else 0,
            self.weight,
            self.scale,
            out,
            out.stride(0),
            residual if residual is not None else dummy,
            residual.stride(0) if residual is not None else 0,
            addend if addend is not None else dummy,
            addend.stride(0) if addend is not None else 0,
            xn_out if xn_out is not None else dummy,
            xn_out.stride(0) if xn_out is not None else 0,
            part,
            cnt,
            self.counter,
            eps,
            float(self.limit) if self.limit is not None else 0.0,
            T=t,
            N=self.n,
            K=self.k,
            HALF=self.half or 0,
            BLOCK_T=block_t,
            BLOCK_N=cfg.block_n,
            BLOCK_K=cfg.block_k,
            SPLIT_K=cfg.split_k,
            NORM=norm,
            SCALE=self.scale_mode,
            EPI=epi,
            ADD=addend is not None,
            HAS_LIMIT=self.limit is not None,
            WRITE_XN=xn_out is not None,
            K_POW2=triton.next_power_of_2(self.k),
            DOT=cfg.dot,
            PDL=launch.pdl,
            num_warps=cfg.num_warps,
            num_stages=cfg.num_stages,
            **launch.options,
        )
        launch.record(self.family, compiled)
        return out

    def _scratch_for(self, tokens: int, cfg: GemvConfig, programs: int, block_t: int):
        """Split-K partials and self-resetting counters, allocated once per token count (graphs point at them)."""
        if cfg.split_k == 1:
            return self.counter, self.counter
        if tokens not in self._scratch:
            dev = self.weight.device
            part = torch.empty(programs * cfg.split_k * 2 * block_t * cfg.block_n, dtype=torch.float32, device=dev)
            self._scratch[tokens] = (part, torch.zeros(programs, dtype=torch.int32, device=dev))
        return self._scratch[tokens]

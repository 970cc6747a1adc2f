"""The decode step's projections and routers as CUDA kernels (Hopper, NVRTC).

`CudaGemv` and `CudaRouter` take over the calls of a `FusedGemv` / `FusedRouter` of up to
`max_tokens` tokens (decode: one; NEXTN verification: the window; same arguments, same results up
to fp32 summation order) and hand larger calls back to the Triton kernels, which also stay the
CPU-interpreter path the tests run.
The kernels are solo/kernels/cuda/gemv_decode.cu and router_decode.cu (their headers say why they
are faster); they are compiled for the exact shapes by NVRTC and cached on disk
(solo.kernels.cuda_runtime), and each bumps its own launch counter, so the start-up check can tell
that they, not the Triton kernels, ran inside the captured graphs.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from solo.kernels.fused_gemv import EPI_RESIDUAL, EPI_STORE, EPI_SWIGLU, NORM_GATED, NORM_NONE, NORM_RMS, FusedGemv
from solo.kernels.fused_router import FusedRouter
from solo.kernels.pdl import LaunchPolicy

GEMV_SOURCE = Path(__file__).parent / "cuda" / "gemv_decode.cu"
MAX_TOKENS = 8  # the kernels' B fragment has 8 columns: tokens per call they take
ROUTER_SOURCE = Path(__file__).parent / "cuda" / "router_decode.cu"


def cuda_step_unavailable(device: torch.device | str) -> str | None:
    """Why the CUDA step kernels cannot run on `device` (None: they can)."""
    device = torch.device(device)
    if device.type != "cuda" or not torch.cuda.is_available():
        return f"the CUDA step kernels run on an NVIDIA GPU; the model is on '{device.type}'"
    major, minor = torch.cuda.get_device_capability(device)
    if major < 9:
        return f"the CUDA step kernels need compute capability 9.0 (Hopper) or later, not {major}.{minor}"
    try:
        from solo.kernels.cuda_runtime import nvrtc

        nvrtc()
    except RuntimeError as exc:
        return f"the CUDA step kernels are compiled by NVRTC, which is missing: {exc}"
    return None


@dataclass(frozen=True)
class Handoff:
    """A GEMV that hands its rows over before it ends (gemv_decode.cu SIGNAL): output rows [last_start,
    last_end) are computed last, and each block adds 1 to `counter` (int32, on the device) once the other
    rows it computes are stored and visible. A consumer that needs only those other rows waits for
    `CudaGemv.last_signals` signals (the KDA recurrence: q, k, v, f and b, while the output gate g still
    streams). Both bounds are multiples of 8 (the kernel's tasks)."""

    counter: torch.Tensor
    last_start: int
    last_end: int


@dataclass(frozen=True)
class GemvLaunch:
    """How one projection's kernel runs: warps per block (they split K; 0: chosen by `choose_launch`),
    blocks per SM (at most; fewer where registers or shared memory allow fewer), loads in flight per
    lane (at most) and whether the persistent grid is balanced (`persistent_grid`)."""

    warps: int = 0
    blocks_per_sm: int = 16
    max_in_flight: int = 8
    balanced: bool = False
    carveout: int = 50  # the share (%) of the SM's shared memory the kernel prefers, the rest L1; -1: the driver's
    # > 0: the weights stream through a ring of shared-memory slots filled by bulk copies (gemv_decode.cu
    # BULK), this many blocks an SM, each with as many slots as fit (at most `slots`; the kernel then asks
    # for all of the shared memory, carveout 100); 0: loads into registers. Where fewer than two slots fit
    # (several tokens of a wide K), the call loads into registers.
    bulk: int = 0
    slots: int = 12
    # a block's tasks after its first two taken from a counter as it goes (gemv_decode.cu DYNAMIC), so the
    # blocks that start early or stream faster take more; the same results bit for bit. Only on the
    # register path in the plain order (no bulk ring, hand-off or late wait). Off: +157 us on the decode
    # step at 32K on the H100 (docs/results/h100_ab_dynamic_tasks.log), in a build that spills.
    dynamic: bool = False
    # > 0: a block also asks the L2 for whole tasks' weights (bulk prefetches, gemv_decode.cu L2_AHEAD),
    # beyond the registers' loads in flight: its first l2_ahead tasks before it waits for the previous
    # kernel, then (l2_loop) the task l2_ahead positions ahead as each task ends; a hint, the same results
    l2_ahead: int = 0
    l2_loop: bool = True
    # 128 or 256: a weight load that misses fetches that many bytes into the L2 (PTX prefetch size,
    # gemv_decode.cu via step_common.cuh L2_FETCH); 0: the load's own sectors
    l2_fetch: int = 0
    # > 0: the kernel is built for at least this many blocks an SM (MIN_BLOCKS, __launch_bounds__' second
    # argument: ptxas caps its registers and may spill); a lab switch (at 16 warps the output projections
    # build to 74 registers, one block an SM, so 56 of their 132 blocks run a third task)
    min_blocks: int = 0
    # > 0: at most this many blocks (the persistent grid over them); a lab switch for a kernel that runs beside the
    # persistent MoE kernel on the SMs it leaves free (PersistentDecodeMoE.set_blocks)
    max_grid: int = 0
    # the launch of the calls of several tokens (NEXTN verification's window), where it is not this one's
    # (None: every call runs this launch); one-token calls, the decode step, always run this one
    window: GemvLaunch | None = None


def persistent_grid(tasks: int, resident: int, balanced: bool = False) -> int:
    """Blocks of a persistent GEMV grid: block b runs tasks b, b + grid, ... With every resident block
    (`resident`: blocks per SM x SMs) the last round of tasks can be a few blocks' while the others have
    finished (e.g. the KDA projections' 2,564 tasks over 792 blocks, six an SM: 188 blocks run a fourth
    task), with too few loads in flight to keep HBM busy. Balanced: as many rounds, over the fewest
    blocks that need no more, so that every block runs that many tasks (fewer than `rounds` blocks one
    task fewer): 641 blocks of 4 tasks there. Measured in the step it lost (2.534 against 2.510 ms at 32K,
    docs/results/h200_launch_ab_oproj_balanced.log), so `GemvLaunch.balanced` stays off."""
    grid = min(tasks, resident)
    if balanced and grid > 0:
        rounds = -(-tasks // grid)
        grid = -(-tasks // rounds)
    return grid


# Shared memory a block may take on an SM of the H100 / H200 (232,448 bytes; 1 KB of each SM's 228 KB is
# the driver's per block)
SHARED_PER_SM = 233_472
SHARED_PER_BLOCK = 232_448


def bulk_ring(
    tokens: int, k: int, warps: int, swiglu: bool, cfg: GemvLaunch, tasks: int, sms: int, scales: bool = False
) -> tuple[int, int]:
    """(slots, dynamic shared bytes) of gemv_decode.cu's BULK ring: as many task slots as fit beside the
    block's struct Shared in its share of an SM (cfg.bulk blocks an SM), at most cfg.slots and at most the
    tasks a block runs; (0, 0) where fewer than two fit (the call then loads into registers). `scales`:
    each slot holds its task's row of block scales too (SCALE_IN_SLOT)."""
    if scales and -(-k // 128) % 4:
        raise ValueError(f"K = {k}: a row of block scales is not whole 16-byte pieces (SCALE_IN_SLOT)")
    base = tokens * (2 * k + 128 * warps + 4 * warps)
    slot_bytes = (2 if swiglu else 1) * (8 * (k + 64) + (4 * -(-k // 128) if scales else 0))
    budget = min(SHARED_PER_BLOCK, SHARED_PER_SM // cfg.bulk - 1024)
    per_block = -(-tasks // (min(cfg.bulk * sms, cfg.max_grid) if cfg.max_grid > 0 else cfg.bulk * sms))

    def size(slots: int) -> int:
        barriers = -(-base // 8) * 8 + 8 * slots
        return -(-barriers // 128) * 128 + slots * slot_bytes

    slots = max(2, min(cfg.slots, per_block))
    while slots >= 2 and size(slots) > budget:
        slots -= 1
    return (slots, size(slots)) if slots >= 2 else (0, 0)


def task_order(rows: int, last_start: int, last_end: int) -> tuple[int, int]:
    """(ROTATE, SIGNAL) of gemv_decode.cu for a hand-off whose rows [last_start, last_end) come last: the
    8-row tasks run from the one after them on (mod the task count), so that they end the order, and the
    first SIGNAL tasks of the order are all the others."""
    if last_start % 8 or last_end % 8 or not 0 <= last_start < last_end <= rows:
        raise ValueError(
            f"a hand-off's last rows must be a non-empty range of whole 8-row tasks within {rows} rows, "
            f"not [{last_start}, {last_end})"
        )
    tasks = -(-rows // 8)
    return (last_end // 8) % tasks, tasks - (last_end - last_start) // 8


# projections of at least this many rows (q|k|v|f|g|b, MLA q|kv_a|g, the dense MLP's gate_up) are "big"
BIG_PROJECTION_ROWS = 4096


# Cards (torch.cuda.get_device_name) on which NEXTN verification's big projections stream their weights
# through bulk rings of 2 blocks of 10 warps an SM (WINDOW_RING). Measured in the whole verification step at
# full shape, 32K, against the register path: on the H100 4.92 / 4.86 / 4.88 ms against 5.05 / 4.99 / 4.99
# (three device calls, docs/results/h100_ab_lab23.log, _lab24, _lab25), and as the product 4.93 / 4.91 against
# 5.02 (h100_ab_lab26.log), the decode step unchanged. Not on the H200 until measured there: its step kernels
# were chosen on it, and the ring has not run on one.
WINDOW_RING_CARDS = ("NVIDIA H100 80GB HBM3",)
WINDOW_RING = GemvLaunch(warps=10, bulk=2)


def choose_launch(rows: int, card: str = "") -> GemvLaunch:
    """Measured on the H200 (dev/step_kernels_probe.py, docs/performance.md): many rows (q|k|v|f|g|b,
    MLA q|kv_a|g, dense gate_up: thousands of 8-row tasks) run best as many small blocks of 4 warps;
    a few hundred tasks (2,560 output rows) as blocks of up to 16 warps that split K finely. On the cards
    of WINDOW_RING_CARDS (`card`: the GPU's name) the big projections' verification calls run WINDOW_RING."""
    if rows < BIG_PROJECTION_ROWS:
        return GemvLaunch(warps=16)
    return GemvLaunch(warps=4, window=WINDOW_RING if card in WINDOW_RING_CARDS else None)


def warps_for(k: int, wanted: int) -> int:
    """The warp count nearest below `wanted` that divides K's 64-column steps."""
    steps = k // 64
    for w in range(min(wanted, steps, 32), 0, -1):
        if steps % w == 0:
            return w
    return 1


def in_flight(steps_per_warp: int, most: int) -> int:
    """The largest divisor of a warp's steps that is at most `most` (the ring of loads must tile them)."""
    return max(d for d in range(1, min(most, steps_per_warp) + 1) if steps_per_warp % d == 0)


def _row_major(t: torch.Tensor, tokens: int, width: int) -> bool:
    """[tokens, width] bf16 rows of unit stride (a row stride of its own is fine: the kernels take it)."""
    return t.ndim == 2 and tuple(t.shape) == (tokens, width) and t.stride(1) == 1 and t.dtype == torch.bfloat16


class CudaGemv:
    """The calls of `fused` (a FusedGemv with FP8 weights) of up to `max_tokens` tokens on gemv_decode.cu."""

    family = "cuda_gemv"  # its launch counter's kernel family (solo.fastpath.decode_step.FAMILIES)

    def __init__(
        self, fused: FusedGemv, counter: torch.Tensor, launch: GemvLaunch | None = None, max_tokens: int = MAX_TOKENS
    ) -> None:
        if not 1 <= max_tokens <= MAX_TOKENS:
            raise ValueError(f"the CUDA GEMV takes 1..{MAX_TOKENS} tokens per call, not {max_tokens}")
        if fused.scale_mode not in (1, 2):
            raise ValueError(f"{fused.name}: the CUDA GEMV runs FP8 weights with block or row scales")
        if fused.weight.dtype != torch.float8_e4m3fn:
            raise ValueError(f"{fused.name}: the CUDA GEMV runs FP8 weights, not {fused.weight.dtype}")
        if fused.k % 64 or fused.weight.data_ptr() % 16:
            raise ValueError(f"{fused.name}: the CUDA GEMV needs K % 64 == 0 and a 16-byte aligned weight")
        self.fused = fused
        self.name = fused.name
        self.rows = fused.rows
        self.k = fused.k
        self.counter = counter
        self.max_tokens = max_tokens
        self.device = fused.weight.device
        self.sms = torch.cuda.get_device_properties(self.device).multi_processor_count
        # the product's launch for this card unless one is given (GemvLaunch.window: verification's)
        self.card = torch.cuda.get_device_name(self.device)
        self.launch_config = launch or choose_launch(self.rows, self.card)
        self._kernels: dict[tuple, tuple[Any, int, int, dict[str, int]]] = {}
        # GemvLaunch.dynamic: the next task to take and the blocks ended (zeros between launches; made once,
        # so graphs captured before a rebuild keep a live buffer)
        self.dynamic_counters = torch.zeros(2, dtype=torch.int32, device=self.device)
        # signals the last call with a Handoff made (0: none; that call ran without one or on Triton)
        self.last_signals = 0

    @property
    def launch(self) -> LaunchPolicy:
        return self.fused.launch

    def relaunch(self, launch: GemvLaunch) -> None:
        """Run later calls with `launch`: the kernels built so far are dropped and built again at the next
        call (graphs captured before keep the ones they launch)."""
        self.launch_config = launch
        self._kernels.clear()

    def _order(self, handoff: Handoff | None) -> tuple[int, int]:
        if handoff is None:
            return 0, 0
        if handoff.counter.dtype != torch.int32 or handoff.counter.device != self.device:
            raise ValueError(f"{self.name}: the hand-off counter must be an int32 tensor on {self.device}")
        try:
            return task_order(self.rows, handoff.last_start, handoff.last_end)
        except ValueError as exc:
            raise ValueError(f"{self.name}: {exc}") from None

    def _launch_for(self, tokens: int) -> GemvLaunch:
        """The launch of a call of `tokens` tokens: the window's for verification where it has one."""
        cfg = self.launch_config
        return cfg.window if tokens > 1 and cfg.window is not None else cfg

    def k_slices(self, tokens: int = 1) -> int:
        """The K slices (a block's warps) of a call of `tokens` tokens: each is summed over its 64-column steps in
        order, then the slices in order (a kernel that must give the same bits sums the same way: CudaKdaFront)."""
        return warps_for(self.k, self._launch_for(tokens).warps or choose_launch(self.rows).warps)

    def _kernel(
        self,
        tokens: int,
        norm: int,
        epi: int,
        add: bool,
        write_xn: bool,
        out_f32: bool,
        group: int,
        order: tuple[int, int] = (0, 0),
        late_wait: bool = False,
    ):
        key = (tokens, norm, epi, add, write_xn, out_f32, group, order, late_wait)
        if key not in self._kernels:
            f, cfg = self.fused, self._launch_for(tokens)
            warps = self.k_slices(tokens)
            defines = {
                "NTOK": tokens,
                "K": self.k,
                "ROWS": self.rows,
                "NORM": norm,
                "GROUP": group,
                "SCALE": f.scale_mode,
                "EPI": epi,
                "ADD": int(add),
                "HAS_LIMIT": int(f.limit is not None),
                "OUT_F32": int(out_f32),
                "WRITE_XN": int(write_xn),
                "WARPS": warps,
                "PF": in_flight(self.k // 64 // warps, cfg.max_in_flight),
                "ROTATE": order[0],
                "SIGNAL": order[1],
                "LATE_WAIT": int(late_wait),
            }
            # gemv_decode.cu's struct Shared: xh [NTOK][K/2] u32, part [2][WARPS][2][8][NTOK], red [NTOK][WARPS] fp32
            # (DYNAMIC: and ids [3] int)
            shared = -(-(tokens * (2 * self.k + 128 * warps + 4 * warps) + 12 * cfg.dynamic) // 16) * 16
            slots, tasks = 0, -(-self.rows // 8)
            if cfg.bulk:
                kb = -(-self.k // 128)
                scales = f.scale_mode == 1 and kb % 4 == 0 and self.rows % 8 == 0 and f.scale.data_ptr() % 16 == 0
                slots, ring_shared = bulk_ring(
                    tokens, self.k, warps, epi == EPI_SWIGLU, cfg, tasks, self.sms, scales=scales
                )
                if slots:
                    defines.update(BULK=1, SLOTS=slots, SCALE_IN_SLOT=int(scales))
                    shared = ring_shared
            if cfg.min_blocks:
                defines["MIN_BLOCKS"] = cfg.min_blocks
            extras = {}  # the register path's lab switches (the plain kernel is the build without them)
            if cfg.dynamic:
                if slots or order != (0, 0) or late_wait:
                    raise ValueError(
                        f"{self.name}: GemvLaunch.dynamic runs on the register path in the plain order; it does not "
                        "combine with a bulk ring, a hand-off or a late wait"
                    )
                extras["DYNAMIC"] = 1
            if cfg.l2_ahead:
                if slots or cfg.dynamic:
                    raise ValueError(
                        f"{self.name}: GemvLaunch.l2_ahead runs on the register path with the fixed tasks; it does "
                        "not combine with a bulk ring or dynamic tasks"
                    )
                extras.update(L2_AHEAD=cfg.l2_ahead, L2_LOOP=int(cfg.l2_loop))
            if cfg.l2_fetch:
                if cfg.l2_fetch not in (128, 256):
                    raise ValueError(f"{self.name}: GemvLaunch.l2_fetch is 0, 128 or 256 bytes, not {cfg.l2_fetch}")
                extras["L2_FETCH"] = cfg.l2_fetch
            plain = dict(defines)
            defines.update(extras)
            threads = 32 * warps
            carveout = -1 if cfg.carveout < 0 else 100 if slots else cfg.carveout  # (-1: the driver's)
            kernel = self._compile(defines, shared, carveout)
            fits = kernel.max_blocks_per_sm(threads, shared)
            most = cfg.bulk if slots else cfg.blocks_per_sm  # blocks per SM at most
            if not slots and (order != (0, 0) or late_wait or extras):
                # the hand-off's, the late wait's, the dynamic tasks' and the L2 hints' extra registers must not
                # cost a block per SM (on the H100 the hand-off compiled to 5 blocks an SM against the product's
                # 6): then capped there
                if extras:
                    base = self._compile(plain, shared, carveout)
                else:
                    base = self._kernel(tokens, norm, epi, add, write_xn, out_f32, group)[0]
                want = min(cfg.blocks_per_sm, base.max_blocks_per_sm(threads, shared))
                most = want  # the plain kernel's: the same grid
                if fits < want:
                    defines["MIN_BLOCKS"] = want
                    kernel = self._compile(defines, shared, carveout)
                    fits = kernel.max_blocks_per_sm(threads, shared)
            per_sm = min(most, fits)
            if per_sm < 1:
                raise RuntimeError(f"{self.name}: the CUDA GEMV does not fit on an SM with {cfg}")
            grid = persistent_grid(tasks, per_sm * self.sms, cfg.balanced)
            if cfg.max_grid > 0:
                grid = min(grid, cfg.max_grid)
            self._kernels[key] = (kernel, grid, threads, defines)
        return self._kernels[key]

    def _compile(self, defines: dict, shared: int, carveout: int):
        from solo.kernels.cuda_runtime import CudaKernel

        kernel = CudaKernel(GEMV_SOURCE, "gemv_decode", defines, self.device)
        kernel.set_shared_bytes(shared)
        if carveout >= 0:  # (a bulk ring asks for 100: it is sized for its share of the SM's shared memory)
            kernel.set_carveout(carveout)
        return kernel

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
        handoff: Handoff | None = None,
        late_wait: bool = False,
    ) -> torch.Tensor:
        """As FusedGemv.__call__; up to `max_tokens` tokens run here, more on the Triton kernel (which
        hands nothing over: `last_signals` is then 0, and a consumer must wait for the kernel's end).
        `late_wait`: x (and the gate) were written two or more kernels back, so the blocks compute at
        once and wait for the previous kernel only at their end (gemv_decode.cu LATE_WAIT)."""
        tokens = x.shape[0]
        self.last_signals = 0
        if not 1 <= tokens <= self.max_tokens:
            return self.fused(
                x,
                out,
                norm_weight=norm_weight,
                gate=gate,
                eps=eps,
                residual=residual,
                addend=addend,
                xn_out=xn_out,
                out_dtype=out_dtype,
            )
        if not _row_major(x, tokens, self.k):
            raise ValueError(f"{self.name}: x must be row-major bf16 [{tokens}, {self.k}], got {tuple(x.shape)}")
        if out is None:
            out = torch.empty((tokens, self.rows), dtype=out_dtype, device=x.device)
        norm, group = NORM_NONE, 0
        if norm_weight is not None:
            norm = NORM_GATED if gate is not None else NORM_RMS
            if norm == NORM_GATED:
                group = norm_weight.numel()
                if self.k % group or group & (group - 1) or not 16 <= group <= 256:
                    raise ValueError(f"{self.name}: the gated norm's group ({group}) must be 16..256, a power of two")
        for name, t in (("x", x), ("norm weight", norm_weight), ("gate", gate)):
            if t is not None and (t.data_ptr() % 16 or t.ndim == 2 and t.stride(0) % 8):
                raise ValueError(f"{self.name}: the CUDA GEMV reads the {name} in 16-byte pieces; it is not aligned")
        if gate is not None and not _row_major(gate, tokens, self.k):
            raise ValueError(f"{self.name}: the gate must be row-major bf16 [{tokens}, {self.k}]")
        for name, t in (("out", out), ("residual", residual), ("addend", addend)):
            if t is not None and (t.ndim != 2 or tuple(t.shape) != (tokens, self.rows) or t.stride(1) != 1):
                raise ValueError(f"{self.name}: {name} must be row-major [{tokens}, {self.rows}], got {tuple(t.shape)}")
        if xn_out is not None and not _row_major(xn_out, tokens, self.k):
            raise ValueError(f"{self.name}: xn_out must be row-major bf16 [{tokens}, {self.k}]")
        epi = EPI_SWIGLU if self.fused.half is not None else EPI_RESIDUAL if residual is not None else EPI_STORE
        out_f32 = out.dtype == torch.float32
        if out_f32 and epi != EPI_STORE or out.dtype not in (torch.bfloat16, torch.float32):
            raise ValueError(f"{self.name}: the CUDA GEMV writes bf16 (fp32 only for plain outputs), not {out.dtype}")
        order = self._order(handoff)
        kernel, grid, threads, _ = self._kernel(
            tokens, norm, epi, addend is not None, xn_out is not None, out_f32, group, order, late_wait
        )
        launch = self.launch.at(tokens)
        kernel.launch(
            grid,
            threads,
            [
                x,
                norm_weight,
                gate,
                self.fused.weight,
                self.fused.scale,
                out,
                residual,
                addend,
                xn_out,
                self.counter,
                float(eps),
                float(self.fused.limit) if self.fused.limit is not None else 0.0,
                x.stride(0),
                gate.stride(0) if gate is not None else 0,
                out.stride(0),
                residual.stride(0) if residual is not None else 0,
                addend.stride(0) if addend is not None else 0,
                xn_out.stride(0) if xn_out is not None else 0,
                handoff.counter if handoff is not None else None,
                self.dynamic_counters,
            ],
            dependent=launch.pdl,
        )
        launch.record(self.family, kernel)
        if handoff is not None:  # every block whose first task is among the first SIGNAL signals once
            self.last_signals = min(grid, order[1])
        return out


class CudaRouter:
    """The calls of `fused` (a FusedRouter) of up to `max_tokens` tokens on router_decode.cu."""

    MIN_WARPS = 4  # per block; at least E / 32 (one expert per lane selects), so 16 at 512 experts
    family = "cuda_router"
    # the selection over the kept groups' warps only (router_select.cuh FAST_SELECT; the same choices; on
    # since the twelfth session, as in the MoE kernel): False, set before the first call, ranks every warp
    fast_select = True
    # with fast_select: the groups ranked once, lane g group g (router_select.cuh LEAN_SELECT; the same choices; the
    # MoE kernel's DecodeKernelConfig.lean_select); False, set before the first call, ranks each lane's group too
    lean_select = True

    def __init__(self, fused: FusedRouter, counter: torch.Tensor, max_tokens: int = MAX_TOKENS) -> None:
        if not 1 <= max_tokens <= MAX_TOKENS:
            raise ValueError(f"the CUDA router takes 1..{MAX_TOKENS} tokens per call, not {max_tokens}")
        e, h = fused.num_experts, fused.hidden
        if h % 256 or not 32 <= e <= 1024 or e & (e - 1) or fused.n_group > 32 or e % fused.n_group:
            raise ValueError(
                f"the CUDA router needs H % 256 == 0, a power-of-two E in 32..1024 and at most 32 groups; got "
                f"H={h}, E={e}, {fused.n_group} groups"
            )
        if fused.top_k > 32 or fused.topk_group * (e // fused.n_group) < fused.top_k:
            raise ValueError("the CUDA router selects at most 32 experts, from the kept groups")
        self.fused = fused
        self.counter = counter
        self.max_tokens = max_tokens
        self.device = fused.weight.device
        self.warps = max(self.MIN_WARPS, e // 32)
        self._kernels: dict[int, Any] = {}
        self._scratch: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    @property
    def launch(self) -> LaunchPolicy:
        return self.fused.launch

    def kernel(self, tokens: int = 1):
        """The kernel for calls of `tokens` tokens (compiled or loaded from the cache on first use)."""
        if tokens not in self._kernels:
            from solo.kernels.cuda_runtime import CudaKernel

            f = self.fused
            defines = {
                "NTOK": tokens,
                "H": f.hidden,
                "E": f.num_experts,
                "GROUPS": f.n_group,
                "KEEP": f.topk_group,
                "TOPK": f.top_k,
                "RENORM": int(f.renormalize),
                "WARPS": self.warps,
                "EPW": 1,
                "FAST_SELECT": int(self.fast_select),
                "LEAN_SELECT": int(self.lean_select),
            }
            self._kernels[tokens] = CudaKernel(ROUTER_SOURCE, "router_decode", defines, self.device)
        return self._kernels[tokens]

    def scratch(self, tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(scores, arrival counters) for calls of `tokens` tokens: made once and kept, also when the
        kernel is built again (a variant), since the graphs captured before still read and count in them."""
        if tokens not in self._scratch:
            self._scratch[tokens] = (
                torch.empty((tokens, self.fused.num_experts), dtype=torch.float32, device=self.device),
                torch.zeros(2, dtype=torch.int32, device=self.device),  # arrivals, selectors done
            )
        return self._scratch[tokens]

    def __call__(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """As FusedRouter.__call__; up to `max_tokens` tokens run here, more on the Triton kernels."""
        tokens = x.shape[0]
        if not 1 <= tokens <= self.max_tokens:
            return self.fused(x)
        f = self.fused
        if not _row_major(x, tokens, f.hidden):
            raise ValueError(f"the CUDA router takes row-major bf16 [{tokens}, {f.hidden}], got {tuple(x.shape)}")
        if x.data_ptr() % 16 or x.stride(0) % 8:
            raise ValueError("the CUDA router reads x in 16-byte pieces; it is not aligned")
        kernel = self.kernel(tokens)
        scores, arrived = self.scratch(tokens)
        xn = torch.empty((tokens, f.hidden), dtype=torch.bfloat16, device=x.device)
        ids = torch.empty((tokens, f.top_k), dtype=torch.int32, device=x.device)
        wts = torch.empty((tokens, f.top_k), dtype=torch.float32, device=x.device)
        launch = self.launch.at(tokens)
        kernel.launch(
            f.num_experts // self.warps,  # blocks b < tokens select token b (E / warps >= 8 >= tokens)
            32 * self.warps,
            [
                x,
                f.norm_weight,
                f.weight,
                f.bias,
                xn,
                scores,
                arrived,
                ids,
                wts,
                self.counter,
                f.eps,
                f.scaling,
                x.stride(0),
            ],
            dependent=launch.pdl,
        )
        launch.record(self.family, kernel)
        return xn, ids, wts

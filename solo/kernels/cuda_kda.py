"""One token's KDA layer front as one CUDA launch (solo/kernels/cuda/kda_front.cu; Hopper, NVRTC). The H100's product.

The decode step's KDA layer runs its input projection (norm + q|k|v|f|g|b, a GEMV over every SM) and then the
recurrence (fused_kda.kda_decode) with a grid-wide boundary between them. `CudaKdaFront` runs both in one launch of
4 blocks a head: each block projects the rows its slice of the recurrence needs, the head's blocks exchange q, k
and the decay (through a thread-block cluster's distributed shared memory, or through global memory and counters),
and each block updates its slice of the head's state. It returns the projection (its g rows feed the output
projection's gated norm, its own kernel unless `o_proj` puts it inside too) and writes o, the conv windows and the
state as the two kernels did, to fp32 summation order. One token, no verification history (the window's calls keep the
two kernels).

Measured on the H100 (docs/performance.md section 0): the register builds do not pay (thirty-second session: +24 us a
decode step at 32K at best; the clusters of 4 fit 30 at a time at one block an SM, and at two blocks an SM the 41 KB of
loads in flight an SM stream slower than the GEMV's 61 KB). The weights through a ring of 3 task slots of shared memory
with the g rows last do (thirty-third session: -41 us in the A/B, -50 in the bench): the product's build there
(solo.fastpath.decode_step.KDA_FRONT_BUILD).
"""

from __future__ import annotations

from pathlib import Path

import torch

from solo.kernels.fused_kda import check_lazy
from solo.kernels.pdl import LaunchPolicy

KDA_FRONT_SOURCE = Path(__file__).parent / "cuda" / "kda_front.cu"
SPLIT = 4  # blocks (a cluster) a head: each takes a quarter of the value columns
WARPS = 10  # a block's warps (they split K)
MAX_RING = 4  # task slots of shared memory a block's ring may hold (4 x 41 KB beside its 27 KB of other state)


def kda_front_unavailable(weight: torch.Tensor, scales: torch.Tensor | None, scale_mode: int, attn) -> str | None:
    """Why the fused KDA front cannot run one token of `attn` whose q|k|v|f|g|b projection is `weight`
    (None: it can)."""
    from solo.kernels.cuda_step import cuda_step_unavailable

    if (reason := cuda_step_unavailable(weight.device)) is not None:
        return reason
    heads, dk = attn.num_heads, attn.head_dim
    hidden = weight.shape[1]
    if weight.dtype != torch.float8_e4m3fn or scale_mode != 1 or scales is None:
        return "it runs FP8 projections with 128x128 block scales (load with --block-fp8 on)"
    if dk % SPLIT or dk // SPLIT != 32:
        return f"it splits a head of {SPLIT * 32} channels over {SPLIT} blocks, not {dk}"
    if weight.shape[0] != 5 * heads * dk + heads:
        return f"the projection has {weight.shape[0]} rows, not 5 x {heads} x {dk} + {heads} (q|k|v|f|g|b)"
    if hidden % 128 or (hidden // 64) % WARPS:
        return f"the hidden size {hidden} must be a multiple of 128 and its 64-column steps of {WARPS}"
    if attn.kernel_size != 4:
        return "its short convolutions have kernel size 4"
    if weight.data_ptr() % 16 or scales.dtype != torch.float32 or not scales.is_contiguous():
        return "the weight must be 16-byte aligned and its block scales contiguous fp32"
    if tuple(scales.shape) != (-(-weight.shape[0] // 128), hidden // 128):
        return f"its block scales are {tuple(scales.shape)}, not one per 128 x 128 block of the weight"
    return None


def fp32_gate_params(attn) -> tuple[torch.Tensor, torch.Tensor]:
    """A KDA layer's A_log and dt_bias as contiguous fp32 copies (what the front reads)."""
    return attn.A_log.detach().float().contiguous(), attn.dt_bias.detach().float().contiguous()


class CudaKdaFront:
    """norm + q|k|v|f|g|b + conv + gates + recurrence of one token of a KDA layer, one launch."""

    family = "cuda_kda_front"  # its launch counter's kernel family (solo.fastpath.decode_step.FAMILIES)

    def __init__(
        self,
        weight: torch.Tensor,
        scales: torch.Tensor,
        attn,
        counter: torch.Tensor,
        tasks_ahead: int = 2,
        min_blocks: int = 1,
        warps: int = WARPS,
        l2_ahead: int = 0,
        exchange: str = "global",
        exchange_buffers: tuple[torch.Tensor, torch.Tensor] | None = None,
        gate_params: tuple[torch.Tensor, torch.Tensor] | None = None,
        ring: int = 0,
        scale_mode: int = 1,
        o_proj=None,
        g_last: bool = False,
        carveout: int = -1,
        l2_next: tuple[torch.Tensor, int] | None = None,
    ) -> None:
        if (reason := kda_front_unavailable(weight, scales, scale_mode, attn)) is not None:
            raise ValueError(f"the fused KDA front cannot run: {reason}")
        if tasks_ahead not in (1, 2):
            raise ValueError(f"the fused KDA front keeps 1 or 2 tasks' loads in flight, not {tasks_ahead}")
        self.weight, self.scales, self.attn, self.counter = weight, scales, attn, counter
        self.heads, self.dk, self.k = attn.num_heads, attn.head_dim, weight.shape[1]
        self.tasks_ahead = tasks_ahead
        # blocks an SM the build is for (__launch_bounds__: 2 caps the registers at 96, so that a cluster finds room
        # on SMs that still run the previous kernel's blocks)
        self.min_blocks = min_blocks
        if exchange not in ("cluster", "global"):
            raise ValueError(f"the fused KDA front exchanges through a 'cluster' or 'global' memory, not {exchange!r}")
        # how a head's blocks exchange q, k and the decay: a cluster's distributed shared memory, or global memory and
        # counters (no cluster: the grid must then be one wave, checked at the first build)
        self.exchange = exchange
        # (scratch [H * 3 * d] fp32, flags [2 H] int32 zeros): the global exchange's. A step's layers run one after
        # another and leave the flags zero, so they share one pair, made once by the step: a graph captured before
        # the fronts are built again then keeps live buffers (an A/B whose first variant's fronts were dropped, their
        # own counters freed and reused, hung in its graph's replays)
        if exchange_buffers is None:
            exchange_buffers = (
                torch.zeros(self.heads * 3 * self.dk, dtype=torch.float32, device=weight.device),
                torch.zeros(2 * self.heads, dtype=torch.int32, device=weight.device),
            )
        self.scratch, self.flags = exchange_buffers
        if self.scratch.numel() < self.heads * 3 * self.dk or self.flags.numel() < 2 * self.heads:
            raise ValueError(f"the fused KDA front's exchange buffers are too small for {self.heads} heads")
        # > 0: the weights stream through this many task slots of shared memory (41 KB each, at most 4) filled by bulk
        # copies (kda_front.cu RING), not through the registers' loads: more bytes in flight an SM, no registers held
        if not 0 <= ring <= MAX_RING:
            raise ValueError(f"the fused KDA front's ring holds 0..{MAX_RING} task slots, not {ring}")
        self.ring = ring
        # the g rows (only the output projection reads them) streamed last, after the exchange and the recurrence, so
        # that HBM serves their bytes while the block waits for its head's other blocks (kda_front.cu GLAST; a ring's)
        if g_last and not ring:
            raise ValueError("the fused KDA front streams its g rows last with a ring of task slots (ring > 0)")
        self.g_last = g_last
        # the share (%) of the SM's shared memory the kernel prefers (-1: the driver's choice): blocks of kernels whose
        # shared-memory configurations differ cannot share an SM, so a successor meant to become resident beside the
        # front's blocks under PDL must prefer the same
        self.carveout = carveout
        # (weight, when): each block asks the L2 for its share of this weight (the next kernel's, which cannot become
        # resident beside the front's blocks to load it early), when 1: after the b task, 2: before the wait
        if l2_next is not None and (l2_next[1] not in (1, 2) or l2_next[0].data_ptr() % 16):
            raise ValueError(
                "the fused KDA front asks the L2 at 1 (after the b task) or 2 (before the wait), 16-byte aligned"
            )
        self.l2_next = l2_next
        self.l2_ahead = l2_ahead  # tasks (40 KB each) a block asks the L2 for beyond its registers' loads
        self.warps = warps  # (they split K: its 64-column steps must be a multiple of them, at least 8)
        if warps < 8 or (self.k // 64) % warps:
            raise ValueError(f"the fused KDA front splits K's {self.k // 64} steps over 8 or more warps, not {warps}")
        # (A_log, dt_bias) in fp32, made once (the per-call .float() of the Triton path would be a kernel a step); a
        # step passes its layer's own pair, which outlives the fronts: a graph captured before they are built again
        # must not read freed copies
        if gate_params is None:
            gate_params = fp32_gate_params(attn)
        self.a_log, self.dt_bias = gate_params
        self.device = weight.device
        # the layer's output projection (a CudaGemv of one token: its FP8 weight, block scales and K slices) inside the
        # launch (kda_front.cu OPROJ): the call then adds the layer's contribution to x itself
        self.o_proj = o_proj
        if o_proj is not None and (reason := self._o_proj_unavailable(o_proj)) is not None:
            raise ValueError(f"the fused KDA front cannot run the output projection: {reason}")
        self._kernels: dict[tuple[bool, bool], object] = {}

    def _o_proj_unavailable(self, o_proj) -> str | None:
        fused, d, blocks = o_proj.fused, self.heads * self.dk, self.heads * SPLIT
        rows, slot = fused.weight.shape[0], 16 * (self.k + 64)
        if self.exchange != "global" or self.ring < 1:
            return "it runs with the global exchange and a ring (its weights stream into the ring's slots)"
        if fused.weight.dtype != torch.float8_e4m3fn or fused.scale_mode != 1 or fused.weight.shape[1] != d:
            return f"it runs FP8 weights of {d} columns with 128x128 block scales"
        if rows != self.k or rows % blocks or rows // blocks > 32:
            return f"its {rows} rows must be the hidden size {self.k}, a multiple of {blocks} blocks, <= 32 a block"
        per_slot = slot // (d + 64)
        if per_slot < 1 or -(-(rows // blocks) // per_slot) > self.ring:
            return f"a block's {rows // blocks} rows of {d} bytes do not fit in {self.ring} ring slots"
        if tuple(fused.scale.shape) != (-(-rows // 128), d // 128) or fused.scale.dtype != torch.float32:
            return f"its block scales are {tuple(fused.scale.shape)}, not fp32, one per 128 x 128 block"
        if (d // 64) % o_proj.k_slices(1) or fused.weight.data_ptr() % 16:
            return "its K slices must divide its 64-column steps and its weight be 16-byte aligned"
        if self.flags.numel() < 2 * self.heads + 2:
            return "the exchange's counters need 2 more (the grid-wide count)"
        return None

    def _kernel(self, lazy: bool, safe_gate: bool):
        key = (lazy, safe_gate)
        if key not in self._kernels:
            from solo.kernels.cuda_runtime import CudaKernel

            defines = {
                "K": self.k,
                "H": self.heads,
                "DK": self.dk,
                "SPLIT": SPLIT,
                "WARPS": self.warps,
                "TA": self.tasks_ahead,
                "SAFE_GATE": int(safe_gate),
                "LAZY": int(lazy),
                "MIN_BLOCKS": self.min_blocks,
                "L2A": self.l2_ahead,
                "XCHG": int(self.exchange == "global"),
                "RING": self.ring,
                "GLAST": int(self.g_last),
                "L2O": self.l2_next[1] if self.l2_next is not None else 0,
            }
            if self.o_proj is not None:
                defines.update(OPROJ=1, HID=self.o_proj.fused.weight.shape[0], OSL=self.o_proj.k_slices(1))
            kernel = CudaKernel(KDA_FRONT_SOURCE, "kda_front", defines, self.device)
            shared = self.ring * 16 * (self.k + 64)  # (the ring's slots: dynamic shared memory)
            if shared:
                kernel.set_shared_bytes(shared)
            if self.carveout >= 0:
                kernel.set_carveout(self.carveout)
            if kernel.max_blocks_per_sm(32 * self.warps, shared) < 1:
                raise ValueError(f"the fused KDA front with a ring of {self.ring} slots does not fit on an SM")
            if self.exchange == "global":  # (a block waiting for one that cannot become resident would wait forever)
                sms = torch.cuda.get_device_properties(self.device).multi_processor_count
                fits = kernel.max_blocks_per_sm(32 * self.warps, shared) * sms
                if fits < self.heads * SPLIT:
                    raise ValueError(
                        f"the fused KDA front's global exchange needs its {self.heads * SPLIT} blocks resident at "
                        f"once; {fits} fit on this GPU. Use its cluster exchange"
                    )
            self._kernels[key] = kernel
        return self._kernels[key]

    def kernel(self, lazy: bool = False):
        """The loaded kernel of a call without (or with) a lazy state (for its registers and occupancy)."""
        return self._kernel(lazy, bool(self.attn.safe_gate))

    def __call__(
        self,
        x: torch.Tensor,
        norm_weight: torch.Tensor,
        eps: float,
        conv_state: torch.Tensor,
        state: torch.Tensor,
        out: torch.Tensor,
        launch: LaunchPolicy,
        lazy: tuple[torch.Tensor, torch.Tensor] | None = None,
        o_norm: tuple[torch.Tensor, float] | None = None,
    ) -> torch.Tensor:
        """x [1, hidden] bf16 (the layer's input); conv_state [3D, 3] and state [H, d, d] fp32 updated in
        place (with `lazy` = (source, slots) as fused_kda.kda_decode's); out [1, D] bf16 receives o.
        Returns the projection [1, 5D + H] bf16. With the output projection inside (`o_proj`), `o_norm` is the
        output norm's (weight, eps) and x becomes x + o_proj(o_norm(o, g)), as the layer's dense call makes it."""
        d = self.heads * self.dk
        if x.shape != (1, self.k) or x.dtype != torch.bfloat16 or not x.is_contiguous():
            raise ValueError(f"the fused KDA front takes one token: x must be contiguous bf16 [1, {self.k}]")
        if out.shape != (1, d) or out.dtype != torch.bfloat16 or not out.is_contiguous():
            raise ValueError(f"the fused KDA front's out must be contiguous bf16 [1, {d}]")
        if state.shape != (self.heads, self.dk, self.dk) or not state.is_contiguous():
            raise ValueError(f"the KDA state must be contiguous [{self.heads}, {self.dk}, {self.dk}]")
        if conv_state.shape != (3 * d, 3) or not conv_state.is_contiguous():
            raise ValueError(f"the KDA conv windows must be contiguous [{3 * d}, 3]")
        if (self.o_proj is not None) != (o_norm is not None):
            raise ValueError("the fused KDA front takes the output norm exactly when it runs the output projection")
        if o_norm is not None and (o_norm[0].dtype != torch.bfloat16 or tuple(o_norm[0].shape) != (self.dk,)):
            raise ValueError(f"the KDA output norm's weight must be bf16 [{self.dk}]")
        source, slots = check_lazy(lazy, state) if lazy is not None else (self.counter, state)
        proj = torch.empty((1, 5 * d + self.heads), dtype=torch.bfloat16, device=x.device)
        kernel = self._kernel(lazy is not None, bool(self.attn.safe_gate))
        launch = launch.at(1)
        kernel.launch(
            self.heads * SPLIT,
            32 * self.warps,
            [
                x,
                norm_weight,
                self.weight,
                self.scales,
                proj,
                self.attn.conv_weight,
                conv_state,
                state,
                slots,
                source,
                self.a_log,
                self.dt_bias,
                out,
                self.counter,
                self.scratch,
                self.flags,
                float(eps),
                float(self.attn.lower_bound),
                *(
                    (self.o_proj.fused.weight, self.o_proj.fused.scale, o_norm[0], float(o_norm[1]))
                    if o_norm is not None
                    else (None, None, None, 0.0)
                ),
                *(
                    (self.l2_next[0], self.l2_next[0].numel() * self.l2_next[0].element_size() // 16 * 16)
                    if self.l2_next is not None
                    else (None, 0)
                ),
            ],
            dependent=launch.pdl,
        )
        launch.record(self.family, kernel)
        return proj

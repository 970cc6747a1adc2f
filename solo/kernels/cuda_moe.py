"""``--moe-backend cuda``: the Triton backend, with one-token calls (plain decode) in one persistent
CUDA kernel (solo/kernels/cuda/moe_decode.cu) that does gate_up, SwiGLU, down and the combine.

Measured on the H200 (docs/kernels.md): 12.0-12.1 us per layer against 16.2-17.2 for the Triton GEMV kernels
and 40.2-40.7 for Humming, in the same runs. The kernel runs one block per SM and its blocks
exchange the SwiGLU activations through global memory, so every block must be resident at once:
the launch is cooperative, which the driver refuses (an error, never a hang) where that cannot be
had, e.g. on a GPU shared through MPS. Calls of more than one token (NEXTN verification, prompts)
run the Triton kernels on the same packed weights, so the backend keeps no second copy. Needs a
Hopper GPU (TMA bulk copies), NVRTC (a CUDA build of PyTorch brings it), H and I multiples of 256,
an even top-k <= 8 and E8M0 scales <= 128 (the fp16 products; checked at load).

`routed_forward` runs one token's router in the same launch (the fused decode step's MoE layers, so
no router launch and no kernel boundary before the experts; `RouterSpec` says which routers it takes):
the kernel normalises the residual stream, each block scores its share of the experts, the blocks
exchange the scores through global memory and every block selects the top-k itself (moe_decode.cu,
ROUTER). Measured on the H200 (dev/moe_router_ab.py): 18.4 us for router and experts against 20.5 us
for the router's own kernel then this one; the decode step 2.49 -> 2.42 ms (docs/performance.md).

Schedule: a gate_up tile is 8 gate + 8 up rows of one expert slot, a down tile 8 output rows of all
slots. Each block gets a contiguous run of down tiles, then each gate_up tile (slot by slot) goes to
the block with the fewest bytes so far; each block copies its gate_up tiles first, then its down rows slot
pair by slot pair (other orders: decode_schedule).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from solo.kernels.cuda_moe_plan import (
    DecodeKernelConfig,
    DecodeSchedule,
    decode_schedule,
    shared_tail,
    tile_bytes,
    with_shared_column,
)
from solo.kernels.moe import CompileEvidence, MXFP4Experts
from solo.kernels.triton_moe import MoEConfig, TritonMoE

SOURCE = Path(__file__).parent / "cuda" / "moe_decode.cu"
_BUILT: list[dict[str, Any]] = []  # compile records of this process (for the start-up check)


def persistent_compile_report() -> dict[str, Any]:
    """What this process built or loaded from the cache: kernels, seconds, whether all were cached."""
    return {
        "kernels": len(_BUILT),
        "compile_seconds": round(sum(r["seconds"] for r in _BUILT), 3),
        "all_cached": all(r["cached"] for r in _BUILT),
        "cache_dir": str(Path(_BUILT[0]["path"]).parent) if _BUILT else "",
    }


SHARED_MEMORY_SLACK = 128
SCORE_COPIES = 8  # copies of the router scores the blocks exchange (moe_decode.cu ROUTER)
TRACE_SLOTS = 80  # stamps a block of the traced kernel writes (moe_decode.cu TRACE_SLOTS)
SH_COPIES = 8  # copies of the shared expert's activations the blocks exchange (moe_decode.cu SHARED)
MAX_ACT_COPIES = 16


def warp_selects(router: RouterSpec, warp_select: bool) -> bool:
    """Whether the producer warp chooses the experts (moe_decode.cu WARP_SEL): asked for, and groups are whole
    32-expert columns or there is no group limit."""
    return warp_select and (router.keep == router.groups or router.experts // router.groups % 32 == 0)


def _router_scratch_bytes(hidden: int, router: RouterSpec | None, warp_select: bool = False) -> int:
    """moe_decode.cu's Smem::rt (ROUTER): norm and score partials, group tops, the warps' sorted lists (or, with
    WARP_SEL, every expert's key and score)."""
    if router is None:
        return 0
    gu_warps = hidden // 128
    per_block = -(-router.experts // router.blocks)
    pieces = -(-per_block * (hidden // 256) // gu_warps)
    group_size = router.experts // router.groups
    # every expert's key and score (WARP_SEL), or the warps' best (key, index, score); then the block's top-k
    lists = (8 * router.experts if warp_selects(router, warp_select) else 12 * 8 * router.experts // 32) + 8 * 8
    return 4 * (gu_warps + gu_warps * pieces + 2 * router.groups * -(-group_size // 32)) + lists


def _shared_bytes(
    sched: DecodeSchedule,
    hidden: int,
    inter: int,
    top_k: int,
    router: RouterSpec | None = None,
    l2_regions: int = 0,
    x_in_tiles: bool = False,
    warp_select: bool = False,
) -> int:
    """Dynamic shared memory of one block: the Smem struct of moe_decode.cu (rounded up), then the tiles
    (x_in_tiles: x lives in the tiles' down area, DecodeKernelConfig.x_in_tiles)."""
    gu_warps, dn_warps = hidden // 128, inter // 128
    bars = sched.max_gate_up + top_k // 2 + 2  # (+ SH_BAR, SH_FREE: counted always, 16 bytes)
    gate_up_or_router = max(sched.max_gate_up * gu_warps * 16 * 4, _router_scratch_bytes(hidden, router, warp_select))
    partials = gate_up_or_router + sched.max_down * dn_warps * 8 * 4
    staged_act = top_k * inter * 2
    # bars, experts, launch number (+ padding), x, activations, the selected weights, partials
    x = 0 if x_in_tiles else 2 * hidden
    header = bars * 8 + 8 * 8 + 16 + x + staged_act + 8 * 4 + partials + 16 * l2_regions  # (L2_NEXT's table)
    return (header + 127) // 128 * 128 + sched.most_bytes + SHARED_MEMORY_SLACK


@dataclass(frozen=True)
class RouterSpec:
    """The router a one-token launch also runs (moe_decode.cu ROUTER): the fused decode step's, so its
    MoE layers need no router launch. Semantics of solo.kernels.fused_router (grouped top-k)."""

    experts: int
    groups: int  # 1: no group limit
    keep: int  # groups kept
    renormalize: bool
    blocks: int  # the kernel's grid (experts are spread over its blocks)

    def defines(self) -> dict[str, int]:
        return {
            "ROUTER": 1,
            "E": self.experts,
            "GROUPS": self.groups,
            "KEEP": self.keep,
            "RENORM": int(self.renormalize),
            "SCORE_COPIES": SCORE_COPIES,
        }


@dataclass(frozen=True)
class SharedExpert:
    """A layer's shared expert for the one-token launch (moe_decode.cu SHARED): the block-FP8 SwiGLU
    MLP's weights as the fused step's projections hold them (solo.kernels.fused_gemv.FusedGemv)."""

    gate_up: torch.Tensor  # [2 I, H] float8_e4m3fn: gate rows, then up rows
    gate_up_scale: torch.Tensor  # [2 I / 128, H / 128] fp32
    down: torch.Tensor  # [H, I] float8_e4m3fn
    down_scale: torch.Tensor  # [H / 128, I / 128] fp32
    limit: float | None  # SwiGLU clamp

    @property
    def inter(self) -> int:
        return self.down.shape[1]


def shared_unsupported(hidden: int, blocks: int, shared: SharedExpert) -> str | None:
    """Why the persistent kernel cannot also run this shared expert (None: it can; the tile area is
    checked when the kernel is built)."""
    inter = shared.inter
    if shared.gate_up.dtype != torch.float8_e4m3fn or shared.down.dtype != torch.float8_e4m3fn:
        return "the fused shared expert runs block-FP8 weights (load with --block-fp8 on)"
    if shared.gate_up.shape != (2 * inter, hidden) or shared.down.shape != (hidden, inter):
        return f"the shared expert's shapes {tuple(shared.gate_up.shape)}, {tuple(shared.down.shape)} are not SwiGLU's"
    blocks_gu, blocks_dn = (2 * inter // 128, hidden // 128), (hidden // 128, inter // 128)
    if tuple(shared.gate_up_scale.shape) != blocks_gu or tuple(shared.down_scale.shape) != blocks_dn:
        return "the fused shared expert takes 128x128 block scales"
    tensors = (shared.gate_up, shared.down, shared.gate_up_scale, shared.down_scale)
    if any(not t.is_contiguous() or t.data_ptr() % 16 for t in tensors):
        return "the fused shared expert reads contiguous, 16-byte aligned weights and scales"
    if inter % 256 or inter // 8 > blocks:
        return (
            f"the fused shared expert needs its intermediate size a multiple of 256, at most 8 x {blocks}; got {inter}"
        )
    return None


def router_unsupported(hidden: int, top_k: int, spec: RouterSpec) -> str | None:
    """Why the persistent kernel cannot also run this router (None: it can)."""
    e, groups = spec.experts, spec.groups
    if e % 32 or e > 1024 or e // 32 > hidden // 128:
        return f"the fused router takes E a multiple of 32, at most min(1024, H / 4) experts; got E={e}, H={hidden}"
    if groups > 32 or e % groups:
        return f"the fused router takes at most 32 groups that divide E; got {groups} groups of E={e}"
    size = e // groups
    if spec.keep < groups and (size & (size - 1) if size < 32 else size % 32):
        return f"the fused router takes groups of a power of two below 32 experts or a multiple of 32; got {size}"
    if spec.keep < groups and spec.keep * size < top_k:
        return f"the kept groups ({spec.keep} x {size} experts) hold fewer than top-k ({top_k}) experts"
    return None


class PersistentDecodeMoE(TritonMoE):
    """TritonMoE whose one-token calls run the persistent CUDA kernel (see module docstring)."""

    name = "cuda"

    def __init__(
        self,
        experts: MXFP4Experts,
        dtype: torch.dtype = torch.bfloat16,
        swiglu_limit: float | None = None,
        config: MoEConfig | None = None,
        kernel_config: DecodeKernelConfig | None = None,
    ) -> None:
        super().__init__(experts, dtype=dtype, swiglu_limit=swiglu_limit, config=config)
        self.kernel_config = kernel_config or DecodeKernelConfig()
        self.path_calls["persistent"] = 0
        if self.device.type != "cuda":
            raise RuntimeError("the persistent decode kernel needs the experts on an NVIDIA GPU (--device cuda)")
        if torch.cuda.get_device_capability(self.device)[0] < 9:
            raise RuntimeError("the persistent decode kernel needs a Hopper or newer GPU (TMA bulk copies)")
        if self.hidden % 256 or self.inter % 256:
            raise RuntimeError(
                f"the persistent decode kernel needs H and I multiples of 256, got {self.hidden} and {self.inter}"
            )
        if not self.f16_products_exact:
            raise RuntimeError(
                "the persistent decode kernel multiplies in fp16, exact only for E8M0 scales <= 128; this "
                "checkpoint has larger ones. Use --moe-backend triton."
            )
        self._kernels: dict[tuple, tuple[Any, DecodeSchedule, torch.Tensor, int]] = {}
        self._retired: list[tuple[Any, DecodeSchedule, torch.Tensor, int]] = []  # see set_kernel_config
        self.blocks = torch.cuda.get_device_properties(self.device).multi_processor_count
        self._new_exchange()
        self._exchanges: dict[int, tuple] = {}  # set_blocks: the other block counts' exchange buffers
        # L2_NEXT: regions of later kernels' weights the one-token kernel asks the L2 for ([R, 2] int64: address,
        # bytes; prefetch_next), used where the kernel config's l2_next_at is set
        self._l2_next: torch.Tensor | None = None
        self._l2_retired: list[torch.Tensor] = []

    def _new_exchange(self) -> None:
        """The buffers the blocks of one launch exchange through, and the launch counter whose value over the
        block count tags what they write (moe_decode.cu)."""
        # activations exchanged between blocks, tagged with the launch number (0xFFFF: none yet)
        self._act = torch.full((MAX_ACT_COPIES * 8 * self.inter,), -1, dtype=torch.int32, device=self.device)
        self._launches = torch.zeros(1, dtype=torch.int32, device=self.device)
        # ROUTER: the scores exchanged between blocks, tag << 32 | fp32 (tag 0xFFFFFFFF: none yet)
        self._scores = torch.full((SCORE_COPIES * self.num_experts,), -1, dtype=torch.int64, device=self.device)
        self._shared_act: torch.Tensor | None = None  # SHARED: the shared activations exchanged, tagged
        # per-block globaltimer stamps of the last two launches (DecodeKernelConfig.trace; moe_decode.cu T_*)
        self.trace = torch.zeros((2, self.blocks, TRACE_SLOTS), dtype=torch.int64, device=self.device)

    def set_blocks(self, blocks: int | None = None) -> None:
        """Run the one-token kernel on `blocks` blocks, one an SM (None: every SM), leaving the other SMs to the
        kernels after it (a lab switch: a successor under PDL becomes resident there while this kernel runs).
        Each block count keeps its own exchange buffers and launch counter (the launch number is the counter
        over the block count), so graphs captured with another count keep working."""
        sms = torch.cuda.get_device_properties(self.device).multi_processor_count
        blocks = sms if blocks is None else blocks
        if not 1 <= blocks <= sms:
            raise ValueError(f"the persistent decode kernel runs on 1..{sms} blocks (one an SM), not {blocks}")
        if blocks == self.blocks:
            return
        self._exchanges[self.blocks] = (self._act, self._launches, self._scores, self._shared_act, self.trace)
        self.blocks = blocks
        if blocks in self._exchanges:
            self._act, self._launches, self._scores, self._shared_act, self.trace = self._exchanges.pop(blocks)
        else:
            self._new_exchange()

    def family_for(self, tokens: int) -> str:
        return "persistent" if tokens == 1 else super().family_for(tokens)

    def compile_evidence(self) -> CompileEvidence:
        """Triton's binaries for calls of several tokens, plus the NVRTC cubins of the one-token kernel."""
        evidence = super().compile_evidence()
        cubins = sorted({entry[0].compile.path for entry in self._kernels.values()})
        built = [entry[0].compile for entry in self._kernels.values()]
        evidence.tool = f"{evidence.tool}+nvrtc"
        evidence.artifacts = [*cubins, *evidence.artifacts]
        evidence.compiled_now += sum(not c.cached for c in built)
        evidence.seconds += sum(c.seconds for c in built)
        return evidence

    def set_kernel_config(self, kernel_config: DecodeKernelConfig) -> None:
        """Switch kernel variants (for A/B runs); the next call compiles or loads the new one. The built
        kernels are kept aside, not dropped: their schedule tables are read by the graphs captured before
        (freed, their memory went to later buffers and replaying such a graph faulted)."""
        self.kernel_config = kernel_config
        self._retired.extend(self._kernels.values())
        self._kernels = {}

    def prefetch_next(self, regions: list[tuple[torch.Tensor, int, int]]) -> None:
        """Where the kernel config's `l2_next_at` is set, one-token launches also ask the L2 for these regions
        (tensor, first byte, bytes) of weights the step reads after this kernel (moe_decode.cu L2_NEXT); an
        empty list stops it. Bytes are cut to whole 16-byte pieces, as the bulk prefetch needs them."""
        rows = []
        for tensor, first, nbytes in regions:
            if tensor.device != self.device:
                raise ValueError(f"an L2 region must be on {self.device}, not {tensor.device}")
            size = tensor.numel() * tensor.element_size()
            address = tensor.data_ptr() + first
            if not 0 <= first < size or address % 16:
                raise ValueError(f"an L2 region must start 16-byte aligned within its tensor, not at byte {first}")
            nbytes = min(nbytes, size - first) // 16 * 16
            if nbytes > 0:
                rows.append((address, nbytes))
        if len(rows) > 8:
            raise ValueError(f"the MoE kernel asks the L2 for at most 8 regions, not {len(rows)}")
        if self._l2_next is not None:  # graphs captured before still read it: kept, not freed
            self._l2_retired.append(self._l2_next)
        self._l2_next = torch.tensor(rows, dtype=torch.int64, device=self.device) if rows else None

    def _l2_regions(self) -> int:
        """moe_decode.cu's L2_NEXT: the regions the next one-token launch asks the L2 for (0: none)."""
        return 0 if self._l2_next is None or not self.kernel_config.l2_next_at else self._l2_next.shape[0]

    def kernel_for(
        self, top_k: int, id64: bool, router: RouterSpec | None = None, shared: SharedExpert | None = None
    ) -> tuple[Any, DecodeSchedule, torch.Tensor, int]:
        """Compile (or load from <solo cache>/cuda) and set up the kernel for top_k experts (that also
        runs `router`, and the shared expert of that shape, where given)."""
        shared_key = (shared.inter, shared.limit is not None) if shared is not None else None
        key = (top_k, id64, router, shared_key, self._l2_regions(), self.blocks)
        if key in self._kernels:
            return self._kernels[key]
        from solo.kernels.cuda_runtime import CudaKernel

        kc = self.kernel_config
        if not 1 <= kc.act_copies <= MAX_ACT_COPIES:
            raise ValueError(f"act_copies must be in 1..{MAX_ACT_COPIES}, got {kc.act_copies}")
        if top_k % 2 or top_k > 8:
            raise RuntimeError(f"the persistent decode kernel needs an even top-k <= 8, got {top_k}")
        sched = decode_schedule(self.blocks, self.hidden, self.inter, top_k, kc.order, kc.balance, kc.early_pairs)
        if kc.early_pairs:
            if shared is not None:
                raise RuntimeError(
                    "DecodeKernelConfig.early_pairs cannot run with the shared expert inside the kernel (its down "
                    "warps run the shared expert): set early_pairs to 0"
                )
            if sched.max_down * (self.inter // 128) * 128 > kc.early_pairs * 4 * self.inter:
                raise RuntimeError(  # (moe_decode.cu EARLY_PAIRS: the sums handed over in the pairs' activations)
                    "the early pairs' down sums do not fit in their activation memory at these shapes: set "
                    "DecodeKernelConfig.early_pairs to 0"
                )
        if kc.x_in_tiles:
            if shared is not None:
                raise RuntimeError(
                    "DecodeKernelConfig.x_in_tiles cannot run with the shared expert inside the kernel (it reads x "
                    "to its end): turn x_in_tiles off"
                )
            gu_bytes, _ = tile_bytes(self.hidden, self.inter, top_k)
            if sched.max_gate_up * gu_bytes + 2 * self.hidden > sched.most_bytes:  # (x after the most gate_up tiles)
                raise RuntimeError(
                    "x does not fit in a block's down area of the tile memory at these shapes: turn "
                    "DecodeKernelConfig.x_in_tiles off"
                )
        defines = {
            "H": self.hidden,
            "I": self.inter,
            "TOPK": top_k,
            "NBLOCKS": self.blocks,
            "MAX_GU": sched.max_gate_up,
            "MAX_DN": sched.max_down,
            "HAS_LIMIT": int(self.swiglu_limit is not None),
            "ID64": int(id64),
            **kc.defines(),
        }
        if self._l2_regions():
            defines["L2_NEXT"] = self._l2_regions()
        if router is not None:
            reason = router_unsupported(self.hidden, top_k, router)
            if reason is not None or router.blocks != self.blocks or id64:
                raise RuntimeError(reason or "the fused router's grid is the kernel's, with int32 expert ids")
            if kc.probe == "copy_only":  # (moe_decode.cu refuses it too: its blocks would wait for a selection forever)
                raise ValueError(
                    "DecodeKernelConfig.probe 'copy_only' has no gate_up warps, which route with the router inside: "
                    "time it with the router's own kernel (PersistentDecodeMoE.forward), or pick another probe"
                )
            defines.update(router.defines())
        if shared is not None:
            if router is None:
                raise RuntimeError("the shared expert runs inside the kernel that also runs the router")
            reason = self.shared_unsupported(top_k, shared)
            if reason is not None:
                raise RuntimeError(reason)
            offset, waits = shared_tail(sched, self.hidden, self.inter, top_k, shared.inter)
            sched = with_shared_column(sched, waits)
            defines.update(
                SHARED=1,
                SHI=shared.inter,
                SH_HAS_LIMIT=int(shared.limit is not None),
                SH_COPIES=SH_COPIES,
                SH_OFFSET=offset,
            )
        kernel = CudaKernel(SOURCE, "moe_decode", defines, self.device)
        _BUILT.append({"seconds": kernel.compile.seconds, "cached": kernel.compile.cached, "path": kernel.compile.path})
        smem = _shared_bytes(
            sched, self.hidden, self.inter, top_k, router, self._l2_regions(), kc.x_in_tiles, kc.warp_select
        )
        limit = torch.cuda.get_device_properties(self.device).shared_memory_per_block_optin
        if smem > limit:
            raise RuntimeError(
                f"the persistent decode kernel needs {smem} bytes of shared memory per block at these shapes "
                f"({self.blocks} SMs); this GPU allows {limit}. Use --moe-backend triton."
            )
        kernel.set_shared_bytes(smem)
        threads = 32 * (self.hidden // 128 + self.inter // 128 + 2 + int(kc.trace))  # + observer warp
        if kernel.max_blocks_per_sm(threads, smem) < 1:
            raise RuntimeError("the persistent decode kernel does not fit on an SM here; use --moe-backend triton")
        entry = (kernel, sched, sched.table.to(self.device), threads)
        self._kernels[key] = entry
        return entry

    def forward(
        self,
        x: torch.Tensor,
        topk_ids: torch.Tensor,
        topk_weights: torch.Tensor,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if topk_ids.shape[0] != 1:
            return super().forward(x, topk_ids, topk_weights, out)
        out = self._output(x, 1, out)
        xb, ids, wts = self._operands(x, topk_ids, topk_weights)
        if xb.data_ptr() % 16:  # the kernel reads x in 16-byte pieces
            xb = xb.clone()
        target = out if out.dtype == torch.bfloat16 else torch.empty_like(out, dtype=torch.bfloat16)
        self.path_calls["persistent"] += 1
        self.launch_persistent(xb, ids, wts, target)
        if target is not out:
            out.copy_(target)
        return out

    def adds_onto_residual_in_kernel(self, tokens: int) -> bool:
        # (one token: the persistent kernel, then MoEBackend's addition; TritonMoE.add_onto_residual asks this)
        return tokens != 1 and super().adds_onto_residual_in_kernel(tokens)

    def launch_persistent(self, xb: torch.Tensor, ids: torch.Tensor, wts: torch.Tensor, out: torch.Tensor) -> None:
        kernel, _, table, threads = self.kernel_for(ids.numel(), ids.dtype == torch.int64)
        self._launch(kernel, table, threads, [xb, ids, wts], out, [None] * 8 + [0.0, 0.0])

    def _launch(
        self,
        kernel: Any,
        table: torch.Tensor,
        threads: int,
        inputs: list,
        out: torch.Tensor,
        router: list,
        shared: list | None = None,
    ) -> None:
        """One launch of moe_decode: `inputs` x, ids, weights; `router` its ROUTER arguments, `shared`
        its SHARED ones (null pointers and zeros without them)."""
        limit = float(self.swiglu_limit) if self.swiglu_limit is not None else 0.0
        kc = self.kernel_config
        kernel.launch(
            self.blocks,
            threads,
            [
                *inputs,
                self.gate_up_words,
                self.gate_up_scale,
                self.down_words,
                self.down_scale,
                out,
                self._act,
                self._launches,
                table,
                limit,
                self.trace,
                *router,
                *(shared or [None] * 5 + [0.0]),
                self._l2_next if self._l2_regions() else None,
            ],
            dependent=kc.dependent_launch,
            cooperative=kc.cooperative,
        )

    def router_spec(self, router: Any) -> RouterSpec:
        """The RouterSpec of a solo.kernels.fused_router.FusedRouter."""
        return RouterSpec(router.num_experts, router.n_group, router.topk_group, bool(router.renormalize), self.blocks)

    def routed_unsupported(self, router: Any) -> str | None:
        """Why one launch cannot run `router` (a FusedRouter) and these experts (None: it can)."""
        if router.num_experts != self.num_experts or router.hidden != self.hidden:
            return "the router's experts or width differ from the experts'"
        if router.weight.dtype != torch.bfloat16 or not router.weight.is_contiguous():
            return "the fused router reads a contiguous bf16 router weight"
        if router.norm_weight.dtype != torch.bfloat16 or router.norm_weight.data_ptr() % 16:
            return "the fused router reads a 16-byte aligned bf16 norm weight"
        if router.top_k % 2 or router.top_k > 8:
            return f"the persistent decode kernel needs an even top-k <= 8, got {router.top_k}"
        return router_unsupported(self.hidden, router.top_k, self.router_spec(router))

    def shared_unsupported(self, top_k: int, shared: SharedExpert) -> str | None:
        """Why the one-token launch with the router cannot also run `shared` (None: it can)."""
        reason = shared_unsupported(self.hidden, self.blocks, shared)
        if reason is not None:
            return reason
        kc = self.kernel_config
        sched = decode_schedule(self.blocks, self.hidden, self.inter, top_k, kc.order, kc.balance, kc.early_pairs)
        if sched.max_down < 2:
            return "the fused shared expert needs a block with at least 2 down tiles (its scratch space)"
        try:
            shared_tail(sched, self.hidden, self.inter, top_k, shared.inter)
        except ValueError as exc:
            return f"the fused shared expert does not fit the kernel's shared memory: {exc}"
        return None

    def routed_forward(
        self,
        x: torch.Tensor,
        router: Any,
        count: torch.Tensor,
        launch: Any = None,
        shared: SharedExpert | None = None,
        out: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """One token's router (post-attention RMSNorm, scores, grouped top-k: `router`, a FusedRouter)
        and routed experts in one launch. x: the residual stream [1, H] bf16. Returns (the routed
        sum [1, H], the normalised x [1, H], ids [1, top_k] int32, weights [1, top_k] fp32); `count`
        (int32) is bumped once per launch on the device (and its next element too with `shared`);
        `launch` (a solo.kernels.pdl.LaunchPolicy) records the launch as family "moe_router". With
        `shared` the launch also runs that shared expert and the first result is the layer's new
        residual stream, x + shared + routed, written to `out` (which may be x itself)."""
        if x.shape != (1, self.hidden) or x.dtype != torch.bfloat16 or x.stride(1) != 1 or x.data_ptr() % 16:
            raise ValueError(f"the fused router takes one 16-byte aligned bf16 row [1, {self.hidden}]")
        top_k = router.top_k
        if shared is not None and count.numel() < 2:
            raise ValueError("with the shared expert the launch bumps two counters (moe_router, moe_shared)")
        kernel, _, table, threads = self.kernel_for(top_k, False, self.router_spec(router), shared)
        if out is None:
            out = torch.empty((1, self.hidden), dtype=torch.bfloat16, device=self.device)
        elif out.shape != (1, self.hidden) or out.dtype != torch.bfloat16 or not out.is_contiguous():
            raise ValueError(f"out must be a contiguous bf16 [1, {self.hidden}]")
        xn = torch.empty_like(out)
        ids = torch.empty((1, top_k), dtype=torch.int32, device=self.device)
        wts = torch.empty((1, top_k), dtype=torch.float32, device=self.device)
        self.path_calls["persistent"] += 1
        scratch = [router.norm_weight, router.weight, router.bias, self._scores, xn, ids, wts, count]
        shared_args = None
        if shared is not None:
            if self._shared_act is None or self._shared_act.numel() != SH_COPIES * shared.inter:
                self._shared_act = torch.full((SH_COPIES * shared.inter,), -1, dtype=torch.int32, device=self.device)
            limit = float(shared.limit) if shared.limit is not None else 0.0
            shared_args = [
                shared.gate_up,
                shared.gate_up_scale,
                shared.down,
                shared.down_scale,
                self._shared_act,
                limit,
            ]
        router_args = [*scratch, float(router.eps), float(router.scaling)]
        self._launch(kernel, table, threads, [x, None, None], out, router_args, shared_args)
        if launch is not None:
            launch.record("moe_router", kernel)
            if shared is not None:
                launch.record("moe_shared", kernel)
        return out, xn, ids, wts

    def warmup(self, top_k: int = 8, max_tokens: int = 4) -> dict[str, Any]:
        record = super().warmup(top_k=top_k, max_tokens=max_tokens)
        for id64 in (False, True):
            kernel = self.kernel_for(top_k, id64)[0]
        record["persistent_compile"] = {"seconds": kernel.compile.seconds, "cached": kernel.compile.cached}
        return record

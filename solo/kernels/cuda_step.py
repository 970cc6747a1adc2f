"""The decode step's one-token projections and routers as CUDA kernels (Hopper, NVRTC).

`CudaGemv` and `CudaRouter` take over the one-token calls of a `FusedGemv` / `FusedRouter` (same
arguments, same results up to fp32 summation order) and hand calls of several tokens (NEXTN
verification) back to the Triton kernels, which also stay the CPU-interpreter path the tests run.
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
ROUTER_SOURCE = Path(__file__).parent / "cuda" / "router_decode.cu"
_BUILT: list[Any] = []  # CompileRecords of this process


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


def compile_report() -> dict[str, Any]:
    return {
        "kernels": len(_BUILT),
        "compile_seconds": round(sum(r.seconds for r in _BUILT), 3),
        "all_cached": all(r.cached for r in _BUILT),
    }


@dataclass(frozen=True)
class GemvLaunch:
    """How one projection's kernel runs: warps per block, rows per warp task, blocks per SM (at most;
    fewer where registers or shared memory allow fewer), and whether a warp loads its next task
    while it reduces the current one (buffers=2) or has one in flight at a time (buffers=1)."""

    warps: int = 4
    rows_per_task: int = 1
    blocks_per_sm: int = 16
    buffers: int = 1


def choose_launch(rows: int, k: int, swiglu: bool) -> GemvLaunch:
    """Two rows per task where there are many rows (more bytes in flight per lane), one otherwise
    (so the tasks spread evenly over the warps: 2,560 rows over 132 SMs x 16 warps)."""
    if rows >= 8192 and not swiglu and k <= 4096:
        return GemvLaunch(warps=4, rows_per_task=2)
    return GemvLaunch(warps=4, rows_per_task=1)


def _load(source: Path, name: str, defines: dict[str, int], device: torch.device):
    from solo.kernels.cuda_runtime import CudaKernel

    kernel = CudaKernel(source, name, defines, device)
    _BUILT.append(kernel.compile)
    return kernel


class CudaGemv:
    """The one-token calls of `fused` (a FusedGemv with FP8 weights) on gemv_decode.cu."""

    def __init__(self, fused: FusedGemv, counter: torch.Tensor, launch: GemvLaunch | None = None) -> None:
        if fused.weight.dtype != torch.float8_e4m3fn:
            raise ValueError(f"{fused.name}: the CUDA GEMV runs FP8 weights, not {fused.weight.dtype}")
        if fused.k % 16 or fused.weight.data_ptr() % 16:
            raise ValueError(f"{fused.name}: the CUDA GEMV reads 16-byte pieces: K % 16 == 0 and an aligned weight")
        self.fused = fused
        self.name = fused.name
        self.rows = fused.rows
        self.out_features = fused.out_features
        self.k = fused.k
        self.counter = counter
        self.launch_config = launch or choose_launch(fused.rows, fused.k, fused.half is not None)
        self.device = fused.weight.device
        self.sms = torch.cuda.get_device_properties(self.device).multi_processor_count
        self._kernels: dict[tuple, tuple[Any, int]] = {}

    @property
    def launch(self) -> LaunchPolicy:
        return self.fused.launch

    def nbytes(self) -> int:
        return self.fused.nbytes()

    def set_launch(self, launch: GemvLaunch) -> None:
        self.launch_config = launch
        self._kernels.clear()

    def _kernel(self, norm: int, epi: int, add: bool, write_xn: bool, out_f32: bool, group: int):
        key = (norm, epi, add, write_xn, out_f32, group)
        if key not in self._kernels:
            f, cfg = self.fused, self.launch_config
            defines = {
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
                "WARPS": cfg.warps,
                "RPW": cfg.rows_per_task,
                "BUFFERS": cfg.buffers,
            }
            kernel = _load(GEMV_SOURCE, "gemv_decode", defines, self.device)
            shared = self.k * 4
            kernel.set_shared_bytes(shared)
            threads = 32 * cfg.warps
            per_sm = min(cfg.blocks_per_sm, kernel.max_blocks_per_sm(threads, shared))
            if per_sm < 1:
                raise RuntimeError(f"{self.name}: the CUDA GEMV does not fit on an SM with {cfg}")
            tasks = -(-self.rows // cfg.rows_per_task)
            grid = min(-(-tasks // cfg.warps), per_sm * self.sms)
            self._kernels[key] = (kernel, grid)
        return self._kernels[key]

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
        """As FusedGemv.__call__; one token runs here, several on the Triton kernel."""
        if x.shape[0] != 1:
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
        if x.ndim != 2 or x.shape[1] != self.k or not x.is_contiguous() or x.dtype != torch.bfloat16:
            raise ValueError(f"{self.name}: x must be a contiguous bf16 [1, {self.k}] tensor, got {tuple(x.shape)}")
        if out is None:
            out = torch.empty((1, self.rows), dtype=out_dtype, device=x.device)
        norm, group = NORM_NONE, 0
        if norm_weight is not None:
            norm = NORM_GATED if gate is not None else NORM_RMS
            if norm == NORM_GATED:
                group = norm_weight.numel()
                if self.k % group or group & (group - 1) or not 16 <= group <= 512:
                    raise ValueError(f"{self.name}: the gated norm's group ({group}) must be 16..512, a power of two")
        epi = EPI_SWIGLU if self.fused.half is not None else EPI_RESIDUAL if residual is not None else EPI_STORE
        out_f32 = out.dtype == torch.float32
        if out_f32 and epi != EPI_STORE or out.dtype not in (torch.bfloat16, torch.float32):
            raise ValueError(f"{self.name}: the CUDA GEMV writes bf16 (fp32 only for plain outputs), not {out.dtype}")
        kernel, grid = self._kernel(norm, epi, addend is not None, xn_out is not None, out_f32, group)
        kernel.launch(
            grid,
            32 * self.launch_config.warps,
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
            ],
            dependent=self.launch.pdl,
        )
        self.launch.record("cuda_gemv", kernel)
        return out


class CudaRouter:
    """The one-token calls of `fused` (a FusedRouter) on router_decode.cu."""

    WARPS = 4

    def __init__(self, fused: FusedRouter, counter: torch.Tensor) -> None:
        e, h = fused.num_experts, fused.hidden
        if h % 256 or e < 32 or e & (e - 1) or fused.n_group > 32 or e % fused.n_group:
            raise ValueError(
                f"the CUDA router needs H % 256 == 0, a power-of-two E >= 32 and at most 32 groups; got H={h}, "
                f"E={e}, {fused.n_group} groups"
            )
        if e // fused.n_group < e // 32 and fused.topk_group < fused.n_group:
            raise ValueError("the CUDA router needs groups of at least E / 32 experts")
        if fused.top_k > 32 or fused.topk_group * (e // fused.n_group) < fused.top_k:
            raise ValueError("the CUDA router selects at most 32 experts, from the kept groups")
        self.fused = fused
        self.counter = counter
        self.device = fused.weight.device
        self._kernel = None
        self._scratch: tuple[torch.Tensor, torch.Tensor] | None = None

    @property
    def launch(self) -> LaunchPolicy:
        return self.fused.launch

    def kernel(self):
        if self._kernel is None:
            f = self.fused
            defines = {
                "H": f.hidden,
                "E": f.num_experts,
                "GROUPS": f.n_group,
                "KEEP": f.topk_group,
                "TOPK": f.top_k,
                "RENORM": int(f.renormalize),
                "WARPS": self.WARPS,
                "EPW": 1,
            }
            self._kernel = _load(ROUTER_SOURCE, "router_decode", defines, self.device)
            dev = self.device
            self._scratch = (
                torch.empty(f.num_experts, dtype=torch.float32, device=dev),
                torch.zeros(1, dtype=torch.int32, device=dev),
            )
        return self._kernel

    def __call__(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """As FusedRouter.__call__; one token runs here, several on the Triton kernels."""
        if x.shape[0] != 1:
            return self.fused(x)
        f = self.fused
        if x.ndim != 2 or x.shape[1] != f.hidden or not x.is_contiguous() or x.dtype != torch.bfloat16:
            raise ValueError(f"the CUDA router takes a contiguous bf16 [1, {f.hidden}] tensor, got {tuple(x.shape)}")
        kernel = self.kernel()
        scores, arrived = self._scratch
        xn = torch.empty((1, f.hidden), dtype=torch.bfloat16, device=x.device)
        ids = torch.empty((1, f.top_k), dtype=torch.int32, device=x.device)
        wts = torch.empty((1, f.top_k), dtype=torch.float32, device=x.device)
        kernel.launch(
            f.num_experts // self.WARPS,
            32 * self.WARPS,
            [x, f.norm_weight, f.weight, f.bias, xn, scores, arrived, ids, wts, self.counter, f.eps, f.scaling],
            dependent=self.launch.pdl,
        )
        self.launch.record("cuda_router", kernel)
        return xn, ids, wts

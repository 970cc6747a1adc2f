"""Triton FP8 GEMV / skinny GEMM for batch-1 decode (T = 1..16 activation rows), and the
Triton kernel cache shared by every solo Triton kernel.

Two weight formats (see solo.quantization.formats):

* rowwise: weight float8_e4m3fn [N, K], scale float32 [N] (the online FP8 LM head);
* block:   weight float8_e4m3fn [N, K], scale_inv float32 [ceil(N/128), ceil(K/128)]
  (attention, shared-expert and dense layers of the fp4 checkpoint).

out[t, n] = sum_k x[t, k] * w[n, k] * scale(n, k), accumulated in fp32.

How: one program owns BLOCK_N weight rows and a tile of up to BLOCK_T tokens and walks the whole
K dimension, so there are no atomics and every output element is written exactly once. The FP8
weight tile is widened to fp16 in registers (one packed hardware conversion per two values on
SM89+) and multiplied on the tensor cores against the (zero-padded) activation tile, fp32
accumulation. fp16 holds every E4M3 value exactly; the activations are rounded bf16 -> fp16, which
is exact for |x| in [6.1e-5, 65504] (the dot-product error this adds is far below bf16 rounding of
the result). ``dot_dtype=torch.bfloat16`` keeps the activations in bf16 instead (slower widening).
Block scales are applied to each 128-wide K slice's fp32 partial product; row scales once at the
end. N and K are compile-time constants: each distinct layer shape compiles once (warm-up) and is
then served from the on-disk cache (see `configure_triton_cache` / `kernel_cache_report`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

# --------------------------------------------------------------------------------------------- cache


def solo_cache_dir() -> Path:
    """Root of solo's caches: $SOLO_CACHE_DIR, else ~/.cache/solo."""
    root = os.environ.get("SOLO_CACHE_DIR")
    return Path(root).expanduser() if root else Path("~/.cache/solo").expanduser()


def configure_triton_cache() -> str:
    """Point Triton's kernel cache at <solo cache>/triton unless the user set TRITON_CACHE_DIR.

    Must run before the first compile; importing this module does it. Returns the directory in use.
    """
    if not os.environ.get("TRITON_CACHE_DIR"):
        os.environ["TRITON_CACHE_DIR"] = str(solo_cache_dir() / "triton")
    path = os.environ["TRITON_CACHE_DIR"]
    with contextlib.suppress(OSError):  # reported by kernel_cache_report; Triton complains on compile
        Path(path).mkdir(parents=True, exist_ok=True)
    return path


configure_triton_cache()


def _cache_entries(path: str) -> set[str]:
    """Names of the compiled-kernel folders in Triton's cache (one folder per kernel variant)."""
    try:
        return {p.name for p in Path(path).iterdir() if p.is_dir()}
    except OSError:
        return set()


@dataclass
class _WarmupRecord:
    what: str
    seconds: float
    new_cache_entries: int
    detail: dict[str, Any] = field(default_factory=dict)


_WARMUPS: list[_WarmupRecord] = []


def interpreter_mode() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


class measure_compile:
    """Context manager around a warm-up: times it (with a device synchronise) and counts the
    Triton cache folders it created. Zero new folders means every kernel came from the on-disk
    cache (or was already compiled in this process)."""

    def __init__(self, what: str, **detail: Any) -> None:
        self.what = what
        self.detail = detail
        self.record: _WarmupRecord | None = None

    def __enter__(self) -> measure_compile:
        self.cache_dir = os.environ.get("TRITON_CACHE_DIR", "")
        self.before = _cache_entries(self.cache_dir)
        self.t0 = time.perf_counter()
        return self

    def __exit__(self, *exc: object) -> None:
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        seconds = time.perf_counter() - self.t0
        new = len(_cache_entries(self.cache_dir) - self.before)
        self.record = _WarmupRecord(self.what, seconds, new, self.detail)
        if exc[0] is None:
            _WARMUPS.append(self.record)


def kernel_cache_report() -> dict[str, Any]:
    """What the warm-ups of this process compiled and what they found in Triton's on-disk cache.

    ``all_cached`` is True when at least one warm-up ran and none of them had to write a new
    kernel to the cache (every kernel for the current shapes was found on disk or already loaded).
    """
    cache_dir = os.environ.get("TRITON_CACHE_DIR", "")
    warmups = [
        {
            "what": r.what,
            "seconds": round(r.seconds, 4),
            "new_cache_entries": r.new_cache_entries,
            "cached": r.new_cache_entries == 0,
            **r.detail,
        }
        for r in _WARMUPS
    ]
    return {
        "cache_dir": cache_dir,
        "cache_dir_from_user": os.environ.get("TRITON_CACHE_DIR") != str(solo_cache_dir() / "triton"),
        "cache_dir_writable": bool(cache_dir) and os.access(cache_dir, os.W_OK),
        "cache_entries": len(_cache_entries(cache_dir)),
        "interpreter": interpreter_mode(),
        "warmups": warmups,
        "compile_seconds": round(sum(r.seconds for r in _WARMUPS), 4),
        "new_cache_entries": sum(r.new_cache_entries for r in _WARMUPS),
        "all_cached": bool(_WARMUPS) and all(r.new_cache_entries == 0 for r in _WARMUPS),
    }


def triton_cache_dir() -> str:
    return os.environ.get("TRITON_CACHE_DIR", "")


def triton_artifacts(kernel_names: tuple[str, ...] | list[str]) -> list[str]:
    """Compiled binaries in Triton's on-disk cache for the named kernels (one per compiled variant)."""
    root = Path(triton_cache_dir())
    names = set(kernel_names)
    try:
        return sorted(str(f) for f in root.glob("*/*.cubin") if f.stem in names)
    except OSError:
        return []


def require_triton_device(what: str, device: torch.device) -> None:
    """Triton kernels need CUDA tensors, except under TRITON_INTERPRET=1 (CPU tensors, tests)."""
    if interpreter_mode():
        return
    if device.type != "cuda" or not torch.cuda.is_available():
        raise RuntimeError(
            f"{what} needs an NVIDIA GPU (CUDA) and the triton package; this machine/tensor is on "
            f"'{device.type}'. Use the torch reference path on CPU (or set TRITON_INTERPRET=1 for "
            "slow CPU emulation in tests)."
        )


# --------------------------------------------------------------------------------------------- kernels

import triton  # noqa: E402  (after the cache directory is configured)
import triton.language as tl  # noqa: E402

from solo.kernels.triton_epilogues import split_scratch, store_split_sum  # noqa: E402


@triton.jit
def _fp8_linear_kernel(
    x_ptr,
    w_ptr,
    s_ptr,
    o_ptr,
    T,
    stride_xt,
    stride_ot,
    N: tl.constexpr,
    K: tl.constexpr,
    BLOCKWISE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_T: tl.constexpr,
    W_LHS: tl.constexpr,
    DOT_T: tl.constexpr,
    SPLIT_K: tl.constexpr,
    part_ptr,
    cnt_ptr,
):
    pid_n = tl.program_id(0)
    pid_t = tl.program_id(1)
    pid_k = tl.program_id(2)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rt = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    rk = tl.arange(0, BLOCK_K)
    n_ok = rn < N
    t_ok = rt < T
    EVEN_N: tl.constexpr = N % BLOCK_N == 0
    EVEN_K: tl.constexpr = K % BLOCK_K == 0
    KB: tl.constexpr = (K + 127) // 128
    rn64 = rn.to(tl.int64)
    # Split-K: program pid_k walks K tiles [pid_k * K_PER, (pid_k + 1) * K_PER) (whole BLOCK_K tiles)
    K_PER: tl.constexpr = (K + SPLIT_K * BLOCK_K - 1) // (SPLIT_K * BLOCK_K) * BLOCK_K
    k_begin = pid_k * K_PER
    k_end = tl.minimum(k_begin + K_PER, K)
    if W_LHS:
        acc = tl.zeros((BLOCK_N, BLOCK_T), dtype=tl.float32)
        w_ptrs = w_ptr + rn64[:, None] * K + (k_begin + rk)[None, :]
        x_ptrs = x_ptr + rt[None, :] * stride_xt + (k_begin + rk)[:, None]
    else:
        acc = tl.zeros((BLOCK_T, BLOCK_N), dtype=tl.float32)
        w_ptrs = w_ptr + rn64[None, :] * K + (k_begin + rk)[:, None]
        x_ptrs = x_ptr + rt[:, None] * stride_xt + (k_begin + rk)[None, :]
    for k0 in range(k_begin, k_end, BLOCK_K):
        k_ok = (k0 + rk) < K
        if W_LHS:
            if EVEN_N and EVEN_K:  # noqa: SIM108 (constexpr branch)
                w = tl.load(w_ptrs)
            else:
                w = tl.load(w_ptrs, mask=n_ok[:, None] & k_ok[None, :], other=0.0)
            xt = tl.load(x_ptrs, mask=t_ok[None, :] & k_ok[:, None], other=0.0)
            part = tl.dot(w.to(DOT_T), xt.to(DOT_T))
        else:
            if EVEN_N and EVEN_K:  # noqa: SIM108 (constexpr branch)
                w = tl.load(w_ptrs)
            else:
                w = tl.load(w_ptrs, mask=n_ok[None, :] & k_ok[:, None], other=0.0)
            xt = tl.load(x_ptrs, mask=t_ok[:, None] & k_ok[None, :], other=0.0)
            part = tl.dot(xt.to(DOT_T), w.to(DOT_T))
        if BLOCKWISE:
            # BLOCK_N divides 128 and BLOCK_K divides 128: one scale per tile.
            s = tl.load(s_ptr + ((pid_n * BLOCK_N) // 128) * KB + k0 // 128)
            acc += part * s
        else:
            acc += part
        w_ptrs += BLOCK_K
        x_ptrs += BLOCK_K
    if W_LHS:
        if not BLOCKWISE:
            rs = tl.load(s_ptr + rn, mask=n_ok, other=0.0)
            acc = acc * rs[:, None]
        o_offs = rt[None, :] * stride_ot + rn[:, None]
        o_ok = n_ok[:, None] & t_ok[None, :]
    else:
        if not BLOCKWISE:
            rs = tl.load(s_ptr + rn, mask=n_ok, other=0.0)
            acc = acc * rs[None, :]
        o_offs = rt[:, None] * stride_ot + rn[None, :]
        o_ok = t_ok[:, None] & n_ok[None, :]
    if SPLIT_K == 1:
        tl.store(o_ptr + o_offs, acc.to(o_ptr.dtype.element_ty), mask=o_ok)
    else:  # the K slices' partial sums meet in a fixed order (last arriver, deterministic)
        TILE: tl.constexpr = BLOCK_N * BLOCK_T
        slot = pid_n * tl.num_programs(1) + pid_t
        flat = tl.reshape(acc, (TILE,))
        store_split_sum(
            flat,
            o_ptr,
            tl.reshape(o_offs, (TILE,)),
            tl.reshape(o_ok, (TILE,)),
            part_ptr,
            cnt_ptr,
            slot,
            pid_k,
            SPLIT_K,
            TILE,
            False,
        )


# --------------------------------------------------------------------------------------------- configs


@dataclass(frozen=True)
class Fp8Config:
    block_n: int
    block_k: int
    block_t: int = 16
    w_lhs: bool = True
    num_warps: int = 4
    num_stages: int = 4
    split_k: int = 1  # programs sharing one output tile's K (partial sums reduced by the last one)


# Chosen by `python -m solo.bench.kernels --tune` on the H200 (see docs/kernels.md).
_DEFAULT_ROWWISE = Fp8Config(block_n=64, block_k=256, block_t=8, w_lhs=True, num_warps=4, num_stages=4)
_DEFAULT_BLOCK = Fp8Config(block_n=32, block_k=128, block_t=16, w_lhs=True, num_warps=2, num_stages=3)
# Block-FP8 layers are small (10-16 MB at Ling-3.0-flash shapes): one program per 32 rows leaves most
# SMs idle, so the K loop is split until about this many programs run (H200: 2560->4096 8.6 -> 7.5 us).
_BLOCK_TARGET_PROGRAMS = 768
_BLOCK_MAX_SPLIT = 8
# --block-fp8 auto keeps a layer in FP8 when its K is at least this: below it cuBLAS on the BF16 copy
# was as fast or faster on the H200 (dev/block_fp8_crossover.py, docs/results/h200_block_fp8_crossover.log).
BLOCK_FP8_MIN_K = 1536
_OVERRIDES: dict[tuple[str, int, int], Fp8Config] = {}


def set_fp8_config(kind: str, n: int, k: int, config: Fp8Config | None) -> None:
    """Pin the launch configuration for one (kind, N, K) (the tuner uses this)."""
    key = (kind, int(n), int(k))
    if config is None:
        _OVERRIDES.pop(key, None)
    else:
        _OVERRIDES[key] = config


def fp8_config(kind: str, n: int, k: int, tokens: int = 1) -> Fp8Config:
    cfg = _OVERRIDES.get((kind, n, k))
    if cfg is not None:
        return cfg
    if kind != "block":
        return _DEFAULT_ROWWISE
    base = _DEFAULT_BLOCK
    # Smaller tiles when the layer is so small that half the SMs would idle.
    block_n = base.block_n
    while block_n > 16 and triton.cdiv(n, block_n) < 64:
        block_n //= 2
    tiles = triton.cdiv(n, block_n) * triton.cdiv(tokens, base.block_t)
    split = 1
    while (
        split * 2 <= _BLOCK_MAX_SPLIT
        and tiles * split * 2 <= _BLOCK_TARGET_PROGRAMS
        and split * 2 <= triton.cdiv(k, base.block_k)
    ):
        split *= 2
    return dataclasses.replace(base, block_n=block_n, split_k=split)


# --------------------------------------------------------------------------------------------- wrappers


# Split-K scratch (solo.kernels.triton_epilogues.split_scratch), per device: fp32 partials and
# self-resetting arrival counters. The first buffers cover every default split (at most
# _BLOCK_TARGET_PROGRAMS programs of one output tile each).
_SCRATCH: dict[tuple[str, str], torch.Tensor] = {}


def _prepare_x(x: torch.Tensor, k: int) -> torch.Tensor:
    if x.shape[-1] != k:
        raise ValueError(f"activation last dim {x.shape[-1]} does not match the weight's K = {k}")
    x2 = x.reshape(-1, k)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    return x2


def _launch(
    kind: str,
    x: torch.Tensor,
    w: torch.Tensor,
    s: torch.Tensor,
    out: torch.Tensor | None,
    out_dtype: torch.dtype | None,
    config: Fp8Config | None,
    dot_dtype: torch.dtype,
) -> torch.Tensor:
    require_triton_device(f"fp8_{kind}_linear", x.device)
    if w.dtype != torch.float8_e4m3fn or w.ndim != 2:
        raise ValueError(f"weight must be float8_e4m3fn [N, K], got {w.dtype} {tuple(w.shape)}")
    if not w.is_contiguous():
        raise ValueError("FP8 weight must be contiguous (row-major [N, K])")
    n, k = w.shape
    if kind == "block":
        expected = (triton.cdiv(n, 128), triton.cdiv(k, 128))
        if tuple(s.shape) != expected:
            raise ValueError(f"scale_inv must be {expected} for weight {tuple(w.shape)}, got {tuple(s.shape)}")
    elif tuple(s.shape) != (n,):
        raise ValueError(f"row scale must be [{n}], got {tuple(s.shape)}")
    if s.dtype != torch.float32 or not s.is_contiguous():
        s = s.float().contiguous()
    lead = x.shape[:-1]
    x2 = _prepare_x(x, k)
    t = x2.shape[0]
    if out is None:
        out = torch.empty((t, n), dtype=out_dtype or x.dtype, device=x.device)
    else:
        if out.shape[-1] != n or out.numel() != t * n:
            raise ValueError(f"out must hold [{t}, {n}], got {tuple(out.shape)}")
    o2 = out.view(t, n)
    cfg = config or fp8_config(kind, n, k, t)
    if kind == "block" and (128 % cfg.block_n or 128 % cfg.block_k):
        raise ValueError("block-FP8 tiles must divide the 128x128 scale blocks")
    if t == 0:
        return out.view(*lead, n)
    split = max(1, min(cfg.split_k, triton.cdiv(k, cfg.block_k)))
    grid = (triton.cdiv(n, cfg.block_n), triton.cdiv(t, cfg.block_t), split)
    if split > 1:
        slots = grid[0] * grid[1]
        dev, most = x.device, _BLOCK_TARGET_PROGRAMS
        need = slots * split * cfg.block_n * cfg.block_t
        tile = _DEFAULT_BLOCK.block_n * _DEFAULT_BLOCK.block_t
        part = split_scratch(_SCRATCH, (str(dev), "fp8_part"), need, torch.float32, False, dev, most * tile)
        cnt = split_scratch(_SCRATCH, (str(dev), "fp8_cnt"), slots, torch.int32, True, dev, most)
    else:
        part = cnt = o2  # unused
    _fp8_linear_kernel[grid](
        x2,
        w,
        s,
        o2,
        t,
        x2.stride(0),
        o2.stride(0),
        N=n,
        K=k,
        BLOCKWISE=kind == "block",
        BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k,
        BLOCK_T=cfg.block_t,
        W_LHS=cfg.w_lhs,
        DOT_T=tl.float16 if dot_dtype == torch.float16 else tl.bfloat16,
        SPLIT_K=split,
        part_ptr=part,
        cnt_ptr=cnt,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )
    return out.view(*lead, n)


def fp8_rowwise_linear(
    x: torch.Tensor,
    w_fp8: torch.Tensor,
    scale: torch.Tensor,
    out: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
    config: Fp8Config | None = None,
    dot_dtype: torch.dtype = torch.float16,
) -> torch.Tensor:
    """x [..., K] (bf16/fp16/fp32) @ (w_fp8 [N, K] * scale[N, None])^T -> [..., N] (x.dtype)."""
    return _launch("rowwise", x, w_fp8, scale, out, out_dtype, config, dot_dtype)


def fp8_block_linear(
    x: torch.Tensor,
    w_fp8: torch.Tensor,
    scale_inv: torch.Tensor,
    out: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
    config: Fp8Config | None = None,
    dot_dtype: torch.dtype = torch.float16,
) -> torch.Tensor:
    """x [..., K] @ dequant(w_fp8 [N, K], scale_inv [ceil(N/128), ceil(K/128)])^T -> [..., N]."""
    return _launch("block", x, w_fp8, scale_inv, out, out_dtype, config, dot_dtype)


def warmup_fp8_linear(
    kind: str,
    n: int,
    k: int,
    device: torch.device | str = "cuda",
    dtype: torch.dtype = torch.bfloat16,
    out_dtype: torch.dtype | None = None,
) -> dict[str, Any]:
    """Compile (or load from the disk cache) the kernels for one layer shape; returns the record.

    Block-FP8 layers split K by token count (``fp8_config``): every split the layer can use is
    compiled here, so no prompt length compiles a kernel mid-generation."""
    device = torch.device(device)
    w = torch.zeros((n, k), dtype=torch.float8_e4m3fn, device=device)
    if kind == "block":
        s = torch.ones((triton.cdiv(n, 128), triton.cdiv(k, 128)), dtype=torch.float32, device=device)
    else:
        s = torch.ones((n,), dtype=torch.float32, device=device)
    token_counts = [1]
    while fp8_config(kind, n, k, token_counts[-1]).split_k > 1:
        token_counts.append(2 * max(token_counts[-1], _DEFAULT_BLOCK.block_t))
    with measure_compile(f"fp8_{kind}_linear", n=n, k=k) as m:
        for t in token_counts:
            x = torch.zeros((t, k), dtype=dtype, device=device)
            _launch(kind, x, w, s, None, out_dtype, None, torch.float16)
    assert m.record is not None
    return {"what": m.record.what, "seconds": m.record.seconds, "new_cache_entries": m.record.new_cache_entries}


def compile_for_shapes(
    rowwise: list[tuple[int, int]] | tuple = (),
    block: list[tuple[int, int]] | tuple = (),
    device: torch.device | str = "cuda",
    dtype: torch.dtype = torch.bfloat16,
) -> dict[str, Any]:
    """Warm up the FP8 kernels for the model's (N, K) shapes; returns `kernel_cache_report()`."""
    for n, k in rowwise:
        warmup_fp8_linear("rowwise", n, k, device, dtype)
    for n, k in block:
        warmup_fp8_linear("block", n, k, device, dtype)
    return kernel_cache_report()

"""Run-time compiled CUDA C++ kernels: NVRTC for the compile, the CUDA driver API for the launch.

For kernels Triton cannot express (solo/kernels/cuda/*.cu). The source is compiled for the GPU in
use with the caller's defines (the layer's exact shapes), the cubin is cached on disk under
``<solo cache>/cuda`` keyed by source, defines, architecture and NVRTC version, and launches go
through ``cuLaunchKernelEx`` on torch's current stream, so they are captured into CUDA graphs like
any other kernel. Both libraries are found where a CUDA build of PyTorch installs them (the
``nvidia-cuda-nvrtc`` wheel) or in a CUDA toolkit; a missing one is a RuntimeError that says so.
"""

from __future__ import annotations

import ctypes
import glob
import hashlib
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

_PROGRAMMATIC_STREAM_SERIALIZATION = 6  # CUlaunchAttributeID
_COOPERATIVE = 2
_MAX_DYNAMIC_SHARED_SIZE_BYTES = 8  # CUfunction_attribute
_PREFERRED_SHARED_MEMORY_CARVEOUT = 9  # CUfunction_attribute
_NUM_REGS, _LOCAL_SIZE_BYTES = 4, 3  # CUfunction_attribute


def cuda_cache_dir() -> Path:
    root = os.environ.get("SOLO_CACHE_DIR")
    return Path(os.path.expanduser(root) if root else os.path.expanduser("~/.cache/solo")) / "cuda"


def _library_candidates(stem: str) -> list[str]:
    found = []
    for site in sys.path:
        found += sorted(glob.glob(os.path.join(site, "nvidia", "*", "lib", f"lib{stem}.so*")))
        found += sorted(glob.glob(os.path.join(site, "nvidia", "*", "*", "lib", f"lib{stem}.so*")))
    for home in (os.environ.get("CUDA_HOME"), "/usr/local/cuda"):
        if home:
            found += sorted(glob.glob(os.path.join(home, "lib64", f"lib{stem}.so*")))
    return found + [f"lib{stem}.so"]


def _load(stem: str, candidates: list[str]) -> ctypes.CDLL:
    errors = []
    for path in candidates:
        try:
            return ctypes.CDLL(path)
        except OSError as exc:
            errors.append(f"{path}: {exc}")
    raise RuntimeError(
        f"lib{stem} not found (tried {', '.join(candidates[-3:])}). Install a CUDA build of PyTorch "
        "(it brings nvidia-cuda-nvrtc) or a CUDA toolkit."
    )


_nvrtc: ctypes.CDLL | None = None
_cuda: ctypes.CDLL | None = None


def nvrtc() -> ctypes.CDLL:
    global _nvrtc
    if _nvrtc is None:
        _nvrtc = _load("nvrtc", _library_candidates("nvrtc"))
        # libnvrtc dlopens its builtins by name; a wheel's lib folder is not on the loader's path
        for path in _library_candidates("nvrtc-builtins"):
            if os.path.dirname(path):
                try:
                    ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
                    break
                except OSError:
                    continue
        _nvrtc.nvrtcGetErrorString.restype = ctypes.c_char_p
    return _nvrtc


def driver() -> ctypes.CDLL:
    global _cuda
    if _cuda is None:
        _cuda = _load("cuda", ["libcuda.so.1", "libcuda.so"])
    return _cuda


def _check_nvrtc(code: int, what: str) -> None:
    if code != 0:
        raise RuntimeError(f"NVRTC {what} failed: {nvrtc().nvrtcGetErrorString(code).decode()}")


def _check_cu(code: int, what: str) -> None:
    if code != 0:
        msg = ctypes.c_char_p()
        driver().cuGetErrorString(code, ctypes.byref(msg))
        raise RuntimeError(f"CUDA driver {what} failed: {code} {(msg.value or b'').decode()}")


def nvrtc_version() -> tuple[int, int]:
    major, minor = ctypes.c_int(), ctypes.c_int()
    _check_nvrtc(nvrtc().nvrtcVersion(ctypes.byref(major), ctypes.byref(minor)), "version")
    return major.value, minor.value


def compile_cubin(source: str, name: str, defines: dict[str, int | float], arch: str) -> bytes:
    """Compile ``source`` for ``arch`` (e.g. 'sm_90') with ``-D`` defines; RuntimeError with the log on failure."""
    lib = nvrtc()
    prog = ctypes.c_void_p()
    _check_nvrtc(
        lib.nvrtcCreateProgram(ctypes.byref(prog), source.encode(), f"{name}.cu".encode(), 0, None, None), "create"
    )
    opts = [f"--gpu-architecture={arch}", "-std=c++17", "-default-device", "--use_fast_math"]
    opts += [f"-D{k}={v}" for k, v in sorted(defines.items())]
    arr = (ctypes.c_char_p * len(opts))(*[o.encode() for o in opts])
    try:
        code = lib.nvrtcCompileProgram(prog, len(opts), arr)
        if code != 0:
            size = ctypes.c_size_t()
            lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
            log = ctypes.create_string_buffer(size.value)
            lib.nvrtcGetProgramLog(prog, log)
            raise RuntimeError(f"NVRTC could not compile {name}.cu ({' '.join(opts)}):\n{log.value.decode()}")
        size = ctypes.c_size_t()
        _check_nvrtc(lib.nvrtcGetCUBINSize(prog, ctypes.byref(size)), "get cubin size")
        cubin = ctypes.create_string_buffer(size.value)
        _check_nvrtc(lib.nvrtcGetCUBIN(prog, cubin), "get cubin")
        return cubin.raw
    finally:
        lib.nvrtcDestroyProgram(ctypes.byref(prog))


def expand_includes(source_path: Path) -> str:
    """The source with each `#include "NAME"` of a file beside it inlined (one level; NVRTC is given no
    include path, and the cache key then covers the headers' text too)."""
    out = []
    for line in source_path.read_text().splitlines(keepends=True):
        name = line.strip().removeprefix("#include").strip()
        if line.lstrip().startswith("#include") and name.startswith('"') and name.endswith('"'):
            header = source_path.parent / name.strip('"')
            if not header.is_file():
                raise RuntimeError(f"{source_path.name} includes {name}, which is not beside it")
            out.append(header.read_text())
            out.append("\n")
        else:
            out.append(line)
    return "".join(out)


class _LaunchAttribute(ctypes.Structure):
    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_int), ("value", ctypes.c_int * 16)]


class _LaunchConfig(ctypes.Structure):
    _fields_ = [
        ("grid", ctypes.c_uint * 3),
        ("block", ctypes.c_uint * 3),
        ("shared_bytes", ctypes.c_uint),
        ("stream", ctypes.c_void_p),
        ("attrs", ctypes.POINTER(_LaunchAttribute)),
        ("num_attrs", ctypes.c_uint),
    ]


@dataclass
class CompileRecord:
    seconds: float
    cached: bool
    path: str


class CudaKernel:
    """One ``extern "C"`` kernel of a .cu source, compiled for the current GPU and loaded."""

    def __init__(self, source_path: Path, name: str, defines: dict[str, int | float], device: torch.device) -> None:
        torch.cuda.init()
        with torch.cuda.device(device):
            torch.empty(1, device=device)  # makes torch's primary context current on this thread
        self.device = device
        self.name = name
        major, minor = torch.cuda.get_device_capability(device)
        self.arch = f"sm_{major}{minor}"
        source = expand_includes(source_path)
        key = hashlib.sha256(
            repr((source, name, sorted(defines.items()), self.arch, nvrtc_version())).encode()
        ).hexdigest()[:24]
        path = cuda_cache_dir() / f"{name}-{key}.cubin"
        t0 = time.perf_counter()
        cached = path.exists()
        if cached:
            cubin = path.read_bytes()
        else:
            cubin = compile_cubin(source, name, defines, self.arch)
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(f".tmp{os.getpid()}")
            tmp.write_bytes(cubin)
            tmp.replace(path)
        self.compile = CompileRecord(time.perf_counter() - t0, cached, str(path))
        cu = driver()
        self._image = ctypes.create_string_buffer(cubin)
        self._module = ctypes.c_void_p()
        with torch.cuda.device(device):
            _check_cu(cu.cuModuleLoadData(ctypes.byref(self._module), self._image), "cuModuleLoadData")
            self._fn = ctypes.c_void_p()
            _check_cu(cu.cuModuleGetFunction(ctypes.byref(self._fn), self._module, name.encode()), "get function")
        self._shared = 0
        self.last_dependent = False  # whether the last launch was a programmatic dependent launch

    def set_shared_bytes(self, nbytes: int) -> None:
        _check_cu(
            driver().cuFuncSetAttribute(self._fn, _MAX_DYNAMIC_SHARED_SIZE_BYTES, ctypes.c_int(nbytes)),
            f"set dynamic shared memory to {nbytes} bytes",
        )
        self._shared = nbytes

    def set_carveout(self, percent: int) -> None:
        """The share of an SM's largest shared memory this kernel prefers (the rest is L1); -1: the driver's choice."""
        _check_cu(
            driver().cuFuncSetAttribute(self._fn, _PREFERRED_SHARED_MEMORY_CARVEOUT, ctypes.c_int(percent)),
            f"set the shared memory carveout to {percent}%",
        )

    def max_blocks_per_sm(self, threads: int, shared_bytes: int) -> int:
        n = ctypes.c_int()
        _check_cu(
            driver().cuOccupancyMaxActiveBlocksPerMultiprocessor(
                ctypes.byref(n), self._fn, ctypes.c_int(threads), ctypes.c_size_t(shared_bytes)
            ),
            "occupancy query",
        )
        return n.value

    def _config(self, grid: int, threads: int, attrs, num_attrs: int) -> _LaunchConfig:
        """A 1-D launch of this kernel on torch's current stream, with its dynamic shared memory."""
        cfg = _LaunchConfig()
        cfg.grid[:] = (grid, 1, 1)
        cfg.block[:] = (threads, 1, 1)
        cfg.shared_bytes = self._shared
        cfg.stream = ctypes.c_void_p(torch.cuda.current_stream(self.device).cuda_stream)
        cfg.attrs = attrs
        cfg.num_attrs = num_attrs
        return cfg

    def registers(self) -> tuple[int, int]:
        """(registers a thread, local memory bytes a thread: spills and stack) of the loaded kernel."""
        regs, local = ctypes.c_int(), ctypes.c_int()
        _check_cu(driver().cuFuncGetAttribute(ctypes.byref(regs), _NUM_REGS, self._fn), "read the registers")
        _check_cu(driver().cuFuncGetAttribute(ctypes.byref(local), _LOCAL_SIZE_BYTES, self._fn), "read the local size")
        return regs.value, local.value

    def max_active_clusters(self, grid: int, threads: int) -> int:
        """How many of this kernel's thread-block clusters (its compiled __cluster_dims__) can be resident at once."""
        cfg = self._config(grid, threads, (_LaunchAttribute * 1)(), 0)
        n = ctypes.c_int()
        _check_cu(driver().cuOccupancyMaxActiveClusters(ctypes.byref(n), self._fn, ctypes.byref(cfg)), "cluster query")
        return n.value

    def launch(
        self,
        grid: int,
        threads: int,
        args: list[torch.Tensor | int | float | None],
        *,
        dependent: bool = False,
        cooperative: bool = False,
    ) -> None:
        """Launch on torch's current stream. Tensors pass their data pointer, None a null pointer,
        ints an int32, floats a float32. ``dependent``: programmatic dependent launch (the kernel
        waits with griddepcontrol.wait); ``cooperative``: all blocks must be resident at once."""
        holders = []
        for a in args:
            if isinstance(a, torch.Tensor):
                holders.append(ctypes.c_void_p(a.data_ptr()))
            elif a is None:
                holders.append(ctypes.c_void_p(0))
            elif isinstance(a, float):
                holders.append(ctypes.c_float(a))
            else:
                holders.append(ctypes.c_int(a))
        params = (ctypes.c_void_p * len(holders))(*[ctypes.cast(ctypes.byref(h), ctypes.c_void_p) for h in holders])
        attrs = (_LaunchAttribute * 2)()
        n = 0
        for wanted, attr_id in ((dependent, _PROGRAMMATIC_STREAM_SERIALIZATION), (cooperative, _COOPERATIVE)):
            if wanted:
                attrs[n].id = attr_id
                attrs[n].value[0] = 1
                n += 1
        cfg = self._config(grid, threads, attrs, n)
        _check_cu(driver().cuLaunchKernelEx(ctypes.byref(cfg), self._fn, params, None), f"launch {self.name}")
        self.last_dependent = dependent

"""The routed-expert backends, registered once by name; an unavailable backend is an error, never a fallback.

Each backend is registered with how to build it and what it needs; `make_moe_backend` is the only
way the fast path builds one. Builders import their kernels lazily, so a CPU machine never imports
Triton or Humming unless a backend that needs them is asked for.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass

import torch

from solo.kernels.moe import DenseExperts, MoEBackend, MXFP4Experts, TorchMoE


class BackendUnavailable(RuntimeError):
    """A requested kernel backend cannot run here; the message says why and what to do."""


Builder = Callable[[MXFP4Experts | DenseExperts, torch.dtype, "float | None", int, int], MoEBackend]


@dataclass(frozen=True)
class BackendSpec:
    name: str
    build: Builder
    needs_mxfp4: bool  # runs the checkpoint's MXFP4 experts only
    needs_cuda: bool  # needs the experts on a CUDA GPU
    runs_in_triton_interpreter: bool  # a CPU can run it under TRITON_INTERPRET=1 (tests)
    summary: str


_BACKENDS: dict[str, BackendSpec] = {}


def register_moe_backend(spec: BackendSpec) -> None:
    if spec.name in _BACKENDS:
        raise ValueError(f"MoE backend '{spec.name}' is registered twice")
    _BACKENDS[spec.name] = spec


def backend_names() -> tuple[str, ...]:
    return tuple(_BACKENDS)


def backend_spec(name: str) -> BackendSpec:
    if name not in _BACKENDS:
        raise BackendUnavailable(f"unknown MoE backend '{name}'; choose one of {', '.join(_BACKENDS)}.")
    return _BACKENDS[name]


def make_moe_backend(
    name: str,
    experts: MXFP4Experts | DenseExperts,
    dtype: torch.dtype,
    swiglu_limit: float | None,
    top_k: int = 8,
    max_tokens: int = 8,
) -> MoEBackend:
    """Build the backend `name` for one layer's experts, warmed up (compiled or loaded from the disk
    cache) for `top_k` experts and up to `max_tokens` tokens per call where the backend compiles."""
    spec = backend_spec(name)
    if spec.needs_mxfp4 and not isinstance(experts, MXFP4Experts):
        raise BackendUnavailable(
            f"--moe-backend {name} runs MXFP4 experts, but this checkpoint's experts are not MXFP4. "
            "Convert it with `solo quantize IN_DIR OUT_DIR`, or use --moe-backend torch."
        )
    on_cuda = experts.gate_up.device.type == "cuda"
    if spec.needs_cuda and not on_cuda and not (spec.runs_in_triton_interpreter and _triton_interpreter()):
        raise BackendUnavailable(
            f"--moe-backend {name} needs an NVIDIA GPU (CUDA) and the model on it (--device cuda); this run is "
            f"on '{experts.gate_up.device.type}'. Use --moe-backend torch on a CPU."
        )
    try:
        return spec.build(experts, dtype, swiglu_limit, top_k, max_tokens)
    except (ImportError, RuntimeError, ValueError) as e:
        raise BackendUnavailable(f"--moe-backend {name} cannot run here: {e}") from e


def _triton_interpreter() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


# --------------------------------------------------------------------------------------------- the backends
def _build_torch(experts, dtype, swiglu_limit, top_k, max_tokens) -> MoEBackend:
    return TorchMoE(experts, dtype, swiglu_limit)


def _build_triton(experts, dtype, swiglu_limit, top_k, max_tokens) -> MoEBackend:
    from solo.kernels.triton_moe import TritonMoE

    backend = TritonMoE(experts, dtype=dtype, swiglu_limit=swiglu_limit)
    backend.warmup(top_k=top_k, max_tokens=max_tokens)
    return backend


def _build_cuda(experts, dtype, swiglu_limit, top_k, max_tokens) -> MoEBackend:
    from solo.kernels.cuda_moe import PersistentDecodeMoE

    backend = PersistentDecodeMoE(experts, dtype=dtype, swiglu_limit=swiglu_limit)
    backend.warmup(top_k=top_k, max_tokens=max_tokens)
    return backend


def _build_humming(experts, dtype, swiglu_limit, top_k, max_tokens) -> MoEBackend:
    from solo.kernels.humming_moe import HummingMoE

    backend = HummingMoE(experts, dtype=dtype, swiglu_limit=swiglu_limit)
    backend.warmup(top_k=top_k, token_counts=(1, 4))  # decode and the default verification window
    return backend


register_moe_backend(
    BackendSpec("torch", _build_torch, False, False, False, "PyTorch reference (dequantized experts, dense products)")
)
register_moe_backend(
    BackendSpec(
        "triton",
        _build_triton,
        True,
        True,
        True,
        "solo's Triton MXFP4 kernels: CUDA-core GEMVs up to 96 tokens, grouped tensor-core GEMMs above",
    )
)
register_moe_backend(BackendSpec("humming", _build_humming, True, True, False, "Humming's indexed MXFP4 MoE GEMMs"))
register_moe_backend(
    BackendSpec(
        "cuda",
        _build_cuda,
        True,
        True,
        False,
        "Triton's kernels with each one-token call in one persistent CUDA kernel (NVRTC, Hopper)",
    )
)

MOE_BACKENDS = backend_names()

"""Chooses the routed-expert backend by name; an unavailable backend is an error, never a fallback."""

from __future__ import annotations

import torch

from solo.kernels.moe import DenseExperts, MoEBackend, MXFP4Experts, TorchMoE

MOE_BACKENDS = ("torch", "triton", "humming", "cuda")


class BackendUnavailable(RuntimeError):
    """A requested kernel backend cannot run here; the message says why and what to do."""


def make_moe_backend(
    name: str,
    experts: MXFP4Experts | DenseExperts,
    dtype: torch.dtype,
    swiglu_limit: float | None,
    top_k: int = 8,
    max_tokens: int = 8,
) -> MoEBackend:
    """Build the backend. The Triton backend is warmed up (compiled or loaded from the on-disk cache)
    here, for `top_k` experts and up to `max_tokens` tokens per call; Humming compiles each token
    count on its first call, which the engine makes eagerly before capturing any CUDA graph."""
    if name == "torch":
        return TorchMoE(experts, dtype, swiglu_limit)
    if name not in MOE_BACKENDS:
        raise BackendUnavailable(f"unknown MoE backend '{name}'; choose one of {', '.join(MOE_BACKENDS)}.")
    if not isinstance(experts, MXFP4Experts):
        raise BackendUnavailable(
            f"--moe-backend {name} runs MXFP4 experts, but this checkpoint's experts are not MXFP4. "
            "Convert it with `solo quantize IN_DIR OUT_DIR`, or use --moe-backend torch."
        )
    if experts.gate_up.device.type != "cuda" and (name == "cuda" or not _triton_interpreter()):
        raise BackendUnavailable(
            f"--moe-backend {name} needs an NVIDIA GPU (CUDA) and the model on it (--device cuda); this run is "
            f"on '{experts.gate_up.device.type}'. Use --moe-backend torch on a CPU."
        )
    try:
        if name in ("triton", "cuda"):
            if name == "cuda":  # Triton, with the one-token call in one persistent CUDA kernel
                from solo.kernels.cuda_moe import PersistentDecodeMoE as backend_class
            else:
                from solo.kernels.triton_moe import TritonMoE as backend_class

            backend = backend_class(experts, dtype=dtype, swiglu_limit=swiglu_limit)
            backend.warmup(top_k=top_k, max_tokens=max_tokens)
            return backend
        from solo.kernels.humming_moe import HummingMoE

        return HummingMoE(experts, dtype=dtype, swiglu_limit=swiglu_limit)
    except (ImportError, RuntimeError, ValueError) as e:
        raise BackendUnavailable(f"--moe-backend {name} cannot run here: {e}") from e


def _triton_interpreter() -> bool:
    import os

    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")

"""Whether the fused decode step can run a model here (importable without Triton)."""

from __future__ import annotations

import os

import torch

from solo.model.ling import LingForCausalLM

STEP_KERNELS = ("auto", "triton", "cuda")  # the fused step's one-token kernels (--step-kernels)


class DecodeStepUnavailable(ValueError):
    """The fused decode step cannot run this model or configuration; the message says why and what to do."""


class PDLUnavailable(DecodeStepUnavailable):
    """--pdl on where programmatic dependent launch cannot run (the step itself could)."""


class StepKernelsUnavailable(DecodeStepUnavailable):
    """--step-kernels cuda where the CUDA step kernels cannot run (the step itself could)."""


def fused_step_unavailable(model: LingForCausalLM, allow_interpreter: bool = True) -> str | None:
    """Why the fused decode step cannot run `model` here (None: it can). On a CPU it runs only under
    Triton's interpreter (TRITON_INTERPRET=1, for tests), and only when asked for explicitly."""
    if model.tp.enabled:
        return (
            "the fused decode step runs one unsplit model; under --tensor-parallel the reference modules run "
            "(with their all-reduces, and CUDA graphs)"
        )
    interpreter = allow_interpreter and os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
    if model.device.type != "cuda" and not interpreter:
        return f"the fused decode step runs on an NVIDIA GPU (--device cuda); this model is on {model.device.type}"
    try:
        import triton  # noqa: F401
    except ImportError:
        return "the fused decode step needs the triton package (pip install triton)"
    if model.dtype != torch.bfloat16:
        return f"the fused decode step computes in bfloat16; this model is {model.dtype} (--dtype bfloat16)"
    c = model.config
    if c.conv_kernel_size != 4 or c.linear_head_dim % 32 or c.linear_head_dim & (c.linear_head_dim - 1):
        return "the fused KDA kernel needs short convolutions of 4 and a power-of-two head size (a multiple of 32)"
    if c.kv_lora_rank % 128 or c.q_lora_rank or c.v_head_dim % 16:
        return "the fused MLA kernels need kv_lora_rank % 128 == 0, v_head_dim % 16 == 0 and no q LoRA"
    return None

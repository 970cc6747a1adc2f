"""`accelerate(model, options)`: the one explicit step from the reference model to the fast path.

The checkpoint loader reads weights into the reference model (the CPU path and the oracle) and
chooses no kernels. This step installs, module by module (quantization as a module swap):
  - the routed-expert backend of every MoE layer (solo.kernels.registry), built from the experts
    as loaded and warmed up (compiled or loaded from the on-disk kernel cache);
  - for block-FP8 layers, the FP8 GEMV kernel, or dense weights where FP8 does not pay;
  - the LM head in the requested precision (FP8 quantized online, one scale per row);
and compiles the FP8 kernels for every shape the model uses, so nothing compiles mid-request.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from solo.checkpoint.loader import FP8_BLOCK, LoadOptions, load_model, reference_fp8_block_linear
from solo.checkpoint.reader import CheckpointError
from solo.fastpath.availability import STEP_KERNELS, DecodeStepUnavailable, PDLUnavailable, StepKernelsUnavailable
from solo.kernels.registry import backend_spec, make_moe_backend
from solo.model.layers import Linear, block_fp8_linears
from solo.model.ling import LingForCausalLM
from solo.model.moe import SparseMoE
from solo.quantization import lm_head as lm_head_modes

BLOCK_FP8_MODES = ("off", "auto", "on")
DECODE_STEPS = ("auto", "fused", "reference")


@dataclass(frozen=True)
class FastPathOptions:
    moe_backend: str = "torch"
    lm_head: str = "bf16"
    # block-FP8 linears: "on" keeps them in FP8, "auto" only on a GPU and where the FP8 kernel is faster
    # (K >= BLOCK_FP8_MIN_K), "off" dequantizes them all
    block_fp8: str = "auto"
    max_tokens: int = 8  # tokens per call the MoE kernels are warmed up for (decode, verification)
    # the decode step: "fused" (solo.fastpath.decode_step: a few fused kernels per layer, GPU, bf16),
    # "reference" (the model's modules), "auto" (fused where it can run, else reference, with the reason)
    decode_step: str = "auto"
    verify_tokens: int = 4  # the verification window the fused step is built and warmed up for
    # programmatic dependent launch between the fused step's one-token kernels (sm_90+; solo.kernels.pdl):
    # each launches while the previous one finishes. True needs the fused step and is refused where it
    # cannot run; None (auto): on where it measured faster, with the CUDA step kernels on a Hopper GPU
    pdl: bool | None = None
    # the fused step's projections and one-token routers: "cuda" (solo.kernels.cuda_step; Hopper, NVRTC),
    # "triton", or "auto" (CUDA where it can run, else Triton, with the reason)
    step_kernels: str = "auto"
    # the largest call (tokens) the CUDA step kernels take: 8 covers decode and verification windows up
    # to 8; 1 keeps verification on Triton (the A/B of `solo bench decode`'s fused+cuda1)
    step_kernel_tokens: int = 8
    # PDL for verification's kernels too: None (auto) where the CUDA step kernels serve the whole window
    # (measured faster), not with the Triton ones (measured slower); True / False force it
    pdl_verify: bool | None = None
    # one token's MoE router inside the persistent MoE kernel (--moe-backend cuda with the CUDA step
    # kernels): no router launch and no kernel boundary before the experts. None (auto): where it can
    # run; True: required (an error where it cannot); False: the router's own kernel
    moe_router: bool | None = None
    # the layer's shared expert inside the same persistent MoE kernel (with the router there): no shared
    # gate_up and down launches. True: required (an error where it cannot run); None (auto) and False: its
    # own kernels (the fused variant measured slower on the H200: docs/performance.md)
    moe_shared: bool | None = None

    def __post_init__(self) -> None:
        if self.decode_step not in DECODE_STEPS:
            raise ValueError(f"unknown decode step {self.decode_step!r}; choose one of {', '.join(DECODE_STEPS)}")
        lm_head_modes.validate_mode(self.lm_head)
        if self.block_fp8 not in BLOCK_FP8_MODES:
            raise ValueError(f"unknown block_fp8 mode {self.block_fp8!r}; choose one of {', '.join(BLOCK_FP8_MODES)}")
        backend_spec(self.moe_backend)  # an unknown backend is an error naming the known ones
        if self.step_kernels not in STEP_KERNELS:
            raise ValueError(f"unknown step kernels {self.step_kernels!r}; choose one of {', '.join(STEP_KERNELS)}")
        if not 1 <= self.step_kernel_tokens <= 8:
            raise ValueError(
                f"step_kernel_tokens must be 1..8 (the CUDA step kernels' widest call), not {self.step_kernel_tokens}"
            )


def accelerate(model: LingForCausalLM, options: FastPathOptions | None = None) -> LingForCausalLM:
    """Install the fast path on `model` in place (see the module docstring) and return it."""
    options = options or FastPathOptions()
    _install_block_fp8(model, options.block_fp8)
    _install_moe_backends(model, options)
    model.lm_head = lm_head_modes.build(model.lm_head, options.lm_head)
    _install_decode_step(model, options)
    model.fast_path = options
    return model


def _install_decode_step(model: LingForCausalLM, options: FastPathOptions) -> None:
    """The fused decode step where asked (and possible); `model.decode_step_note` says why not under auto."""
    model.decode_step = None
    model.decode_step_note = "reference decode step requested"
    if options.decode_step == "reference":
        if options.pdl:
            raise DecodeStepUnavailable(
                "--pdl on launches the fused decode step's kernels; drop --decode-step reference or --pdl on"
            )
        if options.step_kernels == "cuda":
            raise DecodeStepUnavailable(
                "--step-kernels cuda runs kernels of the fused decode step; drop --decode-step reference or "
                "--step-kernels cuda"
            )
        if options.moe_router:
            raise DecodeStepUnavailable(
                "--moe-router fused runs inside the fused decode step; drop --decode-step reference or "
                "--moe-router fused"
            )
        if options.moe_shared:
            raise DecodeStepUnavailable(
                "--moe-shared fused runs inside the fused decode step; drop --decode-step reference or "
                "--moe-shared fused"
            )
        return
    from solo.fastpath.availability import fused_step_unavailable

    reason = fused_step_unavailable(model, allow_interpreter=options.decode_step == "fused")
    if reason is None:
        from solo.fastpath.decode_step import FusedDecodeStep

        pdl = options.pdl if options.pdl is not None else auto_pdl(model.device, options.step_kernels)
        try:
            model.decode_step = FusedDecodeStep(
                model,
                token_counts=(1, options.verify_tokens),
                pdl=pdl,
                kernels=options.step_kernels,
                cuda_tokens=options.step_kernel_tokens,
                pdl_verify=options.pdl_verify,
                moe_router=options.moe_router,
                moe_shared=options.moe_shared,
            )
            model.decode_step.warmup()
            model.decode_step_note = ""
            return
        except (PDLUnavailable, StepKernelsUnavailable):  # the step could run, these cannot: said as they are
            raise
        except DecodeStepUnavailable as e:
            reason = str(e)
    if options.pdl:
        raise DecodeStepUnavailable(f"--pdl on needs the fused decode step, which cannot run: {reason}. Use --pdl off.")
    if options.step_kernels == "cuda":
        raise DecodeStepUnavailable(
            f"--step-kernels cuda needs the fused decode step, which cannot run: {reason}. Use --step-kernels auto."
        )
    if options.moe_router:
        raise DecodeStepUnavailable(
            f"--moe-router fused needs the fused decode step, which cannot run: {reason}. Use --moe-router auto."
        )
    if options.moe_shared:
        raise DecodeStepUnavailable(
            f"--moe-shared fused needs the fused decode step, which cannot run: {reason}. Use --moe-shared auto."
        )
    if options.decode_step == "fused":
        raise DecodeStepUnavailable(f"--decode-step fused: {reason}. Use --decode-step reference.")
    model.decode_step_note = reason


def auto_pdl(device: torch.device, step_kernels: str) -> bool:
    """--pdl auto: on with the CUDA step kernels on a GPU that runs both (the one-token kernels load their
    first weights before waiting for the previous kernel; H200: decode 2.71 -> 2.53 ms at full shape)."""
    if step_kernels == "triton":
        return False
    from solo.kernels.cuda_step import cuda_step_unavailable
    from solo.kernels.pdl import pdl_unavailable

    return cuda_step_unavailable(device) is None and pdl_unavailable(device) is None


def load_accelerated(
    path: str | Path,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
    progress: bool | None = None,
    tp: Any = None,
    **fast_path: Any,
) -> LingForCausalLM:
    """`load_model` then `accelerate`: the model `Engine.from_pretrained` runs, without the engine
    (`fast_path`: the fields of FastPathOptions; `tp`: a tensor-parallel rank loads its shard). Bad
    options fail before the (long) load."""
    options = FastPathOptions(**fast_path)
    return accelerate(load_model(path, LoadOptions(device, dtype, progress, tp)), options)


def keep_block_fp8(linear: Linear, mode: str, device: torch.device) -> bool:
    """Whether a block-FP8 layer keeps its FP8 weights (else it is dequantized)."""
    if mode == "on":
        return True
    if mode == "auto" and device.type == "cuda":
        from solo.kernels.triton_fp8 import BLOCK_FP8_MIN_K

        return linear.in_features >= BLOCK_FP8_MIN_K
    return False


def _install_block_fp8(model: LingForCausalLM, mode: str) -> None:
    device = model.device
    if mode == "on" and model.fp8_block_size not in (None, FP8_BLOCK):
        raise CheckpointError(
            f"--block-fp8 on: the checkpoint's FP8 blocks are {model.fp8_block_size}, the kernel runs 128x128 "
            "blocks. Load it with --block-fp8 off (weights dequantized to the compute dtype)."
        )
    kernel = reference_fp8_block_linear
    if device.type == "cuda":
        from solo.kernels.triton_fp8 import fp8_block_linear

        kernel = fp8_block_linear
    for linear in block_fp8_linears(model):
        if keep_block_fp8(linear, mode, device):
            linear.kernel = kernel
        else:
            linear.use_dense(linear.dense_weight(model.dtype))
    kept = block_fp8_linears(model)
    if kept and device.type == "cuda":  # compile (or load from the disk cache) every shape now
        from solo.kernels.triton_fp8 import compile_for_shapes

        compile_for_shapes(block=sorted({(m.out_features, m.in_features) for m in kept}), device=device)


def _install_moe_backends(model: LingForCausalLM, options: FastPathOptions) -> None:
    config = model.config
    for module in model.modules():
        if not isinstance(module, SparseMoE) or module.experts is None:
            continue
        if module.experts.name == options.moe_backend:
            continue
        source = getattr(module.experts, "source", None)
        if source is None:
            raise ValueError(
                f"the MoE layers already run '{module.experts.name}'; accelerate() builds backends from the "
                "reference model as loaded (load the checkpoint again)."
            )
        module.experts = make_moe_backend(
            options.moe_backend,
            source,
            model.dtype,
            module.swiglu_limit,
            top_k=config.num_experts_per_tok,
            max_tokens=options.max_tokens,
        )

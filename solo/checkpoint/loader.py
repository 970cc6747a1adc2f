"""Builds a LingForCausalLM from a checkpoint folder: config, weights, experts, LM head.

Every tensor the model needs must be present with the right shape, and every tensor in the
checkpoint must be used; anything else is an error naming the tensor. Quantized tensors
(block-FP8 layers, MXFP4 experts) are recognised by their dtype and `weight_scale_inv` companions.
"""

from __future__ import annotations

import re
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from tqdm import tqdm

from solo.checkpoint.reader import CheckpointError, CheckpointReader
from solo.config import LingConfig
from solo.kernels.moe import DenseExperts, MXFP4Experts
from solo.kernels.registry import make_moe_backend
from solo.model.layers import Linear, RotaryEmbedding, block_fp8_linears
from solo.model.ling import LingForCausalLM
from solo.model.moe import SparseMoE
from solo.quantization import formats
from solo.quantization import lm_head as lm_head_modes
from solo.quantization.scheme import QuantScheme

# Parameters kept in fp32 whatever the compute dtype: small, and precision-sensitive.
FP32_PARAMS = re.compile(r"(A_log|dt_bias|_conv1d\.weight|expert_bias)$")
ALIASES = {"expert_bias": "e_score_correction_bias"}
PROGRESS_MIN_BYTES = 1 << 30
QUANTIZED_DTYPES = (torch.float8_e4m3fn, torch.uint8, torch.int8)


@dataclass
class LoadOptions:
    device: str | torch.device = "cpu"
    dtype: torch.dtype = torch.float32
    moe_backend: str = "torch"
    lm_head: str = "bf16"
    # block-FP8 linears: "on" keeps them in FP8, "auto" only on a GPU and where the FP8 kernel is faster
    # (K >= BLOCK_FP8_MIN_K), "off" dequantizes them all at load
    block_fp8: str = "auto"
    progress: bool | None = None  # None: show a bar for checkpoints over 1 GiB


def load_model(path: str | Path, options: LoadOptions | None = None) -> LingForCausalLM:
    options = options or LoadOptions()
    path = Path(path)
    config = LingConfig.from_file(path)
    reader = CheckpointReader(path)
    scheme = QuantScheme.from_config(config.quantization_config)
    _detect_nextn(config, reader)
    lm_head_modes.validate_mode(options.lm_head)
    if options.block_fp8 not in BLOCK_FP8_MODES:
        raise ValueError(f"unknown block_fp8 mode {options.block_fp8!r}; choose one of {', '.join(BLOCK_FP8_MODES)}")

    with torch.device("meta"):
        model = LingForCausalLM(config)
    model.rotary = RotaryEmbedding(config)  # computed, not loaded: build it on a real device
    used: set[str] = set()
    show = options.progress if options.progress is not None else reader.nbytes() >= PROGRESS_MIN_BYTES
    named = list(_loadable_modules(model))
    bar = tqdm(total=len(named), desc="loading", unit="module", disable=not show, file=sys.stderr)
    for prefix, module in named:
        if isinstance(module, SparseMoE):
            _load_experts(module, prefix, config, reader, scheme, options, used)
        elif isinstance(module, Linear):
            _load_linear(module, prefix, reader, scheme, options, used, config.tie_word_embeddings)
        else:
            _load_plain(module, prefix, reader, options, used)
        bar.update(1)
    bar.close()

    unexpected = sorted(reader.names - used)
    if unexpected:
        more = f" (and {len(unexpected) - 5} more)" if len(unexpected) > 5 else ""
        raise CheckpointError(
            f"{path}: unexpected tensors {unexpected[:5]}{more}: the checkpoint does not match its "
            "config.json (wrong num_hidden_layers, expert count or layer pattern?)."
        )
    model.rotary.to(options.device)
    model.lm_head = lm_head_modes.build(model.lm_head, options.lm_head)
    model.finalize()
    _warm_block_fp8(model)
    return model.eval()


def _detect_nextn(config: LingConfig, reader: CheckpointReader) -> None:
    """The NEXTN layer is optional: a config may announce it while the weights are absent
    (transformers writes none). Then the model is loaded without it."""
    prefix = f"model.layers.{config.num_hidden_layers}."
    if config.has_nextn and not any(n.startswith(prefix) for n in reader.names):
        config.num_nextn_predict_layers = 0


def _loadable_modules(model: nn.Module):
    """Leaf modules that own checkpoint tensors; SparseMoE counts as one (it owns the experts)."""

    def visit(prefix: str, module: nn.Module):
        if isinstance(module, (SparseMoE, Linear)) or not list(module.children()):
            yield prefix, module
            if isinstance(module, SparseMoE):
                yield from visit(f"{prefix}.gate", module.gate)
                if module.shared_experts is not None:
                    yield from visit(f"{prefix}.shared_experts", module.shared_experts)
            return
        if module._parameters:
            yield prefix, _OwnParams(module)
        for name, child in module.named_children():
            yield from visit(f"{prefix}.{name}" if prefix else name, child)

    yield from visit("", model)


class _OwnParams(nn.Module):
    """View of a non-leaf module's direct parameters (e.g. KDA's A_log and dt_bias)."""

    def __init__(self, owner: nn.Module) -> None:
        super().__init__()
        object.__setattr__(self, "owner", owner)


def _checkpoint_name(reader: CheckpointReader, name: str) -> str:
    if name in reader:
        return name
    for ours, theirs in ALIASES.items():
        if name.endswith(ours):
            alt = name[: -len(ours)] + theirs
            if alt in reader:
                return alt
    return name


def _fetch(reader: CheckpointReader, name: str, shape: tuple[int, ...], used: set[str]) -> torch.Tensor:
    key = _checkpoint_name(reader, name)
    if key not in reader:
        raise CheckpointError(f"{reader.directory}: tensor '{name}' is missing from the checkpoint.")
    found = reader.shape(key)
    if tuple(found) != tuple(shape):
        raise CheckpointError(
            f"{reader.directory}: tensor '{key}' has shape {list(found)}, expected {list(shape)} "
            "from config.json. The checkpoint and its config do not match."
        )
    used.add(key)
    tensor = reader.get(key)
    if tensor.dtype in QUANTIZED_DTYPES:
        raise CheckpointError(
            f"{reader.directory}: tensor '{key}' is {str(tensor.dtype).removeprefix('torch.')} but its scale "
            f"tensor '{key.removesuffix('.weight')}.weight_scale_inv' is missing. Re-export the checkpoint "
            "with `solo quantize`."
        )
    return tensor


def _param_dtype(name: str, options: LoadOptions) -> torch.dtype:
    return torch.float32 if FP32_PARAMS.search(name) else options.dtype


def _load_plain(module: nn.Module, prefix: str, reader, options: LoadOptions, used: set[str]) -> None:
    owner = module.owner if isinstance(module, _OwnParams) else module
    for pname, param in list(owner._parameters.items()):
        if param is None:
            continue
        name = f"{prefix}.{pname}"
        tensor = _fetch(reader, name, tuple(param.shape), used)
        tensor = tensor.to(device=options.device, dtype=_param_dtype(name, options))
        owner._parameters[pname] = nn.Parameter(tensor, requires_grad=False)


def _load_linear(
    module: Linear, prefix: str, reader, scheme: QuantScheme, options, used, tied_head: bool = False
) -> None:
    name = f"{prefix}.weight"
    shape = (module.out_features, module.in_features)
    if f"{prefix}.weight_scale_inv" in reader and prefix != "lm_head" and _keep_fp8(module, options, scheme):
        weight, scale = scheme.load_fp8_block_raw(reader, prefix, shape, used)
        device = torch.device(options.device)
        module.use_block_fp8(weight.to(device), scale.to(device), _block_fp8_kernel(scheme, device))
        return
    if f"{prefix}.weight_scale_inv" in reader:
        weight = scheme.load_fp8_block(reader, prefix, shape, used)
    elif prefix == "lm_head" and name not in reader and tied_head:
        weight = _fetch(reader, "model.word_embeddings.weight", shape, used)
    else:
        weight = _fetch(reader, name, shape, used)
    # The head keeps full precision until lm_head.build() turns it into the requested mode.
    dtype = torch.float32 if prefix == "lm_head" else options.dtype
    module.weight = nn.Parameter(weight.to(device=options.device, dtype=dtype), requires_grad=False)


BLOCK_FP8_MODES = ("off", "auto", "on")


def _keep_fp8(module: Linear, options: LoadOptions, scheme: QuantScheme) -> bool:
    """Whether this block-FP8 layer keeps its FP8 weights (else it is dequantized at load)."""
    if options.block_fp8 == "on":
        return True  # (_block_fp8_kernel refuses block sizes the kernel cannot run)
    if options.block_fp8 == "auto" and scheme.block_size == (128, 128) and torch.device(options.device).type == "cuda":
        from solo.kernels.triton_fp8 import BLOCK_FP8_MIN_K

        return module.in_features >= BLOCK_FP8_MIN_K
    return False


def _block_fp8_kernel(scheme: QuantScheme, device: torch.device):
    """The GPU path multiplies with the Triton block-FP8 GEMV; the CPU reference dequantizes per call."""
    if scheme.block_size != (128, 128):
        raise CheckpointError(
            f"--block-fp8 on: the checkpoint's FP8 blocks are {scheme.block_size}, the kernel runs 128x128 "
            "blocks. Load it with --block-fp8 off (weights dequantized to the compute dtype)."
        )
    if device.type == "cuda":
        from solo.kernels.triton_fp8 import fp8_block_linear

        return fp8_block_linear
    return reference_fp8_block_linear


def reference_fp8_block_linear(x: torch.Tensor, weight: torch.Tensor, scale_inv: torch.Tensor) -> torch.Tensor:
    return F.linear(x, formats.dequantize_fp8_block(weight, scale_inv, (128, 128), x.dtype))


def _warm_block_fp8(model: nn.Module) -> None:
    """Compile (or load from the disk cache) the block-FP8 kernel for every shape the model uses."""
    fp8 = block_fp8_linears(model)
    if fp8 and fp8[0].weight.is_cuda:
        from solo.kernels.triton_fp8 import compile_for_shapes

        compile_for_shapes(block=sorted({(m.out_features, m.in_features) for m in fp8}), device=fp8[0].weight.device)


def _load_experts(
    module: SparseMoE, prefix: str, config: LingConfig, reader, scheme: QuantScheme, options, used
) -> None:
    hidden, inter, count = config.hidden_size, config.moe_intermediate_size, config.num_experts
    first = f"{prefix}.experts.0.gate_proj"
    if f"{first}.weight_scale_inv" in reader:
        experts: MXFP4Experts | DenseExperts = scheme.load_mxfp4_experts(
            reader, f"{prefix}.experts", count, hidden, inter, used
        )
        experts = MXFP4Experts(
            *(t.to(options.device) for t in (experts.gate_up, experts.gate_up_scale, experts.down, experts.down_scale))
        )
    else:
        gate_up, down = [], []
        for e in range(count):
            base = f"{prefix}.experts.{e}"
            gate = _fetch(reader, f"{base}.gate_proj.weight", (inter, hidden), used)
            up = _fetch(reader, f"{base}.up_proj.weight", (inter, hidden), used)
            gate_up.append(torch.cat([gate, up]).to(options.dtype))
            down.append(_fetch(reader, f"{base}.down_proj.weight", (hidden, inter), used).to(options.dtype))
        experts = DenseExperts(torch.stack(gate_up).to(options.device), torch.stack(down).to(options.device))
    module.experts = make_moe_backend(
        options.moe_backend, experts, options.dtype, module.swiglu_limit, top_k=config.num_experts_per_tok
    )

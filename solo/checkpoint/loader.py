"""Reads a checkpoint folder into the reference model: config, weights, experts, LM head.

Every tensor the model needs must be present with the right shape, and every tensor in the
checkpoint must be used; anything else is an error naming the tensor. Quantized tensors
(block-FP8 layers, MXFP4 experts) are recognised by their dtype and `weight_scale_inv` companions
and kept as stored: block-FP8 layers as FP8 weights with their 128x128 block scales (multiplied by
the reference kernel, which dequantizes per call), MXFP4 experts packed, behind the PyTorch
reference backend; the LM head in fp32. That is the CPU reference and the oracle.

Under tensor parallelism (`LoadOptions.tp`) the same loader reads one rank's shard: the model is
built at the rank's shapes and the reader wrapped, in one step, in the rank's view of the checkpoint
(solo.checkpoint.shard.ShardedReader: split tensors read as slices, experts renumbered), so each
rank reads only its part of the files.

Nothing here chooses kernels: `solo.fastpath.accelerate` turns the loaded model into the fast
path (MoE backend, block-FP8 kernels, LM-head mode, warm-ups) in one explicit step.
"""

from __future__ import annotations

import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from tqdm import tqdm

from solo.checkpoint.reader import CheckpointError, CheckpointReader
from solo.checkpoint.shard import ShardedReader
from solo.config import LingConfig
from solo.distributed.parallel import TensorParallel
from solo.kernels.moe import DenseExperts, MXFP4Experts, TorchMoE
from solo.model.layers import Linear, RotaryEmbedding
from solo.model.ling import LingForCausalLM
from solo.model.moe import SparseMoE
from solo.quantization import formats
from solo.quantization.lm_head import DenseHead
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
    progress: bool | None = None  # None: show a bar for checkpoints over 1 GiB
    tp: TensorParallel | None = None  # a tensor-parallel rank: load its shard (None: the whole model)


def load_model(path: str | Path, options: LoadOptions | None = None) -> LingForCausalLM:
    """The reference model of the checkpoint folder `path` (config.json, safetensors files). Under
    tensor parallelism every rank loads its shard and the ranks agree on the outcome: if one fails
    (a shape that does not divide, a tensor of its shard missing) all raise, naming it."""
    path = Path(path)
    tp = options.tp if options is not None else None
    model, error = None, None
    try:
        config = LingConfig.from_file(path)
        model = build_model(config, CheckpointReader(path), options)
    except Exception as e:  # re-raised below, on every rank
        if tp is None or not tp.enabled:
            raise
        error = e
    if tp is not None and tp.enabled:
        tp.agree(error, "loading the checkpoint")
    assert model is not None
    return model


def build_model(config: LingConfig, reader: Any, options: LoadOptions | None = None) -> LingForCausalLM:
    """The reference model of `config` with its tensors from `reader` (a CheckpointReader, or any
    source with its interface: names, shape, get, nbytes, directory; e.g. a RandomCheckpoint)."""
    options = options or LoadOptions()
    scheme = QuantScheme.from_config(config.quantization_config)
    _detect_nextn(config, reader)

    with torch.device("meta"):
        model = LingForCausalLM(config, options.tp)
    if model.tp.enabled:  # the one step from the whole checkpoint to this rank's shard of it
        reader = ShardedReader(reader, config, model.shard, scheme.block_size)
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
            f"{reader.directory}: unexpected tensors {unexpected[:5]}{more}: the checkpoint does not match its "
            "config.json (wrong num_hidden_layers, expert count or layer pattern?)."
        )
    model.rotary.to(options.device)
    model.lm_head = DenseHead(model.lm_head.weight.data, "fp32")  # the checkpoint's head, product in fp32
    model.split_dequantized = list(getattr(reader, "dequantized", []))
    if model.tp.enabled:
        from solo.distributed.layers import VocabParallelHead

        model.lm_head = VocabParallelHead(model.lm_head, model.tp, model.shard.vocab_span(config), config.vocab_size)
    model.fp8_block_size = scheme.block_size
    model.finalize()
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
    device = torch.device(options.device)
    if f"{prefix}.weight_scale_inv" in reader and scheme.block_size == FP8_BLOCK:
        weight, scale = scheme.load_fp8_block_raw(reader, prefix, shape, used)
        module.use_block_fp8(weight.to(device), scale.to(device), reference_fp8_block_linear)
        return
    if f"{prefix}.weight_scale_inv" in reader:  # other block sizes: no FP8 kernel runs them, keep them dense
        weight = scheme.load_fp8_block(reader, prefix, shape, used)
    elif prefix == "lm_head" and name not in reader and tied_head:
        weight = _fetch(reader, "model.word_embeddings.weight", shape, used)
    else:
        weight = _fetch(reader, name, shape, used)
    # The head keeps full precision until the fast path turns it into the requested mode.
    dtype = torch.float32 if prefix == "lm_head" else options.dtype
    module.weight = nn.Parameter(weight.to(device=device, dtype=dtype), requires_grad=False)


FP8_BLOCK = (128, 128)  # the block size of the FP8 kernels (and of Ling-3.0-flash-fp4)


def reference_fp8_block_linear(x: torch.Tensor, weight: torch.Tensor, scale_inv: torch.Tensor) -> torch.Tensor:
    """The reference block-FP8 product: dequantize, then a dense product in the activation dtype."""
    return F.linear(x, formats.dequantize_fp8_block(weight, scale_inv, FP8_BLOCK, x.dtype))


def _load_experts(
    module: SparseMoE, prefix: str, config: LingConfig, reader, scheme: QuantScheme, options, used
) -> None:
    # this rank's experts (all of them in one process) and their intermediate width
    hidden, inter, count = config.hidden_size, module.expert_intermediate, module.num_local_experts
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
    module.experts = TorchMoE(experts, options.dtype, module.swiglu_limit)

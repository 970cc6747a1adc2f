"""`solo quantize IN_DIR OUT_DIR`: a BF16/FP32 Ling-3.0 checkpoint -> the Ling-3.0-flash-fp4 format.

Routed experts -> MXFP4 (`weight` uint8 [N, K/2] + `weight_scale_inv` uint8 E8M0 [N, K/32]);
linear layers of attention, dense MLPs, shared experts and NEXTN's eh_proj -> FP8 E4M3 with one
ue8m0 scale per 128x128 block (`weight_scale_inv` fp32); embeddings, LM head, router, norms,
convolutions and gate parameters are copied unchanged. Reports per-tensor error statistics.
"""

from __future__ import annotations

import json
import re
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file

from solo.checkpoint.reader import CheckpointError, CheckpointReader
from solo.config import LingConfig
from solo.quantization import formats
from solo.quantization.scheme import QuantScheme

EXPERT = re.compile(r"\.mlp\.experts\.\d+\.(gate|up|down)_proj\.weight$")
FP8_LINEAR = re.compile(
    r"(\.attention\.([a-z_]*proj[a-z_]*|dense)|\.mlp\.(gate|up|down)_proj|\.mlp\.shared_experts\.(gate|up|down)_proj"
    r"|\.eh_proj)\.weight$"
)
SCHEME = QuantScheme(block_size=(128, 128), scale_fmt="ue8m0", experts_mxfp4=True)
SHARD_BYTES = 2 << 30


@dataclass
class TensorError:
    name: str
    fmt: str
    rel_rms: float  # ||w - deq(q(w))|| / ||w||
    max_abs: float

    def line(self) -> str:
        return f"{self.fmt:<6} rel.rms {self.rel_rms:.3e}  max|err| {self.max_abs:.3e}  {self.name}"


def classify(name: str) -> str:
    """'mxfp4', 'fp8' or 'keep' for one checkpoint tensor name."""
    if EXPERT.search(name):
        return "mxfp4"
    if FP8_LINEAR.search(name):
        return "fp8"
    return "keep"


def _error(name: str, fmt: str, w: torch.Tensor, deq: torch.Tensor) -> TensorError:
    diff = (w - deq).float()
    norm = float(w.float().norm()) or 1.0
    return TensorError(name, fmt, float(diff.norm()) / norm, float(diff.abs().max()))


def quantize_tensor(name: str, w: torch.Tensor) -> tuple[dict[str, torch.Tensor], TensorError | None]:
    fmt = classify(name)
    if fmt == "keep":
        return {name: w}, None
    wf = w.float()
    base = name[: -len(".weight")]
    if fmt == "mxfp4":
        if wf.shape[-1] % formats.MXFP4_BLOCK:
            raise CheckpointError(
                f"{name}: input dimension {wf.shape[-1]} is not a multiple of 32; MXFP4 cannot store it."
            )
        packed, scales = formats.quantize_mxfp4(wf)
        deq = formats.dequantize_mxfp4(packed, scales)
        return {f"{base}.weight": packed, f"{base}.weight_scale_inv": scales}, _error(name, fmt, wf, deq)
    w8, scale_inv = formats.quantize_fp8_block(wf, SCHEME.block_size, SCHEME.scale_fmt)
    deq = formats.dequantize_fp8_block(w8, scale_inv, SCHEME.block_size)
    return {f"{base}.weight": w8, f"{base}.weight_scale_inv": scale_inv}, _error(name, fmt, wf, deq)


def quantize_checkpoint(in_dir: str | Path, out_dir: str | Path, verbose: bool = True) -> list[TensorError]:
    in_dir, out_dir = Path(in_dir), Path(out_dir)
    config = LingConfig.from_file(in_dir)
    if config.quantization_config:
        raise CheckpointError(f"{in_dir}: already quantized (config.json has quantization_config).")
    reader = CheckpointReader(in_dir)
    if in_dir.resolve() == out_dir.resolve():
        raise CheckpointError("OUT_DIR must differ from IN_DIR.")
    out_dir.mkdir(parents=True, exist_ok=True)
    errors: list[TensorError] = []
    shard: dict[str, torch.Tensor] = {}
    shards: list[dict[str, torch.Tensor]] = [shard]
    size = 0
    for name in sorted(reader.names):
        tensors, err = quantize_tensor(name, reader.get(name))
        if err is not None:
            errors.append(err)
            if verbose:
                print(err.line(), file=sys.stderr)
        for key, t in tensors.items():
            if size and size + t.nbytes > SHARD_BYTES:
                shard, size = {}, 0
                shards.append(shard)
            shard[key] = t.contiguous()
            size += t.nbytes
    weight_map = {}
    for i, tensors in enumerate(shards):
        file = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(tensors, str(out_dir / file), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(tensors, file))
    index = {"metadata": {}, "weight_map": weight_map}
    (out_dir / "model.safetensors.index.json").write_text(json.dumps(index, indent=1))
    raw = json.loads((in_dir / "config.json").read_text())
    raw["quantization_config"] = SCHEME.to_config()
    (out_dir / "config.json").write_text(json.dumps(raw, indent=2))
    for extra in in_dir.iterdir():
        if extra.suffix in (".json", ".txt", ".md", ".model", ".jinja") and not extra.name.startswith(
            ("config.json", "model.safetensors")
        ):
            shutil.copy2(extra, out_dir / extra.name)
    if verbose:
        _summary(errors)
    return errors


def _summary(errors: list[TensorError]) -> None:
    for fmt in ("mxfp4", "fp8"):
        sel = [e for e in errors if e.fmt == fmt]
        if sel:
            worst = max(sel, key=lambda e: e.rel_rms)
            mean = sum(e.rel_rms for e in sel) / len(sel)
            print(
                f"{fmt}: {len(sel)} tensors, mean rel.rms {mean:.3e}, worst {worst.rel_rms:.3e} ({worst.name})",
                file=sys.stderr,
            )

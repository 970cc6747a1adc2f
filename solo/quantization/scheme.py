"""The checkpoint's `quantization_config` and loading of its quantized tensors.

Ling-3.0-flash-fp4: `{"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128],
"scale_fmt": "ue8m0", "routed_experts_quant_method": "mxfp4", "routed_experts_group_size": 32}`:
attention/shared/dense linears in FP8 E4M3 with one scale per 128x128 block, routed experts in
MXFP4, both with their scales stored as `<name>.weight_scale_inv`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from solo.checkpoint.reader import CheckpointError, CheckpointReader
from solo.kernels.moe import MXFP4Experts
from solo.quantization import formats


@dataclass(frozen=True)
class QuantScheme:
    block_size: tuple[int, int] | None = None  # None: no block-FP8 layers
    scale_fmt: str | None = None
    experts_mxfp4: bool = False

    @classmethod
    def from_config(cls, qc: dict[str, Any] | None) -> QuantScheme:
        if not qc:
            return cls()

        def bad(field: str, why: str) -> CheckpointError:
            return CheckpointError(f"config.json: quantization_config.{field} {why}")

        method = qc.get("quant_method")
        if method != "fp8":
            raise bad("quant_method", f"is {method!r}; solo loads only 'fp8' (the Ling-3.0-flash-fp4 format).")
        if qc.get("fmt", "e4m3") != "e4m3":
            raise bad("fmt", f"is {qc.get('fmt')!r}; only 'e4m3' is supported.")
        block = qc.get("weight_block_size")
        if not (isinstance(block, list) and len(block) == 2 and all(isinstance(b, int) and b > 0 for b in block)):
            raise bad("weight_block_size", f"is {block!r}; expected two positive integers like [128, 128].")
        scale_fmt = qc.get("scale_fmt")
        if scale_fmt not in (None, "ue8m0"):
            raise bad("scale_fmt", f"is {scale_fmt!r}; expected 'ue8m0' or absent.")
        experts = qc.get("routed_experts_quant_method")
        if experts not in (None, "mxfp4"):
            raise bad("routed_experts_quant_method", f"is {experts!r}; only 'mxfp4' is supported.")
        group = qc.get("routed_experts_group_size", 32)
        if experts == "mxfp4" and group != 32:
            raise bad("routed_experts_group_size", f"is {group!r}; MXFP4 uses groups of 32.")
        return cls(block_size=(block[0], block[1]), scale_fmt=scale_fmt, experts_mxfp4=experts == "mxfp4")

    def to_config(self) -> dict[str, Any]:
        assert self.block_size is not None
        qc: dict[str, Any] = {
            "quant_method": "fp8",
            "fmt": "e4m3",
            "activation_scheme": "dynamic",
            "weight_block_size": list(self.block_size),
            "scale_fmt": self.scale_fmt,
        }
        if self.experts_mxfp4:
            qc["routed_experts_quant_method"] = "mxfp4"
            qc["routed_experts_group_size"] = 32
        return qc

    # ------------------------------------------------------------------ loading
    def load_fp8_block(
        self, reader: CheckpointReader, prefix: str, shape: tuple[int, int], used: set[str]
    ) -> torch.Tensor:
        """A block-FP8 linear weight, dequantized to fp32 (the CPU reference computes densely)."""
        weight, scale = self.load_fp8_block_raw(reader, prefix, shape, used)
        return formats.dequantize_fp8_block(weight, scale, self.block_size, torch.float32)

    def load_fp8_block_raw(
        self, reader: CheckpointReader, prefix: str, shape: tuple[int, int], used: set[str]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """A block-FP8 linear weight as stored: (float8_e4m3fn [N, K], fp32 scale_inv per block), checked."""
        if self.block_size is None:
            raise CheckpointError(
                f"{reader.directory}: '{prefix}.weight_scale_inv' is present but config.json has no "
                "quantization_config; the config does not describe this quantized checkpoint."
            )
        weight, scale = _quantized_pair(reader, prefix, used)
        if weight.dtype != torch.float8_e4m3fn:
            raise CheckpointError(
                f"{reader.directory}: '{prefix}.weight' is {weight.dtype}, expected float8_e4m3fn "
                "for a block-FP8 layer (quantization_config.quant_method = 'fp8')."
            )
        if tuple(weight.shape) != tuple(shape):
            raise CheckpointError(
                f"{reader.directory}: '{prefix}.weight' has shape {list(weight.shape)}, expected {list(shape)}."
            )
        try:
            formats.check_fp8_block_shapes(f"{prefix}.weight_scale_inv", weight, scale, self.block_size)
        except ValueError as e:
            raise CheckpointError(f"{reader.directory}: {e}") from e
        return weight, scale.float()

    def load_mxfp4_experts(
        self, reader: CheckpointReader, prefix: str, count: int, hidden: int, inter: int, used: set[str]
    ) -> MXFP4Experts:
        """All routed experts of one layer as stacked MXFP4 tensors (gate rows then up rows)."""
        if not self.experts_mxfp4:
            raise CheckpointError(
                f"{reader.directory}: '{prefix}.0.gate_proj.weight_scale_inv' is present but "
                "quantization_config.routed_experts_quant_method is not 'mxfp4'."
            )
        gate_up, gate_up_scale, down, down_scale = [], [], [], []
        for e in range(count):
            rows = []
            for proj, (n, k) in (
                ("gate_proj", (inter, hidden)),
                ("up_proj", (inter, hidden)),
                ("down_proj", (hidden, inter)),
            ):
                name = f"{prefix}.{e}.{proj}"
                packed, scale = _quantized_pair(reader, name, used)
                if packed.dtype != torch.uint8 or tuple(packed.shape) != (n, k // 2):
                    raise CheckpointError(
                        f"{reader.directory}: '{name}.weight' is {packed.dtype} {list(packed.shape)}; an "
                        f"MXFP4 expert weight of logical shape [{n}, {k}] is uint8 [{n}, {k // 2}]."
                    )
                try:
                    formats.check_mxfp4_shapes(f"{name}.weight_scale_inv", packed, scale)
                except ValueError as e:
                    raise CheckpointError(f"{reader.directory}: {e}") from e
                rows.append((packed, scale.view(torch.uint8) if scale.dtype != torch.uint8 else scale))
            gate_up.append(torch.cat([rows[0][0], rows[1][0]]))
            gate_up_scale.append(torch.cat([rows[0][1], rows[1][1]]))
            down.append(rows[2][0])
            down_scale.append(rows[2][1])
        return MXFP4Experts(
            torch.stack(gate_up), torch.stack(gate_up_scale), torch.stack(down), torch.stack(down_scale)
        )


def _quantized_pair(reader: CheckpointReader, prefix: str, used: set[str]) -> tuple[torch.Tensor, torch.Tensor]:
    for suffix in ("weight", "weight_scale_inv"):
        if f"{prefix}.{suffix}" not in reader:
            raise CheckpointError(
                f"{reader.directory}: tensor '{prefix}.{suffix}' is missing; a quantized layer needs "
                "both its weight and its weight_scale_inv. Re-export the checkpoint with `solo quantize`."
            )
    used.update({f"{prefix}.weight", f"{prefix}.weight_scale_inv"})
    return reader.get(f"{prefix}.weight"), reader.get(f"{prefix}.weight_scale_inv")

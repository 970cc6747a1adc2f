"""Random checkpoints at real shapes, generated where the model will run, read through the real loader.

`solo bench decode --random-weights ling-3.0-flash` measures the whole model at the published
Ling-3.0-flash shape without its 65 GB checkpoint: `RandomCheckpoint` answers the loader's questions
(names, shapes, tensors) exactly as a safetensors folder in the fp4 format would (`solo quantize`'s
naming and formats: MXFP4 experts, block-FP8 linears, the rest BF16), generating each tensor on the
target device on demand. Values are random but scaled like a trained model's (projections keep the
activation scale, E8M0 scales near 2^-7), so the activations stay finite through all layers and
the routing spreads over the experts. Timings do not depend on the values; correctness tests at
full width use the same generator with fewer layers and experts.
"""

from __future__ import annotations

import math
import zlib
from pathlib import Path
from typing import Any

import torch

from solo.config import LingConfig
from solo.quantization import formats
from solo.quantization.convert import SCHEME, classify

# The published Ling-3.0-flash configuration (config.json of inclusionAI/Ling-3.0-flash-fp4, in the
# checkpoint's own spelling; the same values as transformers 5.23's BailingHybridConfig defaults).
# The per-layer SwiGLU clamps are present as in the published config's structure; their values here
# are representative (they change what is computed, not what it costs).
LING_3_FLASH: dict[str, Any] = {
    "architectures": ["BailingMoeV3ForCausalLM"],
    "model_type": "bailing_hybrid",
    "vocab_size": 157184,
    "hidden_size": 2560,
    "intermediate_size": 6144,
    "moe_intermediate_size": 768,
    "num_hidden_layers": 42,
    "num_attention_heads": 32,
    "num_key_value_heads": 32,
    "head_dim": 128,
    "linear_num_heads": 32,
    "linear_head_dim": 128,
    "layer_group_size": 6,
    "first_k_dense_replace": 2,
    "num_experts": 512,
    "num_experts_per_tok": 8,
    "n_group": 8,
    "topk_group": 4,
    "n_shared_experts": 1,
    "norm_topk_prob": True,
    "routed_scaling_factor": 2.5,
    "kv_lora_rank": 512,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
    "conv_kernel_size": 4,
    "kda_safe_gate": True,
    "kda_lower_bound": -5.0,
    "hidden_act": "silu",
    "rms_norm_eps": 1e-6,
    "rope_theta": 6_000_000.0,
    "rope_parameters": {"rope_type": "default", "rope_theta": 6_000_000.0},
    "max_position_embeddings": 262144,
    "num_nextn_predict_layers": 1,
    "tie_word_embeddings": False,
    "eos_token_id": 156895,
    "pad_token_id": 156892,
    "expert_swiglu_limit": 7.0,  # (expanded to the per-layer lists below)
    "quantization_config": SCHEME.to_config(),
}
PRESETS = {"ling-3.0-flash": LING_3_FLASH}


def synthetic_config(
    preset: str = "ling-3.0-flash",
    num_layers: int | None = None,
    num_experts: int | None = None,
    vocab_size: int | None = None,
    **overrides: Any,
) -> LingConfig:
    """The preset's config, optionally with fewer layers or experts or a smaller vocabulary (full
    width otherwise: the shapes every kernel sees stay the real ones); `overrides` replace any other
    config.json field (tests use narrow widths)."""
    if preset not in PRESETS:
        raise ValueError(f"unknown --random-weights preset '{preset}'; known: {', '.join(PRESETS)}.")
    raw = {**PRESETS[preset], **overrides}
    if num_layers is not None:
        if num_layers < 1:
            raise ValueError(f"--num-layers must be >= 1, got {num_layers}")
        raw["num_hidden_layers"] = num_layers
    if num_experts is not None:
        per_group = num_experts // raw["n_group"]
        if num_experts % raw["n_group"] or per_group * raw["topk_group"] < raw["num_experts_per_tok"]:
            raise ValueError(f"--num-experts {num_experts}: needs a multiple of {raw['n_group']} with enough per group")
        raw["num_experts"] = num_experts
    if vocab_size is not None:
        raw["vocab_size"] = vocab_size
        raw["eos_token_id"] = vocab_size - 1
        raw["pad_token_id"] = vocab_size - 2
    limit = raw.pop("expert_swiglu_limit", None)
    if limit is not None:
        layers = raw["num_hidden_layers"] + raw["num_nextn_predict_layers"]
        raw["expert_swiglu_limit_list"] = [limit] * layers
        raw["share_expert_swiglu_limit_list"] = [limit] * layers
    return LingConfig.from_dict(raw)


class RandomCheckpoint:
    """The loader's view of a checkpoint (CheckpointReader's interface), with random tensors made on
    `device` when asked for. The routed experts of one layer are generated together and served as
    slices, so a full-size model loads in seconds."""

    E8M0_BIAS = 127

    def __init__(self, config: LingConfig, device: torch.device | str = "cpu", seed: int = 0) -> None:
        self.config = config
        self.device = torch.device(device)
        self.seed = seed
        self.directory = Path(f"<random {config.hidden_size}x{config.num_hidden_layers} checkpoint>")
        self._specs = self._enumerate()
        self._layer_cache: tuple[str, dict[str, torch.Tensor]] | None = None

    # ------------------------------------------------------------------ CheckpointReader's interface
    @property
    def names(self) -> set[str]:
        return set(self._specs)

    def __contains__(self, name: str) -> bool:
        return name in self._specs

    def shape(self, name: str) -> tuple[int, ...]:
        return self._specs[name][0]

    def nbytes(self) -> int:
        return sum(math.prod(shape) * dtype.itemsize for shape, dtype in self._specs.values())

    def get(self, name: str) -> torch.Tensor:
        if name not in self._specs:
            from solo.checkpoint.reader import CheckpointError

            raise CheckpointError(f"{self.directory}: tensor '{name}' is missing from the checkpoint.")
        if ".mlp.experts." in name:
            return self._expert_tensor(name)
        if name.endswith(".weight_scale_inv"):
            return self._fp8(name.removesuffix(".weight_scale_inv"))[1]
        if classify(name) == "fp8":
            return self._fp8(name.removesuffix(".weight"))[0]
        return self._dense(name)

    # ------------------------------------------------------------------ what the checkpoint holds
    def _enumerate(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        from solo.model.ling import LingForCausalLM

        with torch.device("meta"):
            model = LingForCausalLM(self.config)
        specs: dict[str, tuple[tuple[int, ...], torch.dtype]] = {}
        for name, param in model.named_parameters():
            shape = tuple(param.shape)
            if classify(name) == "fp8":
                n, k = shape
                specs[name] = (shape, torch.float8_e4m3fn)
                scales = (-(-n // 128), -(-k // 128))
                specs[name.removesuffix(".weight") + ".weight_scale_inv"] = (scales, torch.float32)
            else:
                specs[name] = (shape, torch.bfloat16)
        c = self.config
        for layer in range(c.num_hidden_layers + c.num_nextn_predict_layers):
            if not c.is_moe(layer):
                continue
            for e in range(c.num_experts):
                for proj, (n, k) in (
                    ("gate_proj", (c.moe_intermediate_size, c.hidden_size)),
                    ("up_proj", (c.moe_intermediate_size, c.hidden_size)),
                    ("down_proj", (c.hidden_size, c.moe_intermediate_size)),
                ):
                    base = f"model.layers.{layer}.mlp.experts.{e}.{proj}"
                    specs[f"{base}.weight"] = ((n, k // 2), torch.uint8)
                    specs[f"{base}.weight_scale_inv"] = ((n, k // formats.MXFP4_BLOCK), torch.uint8)
        return specs

    def _generator(self, name: str) -> torch.Generator:
        g = torch.Generator(device=self.device)
        g.manual_seed(zlib.crc32(name.encode()) ^ (self.seed * 0x9E3779B1 & 0xFFFFFFFF))
        return g

    def _normal(self, name: str, shape: tuple[int, ...], std: float) -> torch.Tensor:
        return torch.randn(shape, generator=self._generator(name), device=self.device) * std

    def _dense(self, name: str) -> torch.Tensor:
        shape, dtype = self._specs[name]
        c = self.config
        if "norm" in name:  # RMSNorm weights near one
            value = 1.0 + self._normal(name, shape, 0.05)
        elif name.endswith("A_log"):
            value = torch.rand(shape, generator=self._generator(name), device=self.device) * math.log(16.0)
        elif name.endswith(("dt_bias", "_conv1d.weight")):
            value = self._normal(name, shape, 0.5)
        elif name.endswith("expert_bias"):
            value = self._normal(name, shape, 0.01)
        elif name == "model.word_embeddings.weight":
            value = self._normal(name, shape, 1.0)
        elif name == "lm_head.weight":  # logits of std ~4: clear margins between the top tokens
            value = self._normal(name, shape, 4.0 / math.sqrt(c.hidden_size))
        else:  # router and other dense projections keep the activation scale
            value = self._normal(name, shape, 1.0 / math.sqrt(shape[-1]))
        return value.to(dtype)

    def _fp8(self, base: str) -> tuple[torch.Tensor, torch.Tensor]:
        shape = self._specs[f"{base}.weight"][0]
        w = self._normal(f"{base}.weight", shape, 1.0 / math.sqrt(shape[1]))
        return formats.quantize_fp8_block(w, SCHEME.block_size, SCHEME.scale_fmt)

    def _expert_tensor(self, name: str) -> torch.Tensor:
        """One expert's codes or scales, sliced from its layer's tensors (generated once per layer)."""
        head, rest = name.split(".mlp.experts.")
        expert, proj, kind = rest.split(".", 2)
        if self._layer_cache is None or self._layer_cache[0] != head:
            self._layer_cache = (head, {})
        tensors = self._layer_cache[1]
        key = f"{proj}.{kind}"
        if key not in tensors:
            n, width = self._specs[name][0]
            shape = (self.config.num_experts, n, width)
            g = self._generator(f"{head}.{key}")
            if kind == "weight":  # every E2M1 code pair, uniformly
                tensors[key] = torch.randint(0, 256, shape, generator=g, device=self.device, dtype=torch.uint8)
            else:  # E8M0 scales around 2^-7 (gate/up, K = hidden) or 2^-6 (down, K = I): ~ 1/sqrt(K) weights
                centre = self.E8M0_BIAS - (7 if proj != "down_proj" else 6)
                scales = torch.randint(centre - 1, centre + 2, shape, generator=g, device=self.device)
                tensors[key] = scales.to(torch.uint8)
        return tensors[key][int(expert)]


def load_random_model(
    config: LingConfig,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.bfloat16,
    seed: int = 0,
    generate_on: torch.device | str | None = None,
):
    """The reference model of `config` with random weights in the fp4 format, through the real loader.
    The tensors are drawn on `generate_on` (default: `device`); the same seed on the same kind of
    device gives the same weights (CPU and CUDA generators draw different numbers)."""
    from solo.checkpoint.loader import LoadOptions, build_model

    reader = RandomCheckpoint(config, generate_on or device, seed)
    return build_model(config, reader, LoadOptions(device, dtype, progress=False))

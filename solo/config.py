"""The Ling-3.0 (bailing_hybrid) model configuration, read from either spelling of config.json.

The published checkpoints use the original field names (`num_experts_per_tok`, `n_group`,
`norm_topk_prob`, ...); transformers 5.23 writes its own (`num_experts_per_token`,
`num_expert_group`, `moe_renormalize`, ...). Both are accepted; where both appear they must agree.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


class ConfigError(ValueError):
    """A config.json that solo cannot run; the message names the field and the fix."""


# (canonical name, alternative spellings); canonical names are the published checkpoint's.
_ALIASES: dict[str, tuple[str, ...]] = {
    "num_experts_per_tok": ("num_experts_per_token",),
    "n_group": ("num_expert_group",),
    "norm_topk_prob": ("moe_renormalize",),
    "num_experts": ("num_local_experts",),
    "n_shared_experts": ("num_shared_experts",),
    "max_position_embeddings": ("model_max_length",),
    "num_nextn_predict_layers": ("num_mtp_layers",),
    "conv_kernel_size": ("short_conv_kernel_size", "linear_conv_kernel_dim"),
}

SUPPORTED_ROPE_TYPES = ("default", "yarn", "linear")
SUPPORTED_MODEL_TYPES = ("bailing_hybrid", "bailing_moe_v3", "bailing_moe_linear")


@dataclass
class LingConfig:
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    intermediate_size: int
    moe_intermediate_size: int
    num_experts: int
    num_experts_per_tok: int
    n_group: int
    topk_group: int
    first_k_dense_replace: int
    layer_group_size: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    linear_num_heads: int
    linear_head_dim: int
    q_lora_rank: int | None = None
    n_shared_experts: int = 1
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 2.5
    rms_norm_eps: float = 1e-6
    conv_kernel_size: int = 4
    kda_safe_gate: bool = True
    kda_lower_bound: float = -5.0
    hidden_act: str = "silu"
    rope_theta: float = 6_000_000.0
    rope_parameters: dict[str, Any] = field(default_factory=dict)
    max_position_embeddings: int = 262144
    num_nextn_predict_layers: int = 0
    tie_word_embeddings: bool = False
    eos_token_id: list[int] = field(default_factory=list)
    pad_token_id: int | None = None
    expert_swiglu_limit_list: list[float | None] | None = None
    share_expert_swiglu_limit_list: list[float | None] | None = None
    layer_types: list[str] = field(default_factory=list)
    mlp_layer_types: list[str] = field(default_factory=list)
    quantization_config: dict[str, Any] | None = None

    # ----------------------------------------------------------------- derived quantities
    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    def is_mla(self, layer: int) -> bool:
        """True for MLA (full attention) layers, False for KDA (linear attention) layers."""
        if layer >= self.num_hidden_layers:  # the NEXTN layer attends with MLA
            return True
        return self.layer_types[layer] == "full_attention"

    def is_moe(self, layer: int) -> bool:
        if layer >= self.num_hidden_layers:
            return True
        return self.mlp_layer_types[layer] == "sparse"

    def expert_swiglu_limit(self, layer: int) -> float | None:
        return _limit_at(self.expert_swiglu_limit_list, layer)

    def shared_swiglu_limit(self, layer: int) -> float | None:
        return _limit_at(self.share_expert_swiglu_limit_list, layer)

    @property
    def kda_layers(self) -> list[int]:
        return [i for i in range(self.num_hidden_layers) if not self.is_mla(i)]

    @property
    def mla_layers(self) -> list[int]:
        return [i for i in range(self.num_hidden_layers) if self.is_mla(i)]

    @property
    def has_nextn(self) -> bool:
        return self.num_nextn_predict_layers > 0

    # ----------------------------------------------------------------- reading
    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> LingConfig:
        d = dict(raw)
        _check_model_type(d)
        for canonical, alternatives in _ALIASES.items():
            _merge_alias(d, canonical, alternatives)

        def need(name: str) -> Any:
            if d.get(name) is None:
                raise ConfigError(
                    f"config.json: required field '{name}' is missing. solo runs Ling-3.0 "
                    "(bailing_hybrid) checkpoints; check that the config belongs to one."
                )
            return d[name]

        num_layers = int(need("num_hidden_layers"))
        heads = int(need("num_attention_heads"))
        # transformers overwrites head_dim with qk_rope_head_dim and keeps the KDA head size in
        # linear_head_dim; the published config has only head_dim (the KDA head size).
        linear_head_dim = d.get("linear_head_dim") or need("head_dim")
        eos = d.get("eos_token_id")
        eos_list = [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
        cfg = cls(
            vocab_size=int(need("vocab_size")),
            hidden_size=int(need("hidden_size")),
            num_hidden_layers=num_layers,
            num_attention_heads=heads,
            intermediate_size=int(need("intermediate_size")),
            moe_intermediate_size=int(need("moe_intermediate_size")),
            num_experts=int(need("num_experts")),
            num_experts_per_tok=int(need("num_experts_per_tok")),
            n_group=int(d.get("n_group") or 1),
            topk_group=int(d.get("topk_group") or 1),
            first_k_dense_replace=int(d.get("first_k_dense_replace") or 0),
            layer_group_size=int(need("layer_group_size")),
            kv_lora_rank=int(need("kv_lora_rank")),
            qk_nope_head_dim=int(need("qk_nope_head_dim")),
            qk_rope_head_dim=int(need("qk_rope_head_dim")),
            v_head_dim=int(need("v_head_dim")),
            linear_num_heads=int(d.get("linear_num_heads") or heads),
            linear_head_dim=int(linear_head_dim),
            q_lora_rank=int(d["q_lora_rank"]) if d.get("q_lora_rank") else None,
            n_shared_experts=int(d.get("n_shared_experts") or 0),
            norm_topk_prob=bool(d.get("norm_topk_prob", True)),
            routed_scaling_factor=float(d.get("routed_scaling_factor") or 1.0),
            rms_norm_eps=float(d.get("rms_norm_eps") or 1e-6),
            conv_kernel_size=int(d.get("conv_kernel_size") or 4),
            kda_safe_gate=bool(d.get("kda_safe_gate", True)),
            kda_lower_bound=float(d.get("kda_lower_bound", -5.0)),
            hidden_act=str(d.get("hidden_act") or "silu"),
            rope_theta=float(d.get("rope_theta") or 6_000_000.0),
            rope_parameters=_rope_parameters(d),
            max_position_embeddings=int(d.get("max_position_embeddings") or 262144),
            num_nextn_predict_layers=int(d.get("num_nextn_predict_layers") or 0),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            eos_token_id=[int(e) for e in eos_list],
            pad_token_id=d.get("pad_token_id"),
            expert_swiglu_limit_list=d.get("expert_swiglu_limit_list"),
            share_expert_swiglu_limit_list=d.get("share_expert_swiglu_limit_list"),
            layer_types=list(d.get("layer_types") or []),
            mlp_layer_types=list(d.get("mlp_layer_types") or []),
            quantization_config=d.get("quantization_config"),
        )
        cfg._derive_layer_pattern()
        cfg.validate()
        return cfg

    @classmethod
    def from_file(cls, path: str | Path) -> LingConfig:
        path = Path(path)
        if path.is_dir():
            path = path / "config.json"
        if not path.is_file():
            raise ConfigError(f"{path}: config.json not found. Point --model at a checkpoint folder.")
        try:
            raw = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise ConfigError(f"{path}: not valid JSON ({e}). The checkpoint's config is corrupt.") from e
        return cls.from_dict(raw)

    def _derive_layer_pattern(self) -> None:
        if not self.layer_types:
            self.layer_types = [
                "full_attention" if (i + 1) % self.layer_group_size == 0 else "linear_attention"
                for i in range(self.num_hidden_layers)
            ]
        if not self.mlp_layer_types:
            self.mlp_layer_types = [
                "dense" if i < self.first_k_dense_replace else "sparse" for i in range(self.num_hidden_layers)
            ]

    def validate(self) -> None:
        """Refuse configurations the engine cannot run, naming the field."""

        def fail(name: str, why: str) -> None:
            raise ConfigError(f"config.json: {name} {why}")

        if self.hidden_act != "silu":
            fail("hidden_act", f"is '{self.hidden_act}'; solo implements only 'silu' (SwiGLU).")
        if self.layer_group_size <= 0:
            fail("layer_group_size", f"must be positive, got {self.layer_group_size}.")
        if len(self.layer_types) != self.num_hidden_layers:
            fail("layer_types", f"has {len(self.layer_types)} entries for {self.num_hidden_layers} layers.")
        if len(self.mlp_layer_types) != self.num_hidden_layers:
            fail(
                "mlp_layer_types",
                f"has {len(self.mlp_layer_types)} entries for {self.num_hidden_layers} layers.",
            )
        for kind in set(self.layer_types) - {"full_attention", "linear_attention"}:
            fail("layer_types", f"contains '{kind}'; expected full_attention or linear_attention.")
        for kind in set(self.mlp_layer_types) - {"dense", "sparse"}:
            fail("mlp_layer_types", f"contains '{kind}'; expected dense or sparse.")
        if self.num_experts % self.n_group:
            fail("n_group", f"({self.n_group}) must divide num_experts ({self.num_experts}).")
        if not 1 <= self.topk_group <= self.n_group:
            fail("topk_group", f"({self.topk_group}) must be between 1 and n_group ({self.n_group}).")
        per_group = self.num_experts // self.n_group
        if self.n_group > 1 and per_group < 2:
            fail("n_group", "leaves fewer than 2 experts per group; group scores sum the top 2.")
        if self.num_experts_per_tok > per_group * self.topk_group:
            fail(
                "num_experts_per_tok",
                f"({self.num_experts_per_tok}) exceeds the experts in the kept groups ({per_group * self.topk_group}).",
            )
        if self.qk_rope_head_dim % 2:
            fail("qk_rope_head_dim", f"must be even for rotary embeddings, got {self.qk_rope_head_dim}.")
        rope_type = self.rope_parameters.get("rope_type", "default")
        if rope_type not in SUPPORTED_ROPE_TYPES:
            fail(
                "rope_parameters.rope_type",
                f"'{rope_type}' is not supported; use one of {SUPPORTED_ROPE_TYPES}.",
            )
        if rope_type == "yarn" and not self.rope_parameters.get("factor"):
            fail("rope_parameters.factor", "is required for yarn rotary scaling.")
        if self.conv_kernel_size < 1:
            fail("short_conv_kernel_size", f"must be >= 1, got {self.conv_kernel_size}.")
        if self.num_nextn_predict_layers > 1:
            fail("num_nextn_predict_layers", "> 1 is not supported; solo drives one NEXTN layer.")


def _limit_at(limits: list[float | None] | None, layer: int) -> float | None:
    if not limits or layer >= len(limits):
        return None
    value = limits[layer]
    return None if value in (None, 0) else float(value)


def _check_model_type(d: dict[str, Any]) -> None:
    model_type = d.get("model_type")
    if model_type is not None and model_type not in SUPPORTED_MODEL_TYPES:
        raise ConfigError(
            f"config.json: model_type is '{model_type}'; solo runs Ling-3.0 checkpoints "
            f"(model_type one of {SUPPORTED_MODEL_TYPES})."
        )


def _merge_alias(d: dict[str, Any], canonical: str, alternatives: tuple[str, ...]) -> None:
    for alt in alternatives:
        if alt not in d or d[alt] is None:
            continue
        if d.get(canonical) is None:
            d[canonical] = d[alt]
        elif d[canonical] != d[alt]:
            raise ConfigError(f"config.json: '{canonical}' ({d[canonical]}) and its alias '{alt}' ({d[alt]}) disagree.")


def _rope_parameters(d: dict[str, Any]) -> dict[str, Any]:
    params = dict(d.get("rope_parameters") or d.get("rope_scaling") or {})
    if "type" in params and "rope_type" not in params:
        params["rope_type"] = params.pop("type")
    params.setdefault("rope_type", "default")
    params.setdefault("rope_theta", float(d.get("rope_theta") or 6_000_000.0))
    if params["rope_type"] == "yarn":
        params.setdefault(
            "original_max_position_embeddings",
            d.get("original_max_position_embeddings") or d.get("max_position_embeddings"),
        )
    return params

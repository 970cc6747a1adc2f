"""How the model is split over the ranks of a tensor-parallel group, tensor by tensor.

  * attention (KDA and MLA) by heads: the q/k/v/f/g/b projections (KDA), q (or q_b) and kv_b (MLA)
    and the head-wise gates are split by rows (each rank computes its heads), with the short-conv
    weights, A_log and dt_bias; the output projection (`dense`) by columns, its partial sums added
    by the layer's first all-reduce. MLA's latent path (kv_a, its norm; q_a and its norm) is
    replicated: every head reads the same latent cache, which every rank keeps whole.
  * dense MLP and shared expert: gate/up by rows, down by columns.
  * routed experts: by expert (expert parallel: rank r holds experts [r E/N, (r+1) E/N), the router
    is replicated and each rank weights only its experts) or by width (every rank holds every
    expert's slice [r I/N, (r+1) I/N) of the intermediate dimension). Either way each rank's routed
    output is a partial sum, added together with the shared expert's by the layer's second
    all-reduce: two all-reduces per layer.
  * LM head by vocabulary rows; the logits are all-gathered (exact: every rank then holds the same
    full row, so sampling agrees bit for bit). Embedding, norms, router, NEXTN's eh_proj replicated.

Every split is an equal contiguous slice along one dimension of the checkpoint tensor; the sizes
must divide by the world size, and the refusal names the field and the fix.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from solo.config import LingConfig
from solo.distributed.parallel import EXPERT_SPLITS, TensorParallelError

MXFP4_GROUP = 32

_LAYER = r"model\.layers\.\d+\."
_ROWS = re.compile(
    _LAYER + r"(attention\.(q_proj|k_proj|v_proj|f_proj|g_proj|b_proj|q_b_proj|kv_b_proj)\.weight"
    r"|attention\.[qkv]_conv1d\.weight|attention\.(A_log|dt_bias)"
    r"|mlp\.(shared_experts\.)?(gate_proj|up_proj)\.weight)$"
)
_COLUMNS = re.compile(_LAYER + r"(attention\.dense\.weight|mlp\.(shared_experts\.)?down_proj\.weight)$")
EXPERT_TENSOR = re.compile(
    r"^(model\.layers\.\d+\.mlp\.experts\.)(\d+)\.(gate_proj|up_proj|down_proj)\.(weight_scale_inv|weight)$"
)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


@dataclass(frozen=True)
class ShardPlan:
    """One rank's share of the model. `experts` is resolved: "expert" or "width"."""

    world: int = 1
    rank: int = 0
    experts: str = "expert"

    @classmethod
    def create(cls, config: LingConfig, world: int, rank: int, experts: str = "auto") -> ShardPlan:
        """The plan for `rank` of `world`, or a TensorParallelError naming what does not divide."""
        if experts not in EXPERT_SPLITS:
            raise TensorParallelError(f"unknown expert split {experts!r}; choose one of {', '.join(EXPERT_SPLITS)}.")
        if world == 1:
            return cls(1, 0, "expert" if experts == "auto" else experts)

        def need(value: int, field: str, what: str) -> None:
            if value % world:
                raise TensorParallelError(
                    f"--tensor-parallel {world}: config.json {field} = {value} is not divisible by {world}, and "
                    f"{what} are split evenly over the ranks. Use a --tensor-parallel that divides {value} "
                    f"(one of {_divisors(value)})."
                )

        layers = range(config.num_hidden_layers + config.num_nextn_predict_layers)
        if config.kda_layers:
            need(config.linear_num_heads, "linear_num_heads", "the KDA heads")
        if any(config.is_mla(i) for i in layers):
            need(config.num_attention_heads, "num_attention_heads", "the MLA heads")
        moe = any(config.is_moe(i) for i in layers)
        if any(not config.is_moe(i) for i in layers):
            need(config.intermediate_size, "intermediate_size", "the dense MLPs' intermediate rows")
        if moe and config.n_shared_experts:
            need(
                config.moe_intermediate_size * config.n_shared_experts,
                "moe_intermediate_size x n_shared_experts",
                "the shared expert's intermediate rows",
            )
        need(config.vocab_size, "vocab_size", "the LM head's vocabulary rows")
        resolved = "expert"
        if moe:
            resolved = cls._expert_split(config, world, experts)
        return cls(world, rank, resolved)

    @staticmethod
    def _expert_split(config: LingConfig, world: int, requested: str) -> str:
        experts, inter = config.num_experts, config.moe_intermediate_size
        mxfp4 = (config.quantization_config or {}).get("routed_experts_quant_method") == "mxfp4"
        width_unit = MXFP4_GROUP * world if mxfp4 else world  # an MXFP4 group of 32 must not be cut
        by_expert = experts % world == 0
        by_width = inter % width_unit == 0
        why_not_expert = f"num_experts = {experts} is not divisible by {world}"
        why_not_width = (
            f"moe_intermediate_size = {inter} is not a multiple of {width_unit} "
            + (f"(each rank's slice must hold whole MXFP4 groups of {MXFP4_GROUP})" if mxfp4 else "")
        ).rstrip()
        if requested == "expert" and not by_expert:
            raise TensorParallelError(
                f"--tensor-parallel {world} --moe-split expert: {why_not_expert}."
                + (" Use --moe-split width." if by_width else "")
            )
        if requested == "width" and not by_width:
            raise TensorParallelError(
                f"--tensor-parallel {world} --moe-split width: {why_not_width}."
                + (" Use --moe-split expert." if by_expert else "")
            )
        if requested != "auto":
            return requested
        # batch 1: a split by width reads 1/N of each chosen expert on every rank (balanced, static
        # shapes); by expert each rank still runs every slot of the top-k (non-local ones weighted 0)
        if by_width:
            return "width"
        if by_expert:
            return "expert"
        raise TensorParallelError(
            f"--tensor-parallel {world}: the routed experts split neither by expert ({why_not_expert}) nor by "
            f"width ({why_not_width}). Use a --tensor-parallel that divides num_experts."
        )

    # ------------------------------------------------------------------ sizes
    def part(self, n: int) -> int:
        return n // self.world

    def span(self, n: int) -> tuple[int, int]:
        size = n // self.world
        return self.rank * size, (self.rank + 1) * size

    def kda_heads(self, config: LingConfig) -> int:
        return self.part(config.linear_num_heads)

    def mla_heads(self, config: LingConfig) -> int:
        return self.part(config.num_attention_heads)

    def dense_intermediate(self, config: LingConfig) -> int:
        return self.part(config.intermediate_size)

    def shared_intermediate(self, config: LingConfig) -> int:
        return self.part(config.moe_intermediate_size * config.n_shared_experts)

    def expert_span(self, config: LingConfig) -> tuple[int, int]:
        """(first, count) of the routed experts this rank holds."""
        if self.experts == "expert":
            first, stop = self.span(config.num_experts)
            return first, stop - first
        return 0, config.num_experts

    def expert_intermediate(self, config: LingConfig) -> int:
        return self.part(config.moe_intermediate_size) if self.experts == "width" else config.moe_intermediate_size

    def vocab_span(self, config: LingConfig) -> tuple[int, int]:
        return self.span(config.vocab_size)

    # ------------------------------------------------------------------ tensors
    def split_dim(self, name: str) -> int | None:
        """The dimension of checkpoint tensor `name` that is split over the ranks (None: replicated).
        Routed experts' tensors are the caller's business (`EXPERT_TENSOR`: renumbered or split by width)."""
        if self.world == 1:
            return None
        if name == "lm_head.weight":
            return 0
        if _ROWS.match(name):
            return 0
        if _COLUMNS.match(name):
            return 1
        return None

    def expert_dim(self, projection: str) -> int:
        """Width split: the dimension of an expert's gate/up (rows) or down (columns) tensors."""
        return 1 if projection == "down_proj" else 0

    def describe(self, config: LingConfig) -> dict[str, Any]:
        """This rank's shard, in the terms of the model (for the start-up report)."""

        def interval(span: tuple[int, int]) -> str:
            return f"[{span[0]}, {span[1]})"

        shard: dict[str, Any] = {"rank": self.rank}
        if config.kda_layers:
            shard["kda_heads"] = interval(self.span(config.linear_num_heads))
        shard["mla_heads"] = interval(self.span(config.num_attention_heads))
        if self.experts == "expert":
            first, count = self.expert_span(config)
            shard["experts"] = interval((first, first + count))
        else:
            shard["expert_width"] = interval(self.span(config.moe_intermediate_size))
        shard["vocab"] = interval(self.vocab_span(config))
        return shard

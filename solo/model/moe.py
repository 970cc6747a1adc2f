"""SwiGLU MLPs and the group-limited sigmoid-routed mixture of experts."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from solo.config import LingConfig
from solo.distributed.sharding import ShardPlan
from solo.kernels.moe import MoEBackend, swiglu
from solo.model.layers import Linear


class SwiGLUMLP(nn.Module):
    """down(silu(gate(x)) * up(x)); dense layers and the shared expert."""

    def __init__(self, hidden: int, intermediate: int, swiglu_limit: float | None = None) -> None:
        super().__init__()
        self.gate_proj = Linear(hidden, intermediate)
        self.up_proj = Linear(hidden, intermediate)
        self.down_proj = Linear(intermediate, hidden)
        self.swiglu_limit = swiglu_limit

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(swiglu(self.gate_proj(x), self.up_proj(x), self.swiglu_limit))


class Router(nn.Module):
    """fp32 sigmoid scores; `expert_bias` steers selection only. Groups are ranked by the sum of
    their top-2 biased scores, the best `topk_group` kept, and the top-k experts taken from them.
    Weights are the unbiased scores of the chosen experts, optionally renormalised, times
    `routed_scaling_factor`."""

    def __init__(self, config: LingConfig) -> None:
        super().__init__()
        self.num_experts = config.num_experts
        self.top_k = config.num_experts_per_tok
        self.n_group = config.n_group
        self.topk_group = config.topk_group
        self.renormalize = config.norm_topk_prob
        self.scaling = config.routed_scaling_factor
        self.weight = nn.Parameter(torch.empty(config.num_experts, config.hidden_size), requires_grad=False)
        self.expert_bias = nn.Parameter(torch.zeros(config.num_experts), requires_grad=False)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, H] -> (weights [T, k] fp32, expert ids [T, k] int64)."""
        scores = torch.sigmoid(F.linear(x.float(), self.weight.float()))
        biased = scores + self.expert_bias.float()
        if self.n_group > 1 and self.topk_group < self.n_group:
            grouped = biased.view(-1, self.n_group, self.num_experts // self.n_group)
            group_scores = grouped.topk(2, dim=-1).values.sum(-1)
            kept = group_scores.topk(self.topk_group, dim=-1).indices
            group_mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, kept, True)
            biased = grouped.masked_fill(~group_mask[..., None], float("-inf")).flatten(1)
        ids = biased.topk(self.top_k, dim=-1).indices
        weights = scores.gather(1, ids)
        if self.renormalize:
            weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
        return weights * self.scaling, ids


class SparseMoE(nn.Module):
    """Routed experts (run by a swappable MoEBackend set at load time) plus the shared expert.

    Under tensor parallelism (`plan`, solo.distributed.sharding) the router is whole and the experts
    are this rank's: split by expert, the backend holds experts [first, first + count) and the
    routing's other experts get weight 0 here (their owners weight them); split by width, it holds
    every expert's slice of the intermediate dimension. The output is then this rank's partial sum."""

    def __init__(self, config: LingConfig, layer: int, plan: ShardPlan | None = None) -> None:
        super().__init__()
        plan = plan or ShardPlan()
        self.gate = Router(config)
        self.experts: MoEBackend | None = None
        self.swiglu_limit = config.expert_swiglu_limit(layer)
        self.expert_first, self.num_local_experts = plan.expert_span(config)
        self.expert_intermediate = plan.expert_intermediate(config)
        self.localize = self.num_local_experts < config.num_experts
        self.shared_experts = (
            SwiGLUMLP(config.hidden_size, plan.shared_intermediate(config), config.shared_swiglu_limit(layer))
            if config.n_shared_experts
            else None
        )

    def local_routing(self, ids: torch.Tensor, weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Expert parallel: global ids -> this rank's expert numbers, other ranks' slots weighted 0 (and
        pointed at local expert 0). Static shapes, no host synchronisation."""
        local = ids - self.expert_first
        mine = (local >= 0) & (local < self.num_local_experts)
        return torch.where(mine, local, torch.zeros_like(local)), torch.where(mine, weights, torch.zeros_like(weights))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.experts is None:
            raise RuntimeError("SparseMoE: routed experts were not loaded (the checkpoint loader sets them).")
        weights, ids = self.gate(x)
        if self.localize:
            ids, weights = self.local_routing(ids, weights)
        out = self.experts(x, ids, weights)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return out

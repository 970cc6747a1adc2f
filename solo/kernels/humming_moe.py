"""Routed MoE through Humming (`humming-kernels` on PyPI, import `humming`): MXFP4 weights with
BF16 activations, the path the seed system measured on the DGX Spark.

The complete path per call: routing alignment (static shapes, on the device), the indexed
gate_up GEMM, SwiGLU (optional clamp), the indexed down GEMM and the weighted combine. Humming
JIT-compiles one kernel per (layer shape, token count) on first use through NVRTC and caches the
cubins on disk (HUMMING_CACHE_DIR, default <solo cache>/humming here); run one eager call per
token count before capturing a CUDA graph.

Humming is imported lazily: constructing this backend on a machine without CUDA or without the
package raises a RuntimeError that says what to install.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import torch

from solo.kernels.moe import CompileEvidence, MoEBackend, MXFP4Experts, swiglu
from solo.kernels.routing import align_routing, one_block_per_assignment

_NEEDS = (
    "--moe-backend humming needs an NVIDIA GPU (SM80+) and the humming-kernels package: pip install humming-kernels"
)


def _solo_cache_dir() -> str:
    root = os.environ.get("SOLO_CACHE_DIR")
    return os.path.expanduser(root) if root else os.path.expanduser("~/.cache/solo")


def humming_cache_dir() -> str:
    return os.environ.get("HUMMING_CACHE_DIR", os.path.join(_solo_cache_dir(), "humming"))


def humming_artifacts(cache_dir: str) -> list[str]:
    """Every file Humming's JIT left in its cache (its compiled kernels)."""
    try:
        return sorted(str(p) for p in Path(cache_dir).rglob("*") if p.is_file())
    except OSError:
        return []


def import_humming() -> Any:
    """Import humming (and check the GPU) or raise RuntimeError naming the problem and the fix."""
    if not torch.cuda.is_available():
        raise RuntimeError(f"{_NEEDS} (no CUDA device is visible here).")
    major, minor = torch.cuda.get_device_capability()
    if major < 8:
        raise RuntimeError(f"{_NEEDS} (this GPU is SM{major}{minor}).")
    os.environ.setdefault("HUMMING_CACHE_DIR", os.path.join(_solo_cache_dir(), "humming"))
    try:
        import humming  # noqa: F401
        import humming.layer
        import humming.tune
    except ImportError as exc:
        raise RuntimeError(f"{_NEEDS} (import failed: {exc}).") from exc
    return humming


class HummingMoE(MoEBackend):
    """MXFP4 routed experts through Humming's indexed MoE GEMMs."""

    name = "humming"
    small_call_assignments = 64  # up to this many token x expert assignments: one block each (no sort)

    def __init__(
        self,
        experts: MXFP4Experts,
        dtype: torch.dtype = torch.bfloat16,
        swiglu_limit: float | None = None,
    ) -> None:
        super().__init__(swiglu_limit)
        self._humming = import_humming()
        if not isinstance(experts, MXFP4Experts):
            raise TypeError("HummingMoE runs MXFP4 experts (MXFP4Experts)")
        if dtype not in (torch.bfloat16, torch.float16):
            raise ValueError(f"HummingMoE computes in bf16 or fp16, got {dtype}")
        device = experts.gate_up.device
        if device.type != "cuda":
            raise RuntimeError(f"{_NEEDS} (the expert weights are on '{device.type}', move them to CUDA).")
        self.dtype = dtype
        self.device = device
        e, two_i, h_half = experts.gate_up.shape
        self.num_experts = e
        self.inter = two_i // 2
        self.hidden = h_half * 2
        self.gate_up = self._layer(experts.gate_up, experts.gate_up_scale, 2 * self.inter, self.hidden)
        self.down = self._layer(experts.down, experts.down_scale, self.hidden, self.inter)
        self._tuning: dict[tuple[str, int], dict] = {}
        self._constant_tables: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}
        self.path_calls = {"humming_gemm": 0}  # Humming GEMM launches (two per call)
        self._warmup: dict[str, Any] = {}

    def _layer(self, packed: torch.Tensor, scale: torch.Tensor, n: int, k: int) -> Any:
        from humming.layer import HummingLayer

        with torch.cuda.device(self.device):
            layer = HummingLayer(
                shape_n=n,
                shape_k=k,
                weight_config={"quant_method": "mxfp4"},
                num_experts=self.num_experts,
                torch_dtype=self.dtype,
            ).to(self.device)
            layer.load_from_tensors({"weight": packed.view(torch.uint8), "weight_scale": scale.view(torch.uint8)})
            layer.transform()
        return layer

    def _tuning_config(self, which: str, shape_m: int) -> dict:
        key = (which, shape_m)
        cfg = self._tuning.get(key)
        if cfg is None:
            from humming.tune import get_heuristics_config

            layer = self.gate_up if which == "gate_up" else self.down
            cfg = dict(
                get_heuristics_config(layer.humming_config, shape_m=shape_m, gemm_type="indexed", device=self.device)
            )
            self._tuning[key] = cfg
        return cfg

    def _tables(self, which: str, topk_ids: torch.Tensor) -> tuple[dict, tuple[torch.Tensor, ...]]:
        n = topk_ids.numel()
        cfg = self._tuning_config(which, n)
        block_m = int(cfg["block_shape"][0])
        if n > self.small_call_assignments:
            return cfg, align_routing(topk_ids, block_m)
        key = (n, block_m)
        if key not in self._constant_tables:  # made on the first (eager, warm-up) call of this size
            self._constant_tables[key] = one_block_per_assignment(n, block_m, topk_ids.device)
        sorted_ids, num_tokens_padded = self._constant_tables[key]
        return cfg, (sorted_ids, topk_ids.reshape(-1).to(torch.int32), num_tokens_padded)

    def _gemm(
        self,
        which: str,
        inputs: torch.Tensor,
        topk_ids: torch.Tensor,
        top_k: int,
        tables: tuple[dict, tuple[torch.Tensor, ...]] | None = None,
    ) -> torch.Tensor:
        layer = self.gate_up if which == "gate_up" else self.down
        cfg, (sorted_ids, expert_ids, num_tokens_padded) = tables or self._tables(which, topk_ids)
        return layer(
            inputs,
            sorted_ids=sorted_ids,
            expert_ids=expert_ids,
            num_tokens_padded=num_tokens_padded,
            top_k=top_k,
            compute_config={"gemm_type": "indexed"},
            tuning_config=cfg,
        )

    def forward(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        t, top_k = topk_ids.shape
        xin = x if x.dtype == self.dtype else x.to(self.dtype)
        gu_tables = self._tables("gate_up", topk_ids)
        dn_cfg = self._tuning_config("down", topk_ids.numel())
        same_block = int(dn_cfg["block_shape"][0]) == int(gu_tables[0]["block_shape"][0])
        dn_tables = (dn_cfg, gu_tables[1]) if same_block else self._tables("down", topk_ids)
        self.path_calls["humming_gemm"] += 2
        h = self._gemm("gate_up", xin.contiguous(), topk_ids, top_k, gu_tables)  # [T*k, 2I]
        act = swiglu(h[:, : self.inter], h[:, self.inter :], self.swiglu_limit).contiguous()
        y = self._gemm("down", act, topk_ids, 1, dn_tables)  # [T*k, H]
        out = (y.view(t, top_k, self.hidden).float() * topk_weights[..., None].float()).sum(1)
        return out.to(x.dtype)

    def family_for(self, tokens: int) -> str:
        return "humming_gemm"

    def warmup(self, top_k: int = 8, token_counts: tuple[int, ...] = (1, 2, 3, 4)) -> dict[str, Any]:
        """JIT-compile (or load from HUMMING_CACHE_DIR) the kernels for these token counts."""
        cache_dir = humming_cache_dir()
        before = set(humming_artifacts(cache_dir))
        t0 = time.perf_counter()
        for t in token_counts:
            x = torch.zeros((t, self.hidden), dtype=self.dtype, device=self.device)
            ids = (torch.arange(t * top_k, device=self.device) % self.num_experts).view(t, top_k)
            w = torch.full((t, top_k), 1.0 / top_k, device=self.device)
            self.forward(x, ids, w)
        torch.cuda.synchronize(self.device)
        after = humming_artifacts(cache_dir)
        self._warmup = {
            "what": "humming_moe",
            "seconds": time.perf_counter() - t0,
            "new_cache_entries": len(set(after) - before),
            "token_counts": list(token_counts),
        }
        return dict(self._warmup)

    def compile_evidence(self) -> CompileEvidence:
        """The files Humming's JIT keeps in its cache: none means no compiled kernel is known to exist."""
        cache_dir = humming_cache_dir()
        return CompileEvidence(
            "humming",
            cache_dir,
            humming_artifacts(cache_dir),
            self._warmup.get("new_cache_entries", 0),
            self._warmup.get("seconds", 0.0),
        )

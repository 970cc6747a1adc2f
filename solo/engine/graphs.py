"""CUDA graphs: the one place that captures them, and target forward steps replayed from them.

At batch size 1 a decode step is hundreds of small kernels; launching them one by one costs more
than their memory traffic on a fast GPU. A graph records the step once over static buffers (the
cache, the KDA history, the input ids and positions) and replays it with one launch. The step has
no host synchronisation and no data-dependent Python control flow, which is what makes this legal.

Every graph of an engine is captured by one `GraphCapture`, so they share one memory pool (a graph's
intermediate buffers are reused by the next one captured, instead of each holding its own).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from solo.model.cache import HybridCache, KDAHistory
from solo.model.ling import LingForCausalLM


class GraphCapture:
    """Captures callables as CUDA graphs in one shared memory pool."""

    WARMUP_RUNS = 2  # eager runs on a side stream first: lazy allocations and compilations happen there

    def __init__(self) -> None:
        self._pool: Any = None
        self.captured = 0

    def capture(
        self, fn: Callable[[], Any], generator: torch.Generator | None = None
    ) -> tuple[torch.cuda.CUDAGraph, Any]:
        """Run `fn` a few times eagerly, then record it. Returns (graph, what the recorded run returned:
        its tensors are the graph's static outputs). A `generator` used inside `fn` is registered so
        each replay advances its state (graph-safe sampling)."""
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream), torch.inference_mode():
            for _ in range(self.WARMUP_RUNS):
                fn()
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        if generator is not None:
            graph.register_generator_state(generator)
        with torch.cuda.graph(graph, pool=self._pool), torch.inference_mode():
            outputs = fn()
        self._pool = graph.pool()
        self.captured += 1
        return graph, outputs


def graph_safe_generators() -> bool:
    """Whether this torch can register a generator in a CUDA graph (sampling inside a graph)."""
    return hasattr(torch.cuda.CUDAGraph, "register_generator_state")


@dataclass
class _Captured:
    graph: torch.cuda.CUDAGraph
    ids: torch.Tensor
    positions: torch.Tensor
    hidden: torch.Tensor
    logits: torch.Tensor


class EagerStep:
    """(hidden, fp32 logits) of the target for a few tokens, run op by op."""

    name = "eager"

    def __init__(self, model: LingForCausalLM) -> None:
        self.model = model

    def __call__(
        self,
        ids: torch.Tensor,
        positions: torch.Tensor,
        cache: HybridCache,
        history: dict[int, KDAHistory] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        hidden = self.model(ids, positions, cache, kda_history=history)
        return hidden, self.model.logits(hidden)


class GraphedStep(EagerStep):
    """Replays captured graphs for the (token count, cache, history) it was built for; anything else
    runs eagerly."""

    name = "cuda_graph"

    def __init__(self, model: LingForCausalLM, graphs: GraphCapture) -> None:
        super().__init__(model)
        self.graphs = graphs
        self._captured: dict[tuple[int, int, int], _Captured] = {}
        self.replays = 0

    def capture(self, tokens: int, cache: HybridCache, history: dict[int, KDAHistory] | None = None) -> None:
        """Record the step for `tokens` tokens. Warm-up runs write to the cache: reset it afterwards."""
        device = self.model.device
        ids = torch.zeros(tokens, dtype=torch.long, device=device)
        positions = torch.arange(tokens, device=device)
        graph, (hidden, logits) = self.graphs.capture(lambda: EagerStep.__call__(self, ids, positions, cache, history))
        self._captured[self._key(tokens, cache, history)] = _Captured(graph, ids, positions, hidden, logits)

    @staticmethod
    def _key(tokens: int, cache: HybridCache, history) -> tuple[int, int, int]:
        return tokens, id(cache), id(history) if history is not None else 0

    @property
    def captured_sizes(self) -> list[int]:
        return sorted({key[0] for key in self._captured})

    def __call__(self, ids, positions, cache, history=None):
        captured = self._captured.get(self._key(ids.numel(), cache, history))
        if captured is None:
            return super().__call__(ids, positions, cache, history)
        captured.ids.copy_(ids)
        captured.positions.copy_(positions)
        captured.graph.replay()
        self.replays += 1
        return captured.hidden, captured.logits

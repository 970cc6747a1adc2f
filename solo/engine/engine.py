"""Generation: prefill, then decode over preallocated caches, streaming tokens with timing.

The engine asks a *decoder* for rounds of tokens: plain decoding yields one token per round, the
speculative decoder up to draft+1. Stop conditions (eos, stop strings, max tokens) are applied
per token, so a stop inside a verification window ends the text exactly where plain decoding would.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from solo.engine.graphs import EagerStep, GraphedStep
from solo.engine.sampling import SamplingParams, make_generator, sample
from solo.model.cache import HybridCache
from solo.model.ling import LingForCausalLM
from solo.tokenizer import StreamDecoder, Tokenizer


@dataclass
class GenerationParams:
    max_tokens: int = 128
    sampling: SamplingParams = field(default_factory=SamplingParams)
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")


@dataclass
class GenerationStats:
    prompt_tokens: int = 0
    completion_tokens: int = 0
    ttft_s: float = 0.0
    total_s: float = 0.0
    tpot_s: float | None = None
    decode_tok_per_s: float | None = None
    # speculative decoding (None when it is off)
    verify_rounds: int | None = None
    drafted_tokens: int | None = None
    accepted_tokens: int | None = None
    accept_length: float | None = None
    per_position_acceptance: list[float] | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class StreamEvent:
    """One generated token: its id, the text it completes (may be empty while UTF-8 or a possible
    stop string is held back), and the time since the request started."""

    token_id: int
    text: str
    elapsed_s: float


@dataclass
class GenerationResult:
    text: str
    token_ids: list[int]
    finish_reason: str  # "stop" (eos or stop string) or "length"
    stats: GenerationStats


class PlainDecoder:
    """One token per model step."""

    def __init__(self, model: LingForCausalLM) -> None:
        self.model = model
        self.step = EagerStep(model)

    def capture_graphs(self, cache: HybridCache) -> None:
        self.step = GraphedStep(self.model)
        self.step.capture(1, cache)

    def graph_report(self) -> dict | None:
        """None when steps run eagerly; else what was captured and how often it replayed."""
        if not isinstance(self.step, GraphedStep):
            return None
        return {"captured": "decode step", "sizes": self.step.captured_sizes, "replays": self.step.replays}

    def rounds(
        self, prompt_ids: torch.Tensor, cache: HybridCache, params: SamplingParams, stats: GenerationStats
    ) -> Iterator[list[int]]:
        model, device = self.model, self.model.device
        generator = make_generator(params, device)
        hidden = model.prefill(prompt_ids, cache)
        token = sample(model.logits(hidden[-1:]), params, generator)
        position_buf = torch.tensor([prompt_ids.numel()], device=device)
        while True:
            yield [int(token.item())]
            _, logits = self.step(token, position_buf, cache)
            token = sample(logits, params, generator)
            position_buf += 1


class Engine:
    def __init__(self, model: LingForCausalLM, tokenizer: Tokenizer, decoder: Any | None = None) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.decoder = decoder or PlainDecoder(model)
        self._cache: HybridCache | None = None
        self.graphs_max_len: int | None = None  # set when CUDA graphs pin the cache

    @classmethod
    def from_pretrained(
        cls,
        path: str | Path,
        speculative: Any = None,
        cuda_graphs: bool = False,
        max_context: int = 4096,
        **load_options: Any,
    ) -> Engine:
        """Load a checkpoint folder; `speculative` (a SpeculativeConfig) turns on NEXTN drafting;
        `cuda_graphs` captures the target steps over a pinned cache of `max_context` positions."""
        from solo.checkpoint.loader import LoadOptions, load_model

        model = load_model(path, LoadOptions(**load_options))
        tokenizer = Tokenizer.from_dir(path, model.config.eos_token_id)
        decoder = None
        if speculative is not None:
            from solo.speculative.nextn import NextNDecoder

            decoder = NextNDecoder(model, speculative)
        engine = cls(model, tokenizer, decoder)
        if cuda_graphs:
            engine.enable_cuda_graphs(max_context)
        return engine

    def describe(self) -> dict[str, Any]:
        """What is really in use: the LM head's weights, the routed-expert backend, dtype, device."""
        from solo.model.layers import block_fp8_linears
        from solo.model.moe import SparseMoE

        backends = sorted({m.experts.name for m in self.model.modules() if isinstance(m, SparseMoE) and m.experts})
        fp8 = block_fp8_linears(self.model)
        head = self.model.lm_head
        return {
            "device": str(self.model.device),
            "dtype": str(self.model.dtype).removeprefix("torch."),
            "lm_head": head.describe() if hasattr(head, "describe") else {"mode": "dense"},
            "moe_backend": backends[0] if len(backends) == 1 else backends,
            "block_fp8": {"layers": len(fp8), "bytes": sum(m.nbytes for m in fp8)},
            "decoder": type(self.decoder).__name__,
            "cuda_graphs": self.decoder.graph_report(),
        }

    # ------------------------------------------------------------------ caches
    @property
    def cache_margin(self) -> int:
        """Extra positions a decoder may write past the last emitted token (verification windows)."""
        return getattr(self.decoder, "window", 1)

    def cache_for(self, length: int) -> HybridCache:
        limit = self.model.config.max_position_embeddings
        if length > limit:
            raise ValueError(
                f"prompt plus max_tokens needs {length} positions; the model supports {limit}. "
                "Shorten the prompt or lower --max-tokens."
            )
        if self.graphs_max_len is not None and length > self.graphs_max_len:
            raise ValueError(
                f"prompt plus max_tokens needs {length} positions; the CUDA-graph cache holds "
                f"{self.graphs_max_len} (--max-context). Raise --max-context or shorten the request."
            )
        if self._cache is None or self._cache.max_len < length:
            self._cache = HybridCache(self.model.config, length, self.model.device, self.model.dtype, with_nextn=True)
        self._cache.reset()
        return self._cache

    def enable_cuda_graphs(self, max_len: int) -> None:
        """Pin one cache of `max_len` positions and capture the decoder's target steps on it."""
        if self.model.device.type != "cuda":
            raise ValueError("CUDA graphs need the model on a CUDA device (--device cuda).")
        self._cache = HybridCache(self.model.config, max_len, self.model.device, self.model.dtype, with_nextn=True)
        self.graphs_max_len = max_len
        self.decoder.capture_graphs(self._cache)
        self._cache.reset()

    # ------------------------------------------------------------------ generation
    def encode_prompt(self, prompt: str | list[int], chat: bool = False) -> list[int]:
        if isinstance(prompt, str):
            text = Tokenizer.chat_prompt([{"role": "user", "content": prompt}]) if chat else prompt
            ids = self.tokenizer.encode(text)
        else:
            ids = list(prompt)
        if not ids:
            raise ValueError("the prompt is empty; give at least one token of text.")
        vocab = self.model.config.vocab_size
        bad = [i for i in ids if not 0 <= i < vocab]
        if bad:
            raise ValueError(f"prompt token ids {bad[:5]} are outside the vocabulary [0, {vocab}).")
        return ids

    @torch.inference_mode()
    def stream(
        self, prompt: str | list[int], params: GenerationParams | None = None, chat: bool = False
    ) -> Iterator[StreamEvent]:
        """Yield tokens as they are produced; the last event is followed by `self.last_result`."""
        params = params or GenerationParams()
        ids = self.encode_prompt(prompt, chat)
        cache = self.cache_for(len(ids) + params.max_tokens + self.cache_margin)
        stats = GenerationStats(prompt_tokens=len(ids))
        eos = set() if params.ignore_eos else set(self.tokenizer.eos_ids)
        text = StreamDecoder(self.tokenizer)
        hold = max((len(s) for s in params.stop), default=1) - 1
        emitted = 0
        out_ids: list[int] = []
        finish = "length"
        start = time.perf_counter()
        first_token_at = None
        prompt_tensor = torch.tensor(ids, device=self.model.device)

        for round_tokens in self.decoder.rounds(prompt_tensor, cache, params.sampling, stats):
            now = time.perf_counter()
            first_token_at = first_token_at or now
            for token in round_tokens:
                out_ids.append(token)
                if token in eos:
                    finish = "stop"
                    break
                piece = text.push(token)
                # a stop string not seen before must end inside the new piece
                cut = _find_stop(text.text, params.stop, len(text.text) - len(piece) - hold)
                if cut is not None:
                    text.text = text.text[:cut]
                    finish = "stop"
                    break
                safe = max(emitted, len(text.text) - hold) if params.stop else len(text.text)
                piece, emitted = text.text[emitted:safe], safe
                yield StreamEvent(token, piece, now - start)
                if len(out_ids) >= params.max_tokens:
                    break
            if finish == "stop" or len(out_ids) >= params.max_tokens:
                break
        end = time.perf_counter()
        if text.text[emitted:]:  # text held back for a possible stop string, or partial UTF-8
            yield StreamEvent(out_ids[-1], text.text[emitted:], end - start)
        stats = _finish_stats(stats, out_ids, start, first_token_at, end)
        self.last_result = GenerationResult(text.text, out_ids, finish, stats)

    def generate(
        self, prompt: str | list[int], params: GenerationParams | None = None, chat: bool = False
    ) -> GenerationResult:
        for _ in self.stream(prompt, params, chat):
            pass
        return self.last_result


def _find_stop(text: str, stops: tuple[str, ...], start: int) -> int | None:
    hits = [i for i in (text.find(s, max(start, 0)) for s in stops if s) if i >= 0]
    return min(hits) if hits else None


def _finish_stats(
    stats: GenerationStats, out_ids: list[int], start: float, first: float | None, end: float
) -> GenerationStats:
    stats.completion_tokens = len(out_ids)
    stats.total_s = end - start
    stats.ttft_s = (first or end) - start
    if len(out_ids) > 1:
        stats.tpot_s = (stats.total_s - stats.ttft_s) / (len(out_ids) - 1)
        stats.decode_tok_per_s = 1.0 / stats.tpot_s if stats.tpot_s > 0 else None
    return stats

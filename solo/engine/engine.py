"""Generation: prefill, then decode over preallocated caches, streaming tokens with timing.

The engine asks a *decoder* (solo.engine.decoder) for rounds of tokens: plain decoding yields one
token per round, the speculative decoder up to draft+1. Stop conditions (eos, stop strings, max
tokens) are applied per token, so a stop inside a verification window ends the text exactly where
plain decoding would. The engine owns the request's statistics and counts acceptance (per request
and for the process) from the rounds.

Under tensor parallelism (one engine per rank, over the rank's shard of the model) every request
runs on all ranks together (solo.distributed.lockstep): rank 0 broadcasts it as it starts, and its
rounds are pulled on every rank only as rank 0 pulls them, with a digest of the tokens compared at
the end. Each request's stats count the collectives it ran and their time.
"""

from __future__ import annotations

import time
import weakref
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from solo.distributed import lockstep
from solo.engine.decoder import Decoder, PlainDecoder, Round
from solo.engine.graphs import GraphCapture
from solo.engine.request import GenerationParams, GenerationResult, GenerationStats, PromptLogprob, StreamEvent
from solo.engine.sampling import LOGPROB_TOP, pack_logprobs, unpack_logprobs
from solo.engine.traffic import decode_traffic
from solo.model.cache import HybridCache
from solo.model.ling import LingForCausalLM
from solo.speculative.acceptance import AcceptanceCounter, AcceptanceWatchdog
from solo.tokenizer import StreamDecoder, Tokenizer

__all__ = [
    "Engine",
    "EngineBusy",
    "Generation",
    "GenerationParams",
    "GenerationResult",
    "GenerationStats",
    "PromptLogprob",
]

SCORE_CHUNK = 256  # prompt positions whose logits are materialised at once when scoring


class EngineBusy(RuntimeError):
    """A second request was started while one is still in flight (the engine serves one at a time)."""


class Generation:
    """One request in flight: iterate it for `StreamEvent`s; `result` is set once it has finished.
    `close()` cancels it (the decoder stops at the end of the current round)."""

    def __init__(self) -> None:
        self._events: Iterator[StreamEvent] = iter(())
        self.result: GenerationResult | None = None
        self.done = False  # finished, failed or closed: the engine is free for the next request

    def __iter__(self) -> Generation:
        return self

    def __next__(self) -> StreamEvent:
        return next(self._events)

    def close(self) -> None:
        """Stop generating; the result (finish reason "cancelled") covers the tokens made so far."""
        self._events.close()  # type: ignore[attr-defined]
        self.done = True

    def finish(self) -> GenerationResult:
        """Run to the end and return the result."""
        for _ in self:
            pass
        assert self.result is not None
        return self.result


class Engine:
    def __init__(self, model: LingForCausalLM, tokenizer: Tokenizer, decoder: Decoder | None = None) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.decoder: Decoder = decoder or PlainDecoder(model)
        self._cache: HybridCache | None = None
        self.graphs_max_len: int | None = None  # set when CUDA graphs pin the cache
        self.graphs: GraphCapture | None = None
        # acceptance over every request of the process, and the watchdog that reads it
        self.acceptance = AcceptanceCounter(self.decoder.num_draft_positions)
        self.watchdog = AcceptanceWatchdog() if self.decoder.speculative else None
        self._traffic = decode_traffic(model, 0)  # a decode step's bytes, the KV cache's excepted
        self._cache_bytes_per_position = decode_traffic(model, 1).mla_cache
        self._active: weakref.ref[Generation] | None = None
        self.tp = model.tp
        self._following: dict[str, Any] | None = None  # a follower rank: the request rank 0 started

    @classmethod
    def from_pretrained(
        cls,
        path: str | Path,
        speculative: Any = None,
        cuda_graphs: bool = False,
        max_context: int = 4096,
        device: str | torch.device = "cpu",
        dtype: torch.dtype = torch.float32,
        progress: bool | None = None,
        tensor_parallel: Any = None,
        **fast_path: Any,
    ) -> Engine:
        """Load a checkpoint folder into the reference model, then install the fast path
        (`fast_path`: the fields of solo.fastpath.FastPathOptions: moe_backend, lm_head, block_fp8).
        `speculative` (a SpeculativeConfig) turns on NEXTN drafting; `cuda_graphs` captures the
        target steps over a pinned cache of `max_context` positions. `tensor_parallel` (a
        solo.distributed.TensorParallel from `init_tensor_parallel`) loads this rank's shard."""
        from solo.fastpath import load_accelerated

        model = load_accelerated(path, device, dtype, progress, tp=tensor_parallel, **fast_path)
        tokenizer = Tokenizer.from_dir(path, model.config.eos_token_id)
        decoder = None
        if speculative is not None:
            from solo.speculative.nextn import NextNDecoder

            decoder = NextNDecoder(model, speculative)
        engine = cls(model, tokenizer, decoder)
        if cuda_graphs:
            engine.enable_cuda_graphs(max_context)
        return engine

    def bytes_per_token(self, context: int) -> int:
        """Bytes one decode step reads and writes at `context` cached positions (solo.engine.traffic)."""
        return self._traffic.total + self._cache_bytes_per_position * context

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
            "decode_step": "fused" if self.model.decode_step is not None else "reference",
            "bytes_per_token_at_1k": self.bytes_per_token(1024),
            "tensor_parallel": self.tensor_parallel_report(),
        }

    def tensor_parallel_report(self) -> dict[str, Any] | None:
        """None in one process; else the world, the backend, this rank's shard and the collectives so far."""
        if not self.tp.enabled:
            return None
        return {  # (GPU event timings are added by the requests that recorded them: no synchronisation here)
            **self.tp.describe(),
            "moe_split": self.model.shard.experts,
            "shard": self.model.shard.describe(self.model.config),
            "collectives": self.tp.stats.to_dict(),
        }

    # ------------------------------------------------------------------ caches
    @property
    def cache_margin(self) -> int:
        """Extra positions a decoder may write past the last emitted token (verification windows)."""
        return self.decoder.window

    @property
    def max_positions(self) -> int:
        """Positions one request may use: the model's context, or the CUDA-graph cache if smaller."""
        limit = self.model.config.max_position_embeddings
        return min(limit, self.graphs_max_len) if self.graphs_max_len is not None else limit

    def max_new_tokens(self, prompt_tokens: int) -> int:
        """The most tokens a request with this prompt may generate (< 1: the prompt alone is too long)."""
        return self.max_positions - prompt_tokens - self.cache_margin

    def check_length(self, length: int) -> None:
        """Raise ValueError naming the limit when a request needs `length` cache positions."""
        limit = self.model.config.max_position_embeddings
        if length > limit:
            raise ValueError(
                f"prompt plus max_tokens needs {length} positions; the model supports {limit}. "
                "Shorten the prompt or lower max_tokens."
            )
        if self.graphs_max_len is not None and length > self.graphs_max_len:
            raise ValueError(
                f"prompt plus max_tokens needs {length} positions; the CUDA-graph cache holds "
                f"{self.graphs_max_len} (--max-context). Raise --max-context or shorten the request."
            )

    def _new_cache(self, length: int) -> HybridCache:
        """A cache for `length` positions, with the speculative decoder's verification history (lazy
        KDA rollbacks: solo.model.cache)."""
        window = getattr(self.decoder, "verify_window", None)
        config, model = self.model.config, self.model
        return HybridCache(config, length, model.device, model.dtype, True, self.tp.world, verify_window=window)

    def cache_for(self, length: int) -> HybridCache:
        self.check_length(length)
        if self._cache is None or self._cache.max_len < length:
            self._cache = self._new_cache(length)
        self._cache.reset()
        return self._cache

    def enable_cuda_graphs(self, max_len: int) -> None:
        """Pin one cache of `max_len` positions and capture the decoder's target steps on it."""
        if self.model.device.type != "cuda":
            raise ValueError("CUDA graphs need the model on a CUDA device (--device cuda).")
        self._cache = self._new_cache(max_len)
        self.graphs_max_len = max_len
        self.graphs = self.graphs or GraphCapture()
        self.decoder.capture_graphs(self._cache, self.graphs)
        self._cache.reset()

    # ------------------------------------------------------------------ generation
    def encode_prompt(self, prompt: str | list[int], chat: bool = False) -> list[int]:
        """Token ids of a prompt: text is encoded (with `chat`, as one user message of the Ling chat
        format, its content as plain text), ids are checked against the vocabulary."""
        if isinstance(prompt, str):
            tok = self.tokenizer
            ids = tok.chat_ids([{"role": "user", "content": prompt}]) if chat else tok.encode(prompt)
        else:
            ids = list(prompt)
        if not ids:
            raise ValueError("the prompt is empty; give at least one token of text.")
        vocab = self.model.config.vocab_size
        bad = [i for i in ids if not 0 <= i < vocab]
        if bad:
            raise ValueError(f"prompt token ids {bad[:5]} are outside the vocabulary [0, {vocab}).")
        return ids

    def _check_idle(self) -> None:
        active = self._active() if self._active is not None else None
        if active is not None and not active.done:
            raise EngineBusy(
                "the engine is serving another request (batch size 1): finish it or close() its Generation first."
            )

    def stream(self, prompt: str | list[int], params: GenerationParams | None = None, chat: bool = False) -> Generation:
        """Start a request: the prompt is checked now (a bad one raises here), tokens come as the
        returned `Generation` is iterated; its `result` is set when it ends."""
        self._check_idle()
        params = params or GenerationParams()
        ids = self.encode_prompt(prompt, chat)
        cache = self.cache_for(len(ids) + params.max_tokens + self.cache_margin)
        generation = Generation()
        generation._events = self._run(generation, ids, cache, params)
        self._active = weakref.ref(generation)
        return generation

    def generate(
        self, prompt: str | list[int], params: GenerationParams | None = None, chat: bool = False
    ) -> GenerationResult:
        return self.stream(prompt, params, chat).finish()

    @torch.inference_mode()
    def score(self, prompt: str | list[int], top: int = 0) -> list[PromptLogprob]:
        """Score a prompt (one prefill, no generation): per token, its log-probability given the
        tokens before it under the model's own distribution (temperature 1, no penalties) and the
        `top` most likely alternatives. The first token has none. This is what `echo` with
        `logprobs` and lm-evaluation-harness's loglikelihood requests read."""
        self._check_idle()
        if not 0 <= top <= LOGPROB_TOP:
            raise ValueError(f"top must be in [0, {LOGPROB_TOP}], got {top}")
        ids = self.encode_prompt(prompt)
        cache = self.cache_for(len(ids) + 1)
        if self.tp.enabled:
            self._begin(lockstep.request_message("score", type(self.decoder).__name__, ids, top=top))
        hidden = self.model.prefill(torch.tensor(ids, device=self.model.device), cache)
        out = [PromptLogprob(ids[0], None, None)]
        targets = torch.tensor(ids[1:], device=self.model.device)
        for begin in range(0, len(ids) - 1, SCORE_CHUNK):
            end = min(begin + SCORE_CHUNK, len(ids) - 1)  # hidden state i predicts token i + 1
            logprobs = torch.log_softmax(self.model.logits(hidden[begin:end]), -1)
            chosen = targets[begin:end]
            for row, token in zip(pack_logprobs(logprobs, chosen).tolist(), chosen.tolist(), strict=True):
                logprob, alternatives = unpack_logprobs(row)
                out.append(PromptLogprob(token, logprob, alternatives[:top]))
        return out

    @torch.inference_mode()
    def _run(
        self, generation: Generation, ids: list[int], cache: HybridCache, params: GenerationParams
    ) -> Iterator[StreamEvent]:
        if self.tp.enabled:  # every rank runs this request (rank 0's parameters: its seed)
            message = lockstep.request_message("stream", type(self.decoder).__name__, ids, params=params)
            try:
                params = self._begin(message)["params"]
            except BaseException:
                generation.done = True  # refused on every rank: the engine is free
                raise
        collectives = self.tp.stats.copy()
        stats = GenerationStats(prompt_tokens=len(ids))
        counts = AcceptanceCounter(self.decoder.num_draft_positions)
        eos = set() if params.ignore_eos else set(self.tokenizer.eos_ids)
        text = StreamDecoder(self.tokenizer)
        hold = max((len(s) for s in params.stop), default=1) - 1
        emitted = 0
        out_ids: list[int] = []
        finish = "cancelled"  # until the loop decides otherwise
        start = time.perf_counter()
        first_token_at = end = None
        prompt_tensor = torch.tensor(ids, device=self.model.device)
        want_logprobs = params.logprobs is not None
        rounds = self.decoder.rounds(prompt_tensor, cache, params.sampling, logprobs=want_logprobs)
        if self.tp.enabled:
            rounds = lockstep.lockstep_rounds(rounds, self.tp)
        try:
            for round_ in rounds:
                now = time.perf_counter()
                first_token_at = first_token_at or now
                self._count(round_, counts)
                finish = "length"
                for i, token in enumerate(round_.tokens):
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
                    finish = "cancelled"  # the caller may close() while this event is out
                    if want_logprobs and round_.logprobs is not None:
                        logprob, alternatives = round_.logprobs[i]
                        yield StreamEvent(token, piece, now - start, logprob, alternatives[: params.logprobs])
                    else:
                        yield StreamEvent(token, piece, now - start)
                    finish = "length"
                    if len(out_ids) >= params.max_tokens:
                        break
                if finish == "stop" or len(out_ids) >= params.max_tokens:
                    break
            end = time.perf_counter()
            if finish != "cancelled" and text.text[emitted:]:  # held back for a stop string, or partial UTF-8
                yield StreamEvent(out_ids[-1], text.text[emitted:], end - start, flush=True)
        finally:
            rounds.close()
            generation.done = True
            end = end or time.perf_counter()
            context = len(ids) + len(out_ids) // 2  # the mean position of the request's decode steps
            stats = _finish_stats(stats, out_ids, start, first_token_at, end, counts, self.bytes_per_token(context))
            if self.tp.enabled:
                stats.tensor_parallel = _collective_stats(self.tp, collectives, stats)
            generation.result = GenerationResult(text.text, out_ids, finish, stats)

    # ------------------------------------------------------------------ tensor parallelism
    def _begin(self, message: dict[str, Any]) -> dict[str, Any]:
        """A request starts on every rank: rank 0's, broadcast (checked against this rank's own in a
        program all ranks run); a following rank has it already."""
        if self._following is not None:
            message, self._following = self._following, None
            self.tp.agree(None, lockstep.STARTING)  # rank 0 and any other ranks running the program check theirs
            return message
        return lockstep.begin(self.tp, message)

    def follow_request(self, message: dict[str, Any]) -> None:
        """A follower rank runs the request rank 0 broadcast (solo.distributed.lockstep.follow)."""
        self._following = message
        try:
            if message["kind"] == "score":
                self.score(message["ids"], message["top"])
            else:
                self.stream(message["ids"], message["params"]).finish()
        finally:
            self._following = None

    def _count(self, round_: Round, counts: AcceptanceCounter) -> None:
        if not round_.drafted:
            return
        counts.record(round_.drafted, round_.accepted)
        self.acceptance.record(round_.drafted, round_.accepted)
        if self.watchdog is not None:
            self.watchdog.observe(round_.accepted + 1)


def _collective_stats(tp, before, stats: GenerationStats) -> dict[str, Any]:
    """The collectives one request ran on this rank, their time, and their share of the request's."""
    tp.resolve_timings()
    ran = tp.stats.since(before)
    out = ran.to_dict()
    tokens = max(stats.completion_tokens, 1)
    out["all_reduces_per_token"] = round(ran.all_reduces / tokens, 2)
    out["share_of_time"] = round(ran.seconds / stats.total_s, 4) if stats.total_s > 0 else None
    return out


def _find_stop(text: str, stops: tuple[str, ...], start: int) -> int | None:
    hits = [i for i in (text.find(s, max(start, 0)) for s in stops if s) if i >= 0]
    return min(hits) if hits else None


def _finish_stats(
    stats: GenerationStats,
    out_ids: list[int],
    start: float,
    first: float | None,
    end: float,
    counts: AcceptanceCounter,
    bytes_per_token: int | None,
) -> GenerationStats:
    stats.completion_tokens = len(out_ids)
    stats.total_s = end - start
    stats.ttft_s = (first or end) - start
    if len(out_ids) > 1:
        stats.tpot_s = (stats.total_s - stats.ttft_s) / (len(out_ids) - 1)
        stats.decode_tok_per_s = 1.0 / stats.tpot_s if stats.tpot_s > 0 else None
    if stats.decode_tok_per_s and bytes_per_token:
        stats.decode_gb_per_s = bytes_per_token * stats.decode_tok_per_s / 1e9
    if counts.positions:  # a speculative decoder: its acceptance, counted by the engine
        stats.verify_rounds = counts.rounds
        stats.drafted_tokens = counts.drafted
        stats.accepted_tokens = counts.accepted
        stats.accept_length = counts.accept_length
        stats.per_position_acceptance = counts.per_position()
        stats.accepted_per_position = list(counts.accepted_at)
    return stats

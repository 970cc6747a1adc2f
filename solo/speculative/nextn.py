"""NEXTN multi-token-prediction speculative decoding (chain drafts, one verification pass).

Round structure with S draft steps (`--speculative-num-steps`, default 3) and a window of S + 1
tokens (`--speculative-num-draft-tokens`, default 4):
  1. verify: the target processes [last token, d_1..d_S] in one forward, keeping per-token KDA
     states; target distributions p_1..p_{S+1} come from its S + 1 hidden states;
  2. accept: `accept_drafts` keeps a leading run of a drafts and draws the next token t;
     the round emits d_1..d_a, t;
  3. roll back: KDA states are set to those after the a + 1 kept tokens (MLA entries past them are
     masked by position and overwritten later);
  4. draft: the NEXTN layer processes the window's slots (token at position p + 1, target hidden
     at p) with the slot at a carrying t, which yields d'_1; S - 1 chained steps on the NEXTN's own
     hidden state give d'_2..d'_S.
Every shape is fixed by S, so the round needs no host synchronisation before its tokens are read.

Penalties and the logit bias (solo.engine.sampling.LogitAdjuster) are applied at every position of
the verification window and of the draft chain with the counts *at that position* (the generated
tokens plus the drafts before it), so target and draft see exactly what plain decoding would, and
acceptance stays lossless. Log-probabilities of emitted tokens are the target's, from the
verification logits (after the same adjustments).

The draft computes its logits with the target's LM head *module* (`draft_head`, the same object),
so whatever the head's quantization, draft and target agree on it.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from solo.engine.decoder import LogprobReader, Round, TokenReader, pick_token
from solo.engine.graphs import EagerStep, GraphCapture, graph_safe_generators
from solo.engine.sampling import (
    LOGPROB_TOP,
    CompiledDistribution,
    LogitAdjuster,
    SamplingParams,
    argmax_last,
    distribution_for,
    logprob_distribution,
    make_generator,
    pack_logprobs,
    sample_from,
    unpack_logprobs,
)
from solo.model.cache import HybridCache
from solo.model.ling import LingForCausalLM
from solo.quantization.lm_head import head_logits
from solo.speculative.acceptance import accept_drafts, accept_greedy

log = logging.getLogger("solo.speculative")


class SpeculationUnavailable(ValueError):
    """Speculation was requested but cannot run; the message says why and what to do."""


@dataclass(frozen=True)
class SpeculativeConfig:
    algorithm: str = "NEXTN"
    num_steps: int = 3
    num_draft_tokens: int = 4
    topk: int = 1

    def __post_init__(self) -> None:
        if self.algorithm.upper() not in ("NEXTN", "MTP"):
            raise SpeculationUnavailable(
                f"--speculative-algorithm {self.algorithm}: solo implements NEXTN (the checkpoint's own MTP layer)."
            )
        if self.topk != 1:
            raise SpeculationUnavailable("--speculative-eagle-topk must be 1: solo drafts a chain, not a tree.")
        if self.num_steps < 1:
            raise SpeculationUnavailable(f"--speculative-num-steps must be >= 1, got {self.num_steps}.")
        if self.num_draft_tokens != self.num_steps + 1:
            raise SpeculationUnavailable(
                f"--speculative-num-draft-tokens must be num-steps + 1 = {self.num_steps + 1} for a chain "
                f"(got {self.num_draft_tokens})."
            )


@dataclass
class RoundState:
    """What one round hands the next, in static buffers (graph inputs and outputs)."""

    window: torch.Tensor  # [S + 1]: the next verification's tokens, `last` then `drafts` (views of it)
    last: torch.Tensor  # [1] the last emitted token
    position: torch.Tensor  # [1] its position
    drafts: torch.Tensor  # [S] drafted tokens after it
    draft_probs: torch.Tensor  # [S, V] the distributions they were drawn from
    emitted: torch.Tensor  # [S + 2]: the verified drafts, the next token, the accepted count
    logprobs: torch.Tensor  # [S + 1, 1 + 2 * top]: packed log-probabilities per window position
    offsets: torch.Tensor  # [S + 1]: 0..S (the window's positions after `position`)

    @classmethod
    def allocate(cls, steps: int, model: LingForCausalLM) -> RoundState:
        device, vocab = model.device, model.config.vocab_size
        long = dict(dtype=torch.long, device=device)
        window = torch.zeros(steps + 1, **long)
        return cls(
            window=window,
            last=window[:1],
            position=torch.zeros(1, **long),
            drafts=window[1:],
            draft_probs=torch.zeros(steps, vocab, dtype=torch.float32, device=device),
            emitted=torch.zeros(steps + 2, **long),
            logprobs=torch.zeros(steps + 1, 1 + 2 * min(LOGPROB_TOP, vocab), dtype=torch.float32, device=device),
            offsets=torch.arange(steps + 1, **long),
        )


class NextNDecoder:
    speculative = True

    def __init__(self, model: LingForCausalLM, config: SpeculativeConfig | None = None) -> None:
        if model.nextn is None:
            raise SpeculationUnavailable(
                "speculative decoding needs the checkpoint's NEXTN layer (model.layers."
                f"{model.config.num_hidden_layers}.*), but this checkpoint has none. "
                "Run without --speculative-algorithm, or use a checkpoint that ships its MTP layer."
            )
        self.model = model
        self.config = config or SpeculativeConfig()
        self.draft_head = model.lm_head  # the module itself, never a copy of its weight tensor
        self.num_draft_positions = self.config.num_steps
        self.step = EagerStep(model)
        self.adjuster = LogitAdjuster(model.config.vocab_size, model.device)
        self._history: tuple[int, dict] | None = None
        self._state: tuple[int, RoundState] | None = None
        self.graphs: GraphCapture | None = None  # set by capture_graphs: rounds replay from graphs
        self._round_graphs: dict[tuple, tuple[torch.cuda.CUDAGraph, torch.Generator | None]] = {}
        self.round_replays = 0
        self.eager_sampled_rounds = False
        # what drafts and targets are drawn from (sampled rounds): compiled on a GPU (solo.engine.sampling)
        self.distribution = distribution_for(model.device)

    @property
    def window(self) -> int:
        """Positions a round may write past the last emitted token (the round in flight included)."""
        return 3 * self.config.num_draft_tokens

    @property
    def verify_window(self) -> int:
        """Tokens of a verification pass (a cache made with this `verify_window` can roll back lazily)."""
        return self.config.num_draft_tokens

    def history_for(self, cache: HybridCache) -> dict:
        """Per-token KDA states of a verification pass; persistent per cache (graphs point at it): the
        cache's own where it has one of this window."""
        own = cache.verification
        if own is not None and next(iter(own.values())).states.shape[0] == self.verify_window:
            return own
        if self._history is None or self._history[0] != id(cache):
            self._history = (id(cache), cache.new_history(self.verify_window))
        return self._history[1]

    def lazy_rollback(self, cache: HybridCache, history: dict) -> bool:
        """Whether the round's rollback may leave the KDA states in the cache's history: when they are
        the cache's own and the fused decode step runs both the verification and one-token steps, whose
        KDA kernel reads the states where the cache says (solo.model.cache)."""
        step = self.model.decode_step
        return history is cache.verification and step is not None and step.serves(self.verify_window)

    def capture_graphs(self, cache: HybridCache, graphs: GraphCapture) -> None:
        """Whole rounds (verify, accept, roll back, draft) replay from graphs, captured per sampling
        setting at the first request that uses it."""
        self.graphs = graphs
        self.state_for(cache)

    def draft_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return head_logits(self.draft_head, hidden)

    # ------------------------------------------------------------------ one round's pieces
    def draft_chain(self, first_hidden: torch.Tensor, state: RoundState, cache: HybridCache, params, generator) -> None:
        """From the NEXTN hidden state predicting `state.position` + 1, draft S tokens by chaining, into
        `state.drafts` and (sampling) their distributions into `state.draft_probs`; greedy decoding
        drafts each argmax and needs no distributions (greedy acceptance: `accept_greedy`)."""
        tokens, dists = [], []
        hidden = first_hidden
        counts = self.adjuster.counts if params.adjusted else None
        steps = self.config.num_steps
        ahead = state.position + state.offsets[1:steps]  # the positions the chain's NEXTN steps write
        for step in range(steps):
            logits = self.draft_logits(hidden)
            if counts is not None:
                logits = self.adjuster.apply(logits, counts)
            if params.greedy:
                token = argmax_last(logits)
            else:
                q = self.distribution(logits, params)
                token = sample_from(q, generator)
                dists.append(q)
            tokens.append(token)
            if step + 1 < steps:
                hidden = self.model.draft_forward(token, hidden, ahead[step : step + 1], cache)
                if counts is not None:  # the next draft position counts this draft
                    counts = counts.index_add(0, token, torch.ones_like(token, dtype=torch.float32))
        torch.cat(tokens, out=state.drafts)
        if dists:
            torch.cat(dists, out=state.draft_probs)

    def rounds(
        self, prompt_ids: torch.Tensor, cache: HybridCache, params: SamplingParams, logprobs: bool = False
    ) -> Iterator[Round]:
        model, device = self.model, self.model.device
        steps = self.config.num_steps
        generator = make_generator(params, device)
        state = self.state_for(cache)
        run_round = self._round_runner(cache, params, generator, logprobs)  # may capture (and reset the cache)
        adjuster = self.adjuster if params.adjusted else None
        if adjuster is not None:  # after any capture: its warm-up runs count tokens too
            adjuster.start(params)

        n = prompt_ids.numel()
        hidden = model.prefill(prompt_ids, cache)
        last, packed = pick_token(model.logits(hidden[-1:]), params, generator, adjuster, logprobs)
        yield Round([int(last.item())], logprobs=[unpack_logprobs(packed[0].tolist())] if logprobs else None)
        draft_hidden = model.draft_prefill(torch.cat([prompt_ids[1:], last]), hidden, cache)
        state.position.fill_(n)  # position of `last`
        self.draft_chain(draft_hidden[-1:], state, cache, params, generator)
        state.last.copy_(last)

        reader = TokenReader(device, steps + 2)
        lp_reader = LogprobReader(device, steps + 1, state.logprobs.shape[-1]) if logprobs else None
        run_round()
        while True:
            # the round's tokens are read back while the next round is already queued (its one host
            # synchronisation overlaps the GPU's work; a round past the last one read is harmless)
            reader.start(state.emitted)
            if lp_reader is not None:
                lp_reader.start(state.logprobs)
            run_round()
            emitted = reader.read()
            accepted = emitted[-1]
            rows = lp_reader.read_rows()[: accepted + 1] if lp_reader is not None else None
            yield Round(emitted[:accepted] + [emitted[steps]], drafted=steps, accepted=accepted, logprobs=rows)

    def graph_report(self) -> dict | None:
        """None when rounds run eagerly; else what was captured and how often it replayed."""
        if self.graphs is None:
            return None
        report = {
            "captured": "round (verify + accept + rollback + draft)",
            "graphs": len(self._round_graphs),
            "replays": self.round_replays,
        }
        if self.eager_sampled_rounds:
            report["sampled_rounds"] = "eager: no graph-safe generator registration in this torch"
        if isinstance(self.distribution, CompiledDistribution):
            report["distribution"] = {
                "compiled_settings": len(self.distribution.settings),
                "eager_settings": len(self.distribution.eager_settings),
            }
        return report

    def state_for(self, cache: HybridCache) -> RoundState:
        if self._state is None or self._state[0] != id(cache):
            self._state = (id(cache), RoundState.allocate(self.config.num_steps, self.model))
        return self._state[1]

    def round(
        self,
        state: RoundState,
        cache: HybridCache,
        params: SamplingParams,
        generator: torch.Generator | None,
        logprobs: bool = False,
    ) -> None:
        """One verification round, in place on `state`: verify [last, drafts], accept, roll the KDA
        states back, draft the next chain. `state.emitted` receives [drafts..., next token, accepted],
        `state.logprobs` (with `logprobs`) the target's log-probabilities of the window's tokens.
        Static shapes, no host synchronisation: safe to capture in a CUDA graph."""
        model, steps = self.model, self.config.num_steps
        history = self.history_for(cache)
        offsets = state.offsets
        positions = state.position + offsets
        verify_hidden, verify_logits = self.step(state.window, positions, cache, history)
        if params.adjusted:  # position i counts the drafts before it
            verify_logits = self.adjuster.apply(verify_logits, self.adjuster.window_counts(state.drafts))
        if params.greedy:  # the same outcome as accept_drafts on one-hot distributions, without them
            target_probs = None
            accepted, last = accept_greedy(verify_logits, state.drafts)
        else:
            target_probs = self.distribution(verify_logits, params)
            accepted, last = accept_drafts(target_probs[None], state.draft_probs[None], state.drafts[None], generator)
        keep = accepted + 1
        cache.rollback_kda(history, keep, lazy=self.lazy_rollback(cache, history))
        torch.cat([state.drafts, last, accepted], out=state.emitted)
        following = state.emitted[: steps + 1]  # the drafts, then the new token
        if params.adjusted or logprobs:
            # the token at each window position: the kept drafts, then the new token (repeated past it)
            kept = torch.where(offsets < accepted, following, last)
            if params.adjusted:
                self.adjuster.observe(kept, (offsets <= accepted).float())
            if logprobs:
                state.logprobs.copy_(pack_logprobs(logprob_distribution(verify_logits, target_probs, params), kept))

        slot_tokens = torch.where(offsets == accepted, last, following)
        draft_hidden = model.draft_forward(slot_tokens, verify_hidden, positions + 1, cache)
        first = draft_hidden.index_select(0, accepted)
        state.position.add_(keep)  # (the drafts and probabilities of this round are read by now)
        self.draft_chain(first, state, cache, params, generator)
        state.last.copy_(last)

    def _round_runner(
        self, cache: HybridCache, params: SamplingParams, generator: torch.Generator | None, logprobs: bool = False
    ):
        """The round as a callable: a CUDA-graph replay when graphs are on, else eager."""
        state = self.state_for(cache)
        if self.graphs is None or (generator is not None and not graph_safe_generators()):
            if self.graphs is not None:
                self.eager_sampled_rounds = True  # shown by graph_report(); no silent change
                log.warning("this torch cannot register a generator in a CUDA graph: sampled rounds run eagerly")
            return lambda: self.round(state, cache, params, generator, logprobs)
        # penalty and bias values live in the adjuster's buffers: only whether they apply shapes the graph
        key = (id(cache), params.temperature, params.top_k, params.top_p, generator is None, params.adjusted, logprobs)
        if key not in self._round_graphs:
            self._round_graphs[key] = self._capture_round(state, cache, params, generator, logprobs)
        graph, graph_generator = self._round_graphs[key]
        if graph_generator is not None:  # a new request's generator: its seed feeds the captured RNG
            graph_generator.graphsafe_set_state(generator.graphsafe_get_state())
        lazy = self.lazy_rollback(cache, self.history_for(cache))
        return self._replay_counter(graph, cache if lazy else None)

    def _replay_counter(self, graph: torch.cuda.CUDAGraph, lazy_cache: HybridCache | None = None):
        def replay() -> None:
            graph.replay()
            self.round_replays += 1
            if lazy_cache is not None:  # its rollback left the KDA states in the history (on the device)
                lazy_cache.kda_lazy = True

        return replay

    def _capture_round(
        self, state, cache, params, generator, logprobs: bool = False
    ) -> tuple[torch.cuda.CUDAGraph, torch.Generator | None]:
        """Capture the round (with its own registered generator when sampling). Warm-up runs
        scribble on the cache and state: reset afterwards (this runs before the request's prefill)."""
        assert self.graphs is not None
        graph_generator = None
        if generator is not None:
            graph_generator = torch.Generator(device=state.last.device)
            graph_generator.manual_seed(0)
        graph, _ = self.graphs.capture(
            lambda: self.round(state, cache, params, graph_generator, logprobs), graph_generator
        )
        cache.reset()
        return graph, graph_generator

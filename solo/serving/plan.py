"""From a validated request to the engine's work: prompts encoded, limits checked against the
context, generation parameters built, one `Choice` per prompt and per n. Runs in the request's
thread (tokenizing a long prompt never holds the engine or the event loop)."""

from __future__ import annotations

from dataclasses import dataclass, field

from solo.engine.engine import Engine, GenerationParams
from solo.engine.sampling import SamplingParams
from solo.serving.schemas import ApiError, ChatRequest, CompletionRequest, SamplingFields


@dataclass
class Choice:
    """One unit the engine worker runs: score the prompt (echo with logprobs) and/or generate."""

    index: int
    prompt: int  # which prompt of the request
    prompt_ids: list[int]
    params: GenerationParams | None  # None: nothing to generate (max_tokens 0: scoring only)
    score_top: int | None = None  # score the prompt, reporting this many alternatives per token


@dataclass
class Plan:
    chat: bool
    choices: list[Choice]
    prompt_ids: list[list[int]]
    echo: bool = False
    logprobs: int | None = None  # alternatives per token, None: no log-probabilities
    stream: bool = False
    include_usage: bool = False
    prompt_texts: list[str] = field(default_factory=list)


def plan_completion(req: CompletionRequest, engine: Engine, default_max_tokens: int) -> Plan:
    prompts = req.prompts()
    ids = [_encode(engine, p, f"prompt[{i}]" if len(prompts) > 1 else "prompt") for i, p in enumerate(prompts)]
    echo = bool(req.echo)
    choices = []
    n = req.n or 1
    for i, prompt_ids in enumerate(ids):
        for k in range(n):
            params = None
            if req.max_tokens != 0:
                params = _params(req, engine, len(prompt_ids), req.max_tokens, default_max_tokens, k, req.logprobs)
            score = req.logprobs if echo and req.logprobs is not None else None
            choices.append(Choice(i * n + k, i, prompt_ids, params, score))
    texts = [p if isinstance(p, str) else engine.tokenizer.decode(list(p), skip_special_tokens=False) for p in prompts]
    return Plan(False, choices, ids, echo, req.logprobs, bool(req.stream), req.include_usage, texts if echo else [])


def plan_chat(req: ChatRequest, engine: Engine, default_max_tokens: int) -> Plan:
    prompt_ids = engine.tokenizer.chat_ids(req.chat_messages())
    _check_ids(engine, prompt_ids, "messages")
    logprobs = (req.top_logprobs or 0) if req.logprobs else None
    n = req.n or 1
    limit = req.token_limit
    choices = [
        Choice(k, 0, prompt_ids, _params(req, engine, len(prompt_ids), limit, default_max_tokens, k, logprobs))
        for k in range(n)
    ]
    return Plan(True, choices, [prompt_ids], False, logprobs, bool(req.stream), req.include_usage)


def _encode(engine: Engine, prompt: str | list[int], where: str) -> list[int]:
    ids = engine.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
    _check_ids(engine, ids, where)
    return ids


def _check_ids(engine: Engine, ids: list[int], where: str) -> None:
    if not ids:
        raise ApiError(400, f"{where}: encodes to no tokens; give at least one token of text.", where)
    vocab = engine.model.config.vocab_size
    bad = [i for i in ids if not 0 <= i < vocab]
    if bad:
        raise ApiError(400, f"{where}: token ids {bad[:5]} are outside the vocabulary [0, {vocab}).", where)
    if len(ids) >= engine.max_positions:
        raise ApiError(
            400, f"{where}: {len(ids)} tokens; the model's context holds {engine.max_positions} positions.", where
        )


def _params(
    req: SamplingFields,
    engine: Engine,
    prompt_tokens: int,
    max_tokens: int | None,
    default_max_tokens: int,
    k: int,
    logprobs: int | None,
) -> GenerationParams:
    room = engine.max_new_tokens(prompt_tokens)
    if max_tokens is None:
        max_tokens = min(default_max_tokens, room)
        if max_tokens < 1:
            raise ApiError(
                400,
                f"prompt: {prompt_tokens} tokens leave no room to generate in the {engine.max_positions}-position "
                "context; shorten it.",
                "prompt",
            )
    elif max_tokens > room:
        raise ApiError(
            400,
            f"max_tokens: {max_tokens} with a {prompt_tokens}-token prompt needs "
            f"{prompt_tokens + max_tokens + engine.cache_margin} positions; the context holds {engine.max_positions} "
            f"(at most {max(room, 0)} new tokens for this prompt).",
            "max_tokens",
        )
    vocab = engine.model.config.vocab_size
    bias = req.bias_pairs
    outside = [t for t, _ in bias if t >= vocab]
    if outside:
        message = f"logit_bias: token ids {outside[:5]} are outside the vocabulary [0, {vocab})."
        raise ApiError(400, message, "logit_bias")
    seed = None if req.seed is None else (req.seed + k) % 2**64  # choice k of n: its own stream of draws
    try:
        sampling = SamplingParams(
            temperature=req.temperature if req.temperature is not None else 0.0,
            top_k=req.top_k or 0,
            top_p=req.top_p if req.top_p is not None else 1.0,
            seed=seed,
            presence_penalty=req.presence_penalty or 0.0,
            frequency_penalty=req.frequency_penalty or 0.0,
            logit_bias=bias,
        )
        return GenerationParams(max_tokens, sampling, req.stop_strings, bool(req.ignore_eos), logprobs)
    except ValueError as e:
        raise ApiError(400, str(e)) from e

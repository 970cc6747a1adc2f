"""Response bodies and server-sent-event chunks in the OpenAI shapes, built from the worker's events:
text completions (with echo and the legacy logprobs object) and chat completions (with the
``logprobs.content`` list), usage with solo's own statistics (``solo_stats``)."""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from solo.engine.engine import GenerationResult
from solo.serving.plan import Plan
from solo.serving.worker import Event, Finished, Scored, Token
from solo.tokenizer import Tokenizer


def sse(payload: dict[str, Any] | str) -> str:
    return f"data: {payload if isinstance(payload, str) else json.dumps(payload)}\n\n"


@dataclass
class Entry:
    """One token's log-probability record."""

    token_id: int
    logprob: float | None
    top: list[tuple[int, float]] | None
    offset: int


@dataclass
class ChoiceState:
    prompt: int
    text: str = ""
    entries: list[Entry] = field(default_factory=list)
    opened: bool = False  # the first chunk (chat: the role; echo: the prompt) was sent
    result: GenerationResult | None = None


class Formatter:
    """Accumulates one request's events; `chunks(event)` gives its stream's SSE lines, `body()` the
    final JSON of a non-streamed request."""

    def __init__(self, plan: Plan, tokenizer: Tokenizer, model_name: str) -> None:
        self.plan = plan
        self.tok = tokenizer
        self.model = model_name
        self.chat = plan.chat
        self.id = f"{'chatcmpl' if plan.chat else 'cmpl'}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.choices = {c.index: ChoiceState(c.prompt) for c in plan.choices}

    # ------------------------------------------------------------------ events
    def chunks(self, event: Event) -> list[str]:
        if isinstance(event, Scored):
            return self._scored(event)
        if isinstance(event, Token):
            return self._token(event)
        if isinstance(event, Finished):
            state = self.choices[event.index]
            out = self._open(event.index)
            state.result = event.result
            delta: dict[str, Any] = {"delta": {}} if self.chat else {"text": ""}
            return out + [self._chunk(event.index, delta, finish=event.result.finish_reason)]
        return []

    def end_chunks(self) -> list[str]:
        if not self.plan.include_usage:
            return []
        return [sse({**self._head(), "choices": [], "usage": self.usage()})]

    def _open(self, index: int) -> list[str]:
        """The choice's first chunk: the assistant role (chat), the echoed prompt (completions)."""
        state = self.choices[index]
        if state.opened:
            return []
        state.opened = True
        if self.chat:
            return [self._chunk(index, {"delta": {"role": "assistant", "content": ""}})]
        if self.plan.echo:
            prompt_text = self.plan.prompt_texts[state.prompt]
            state.text += prompt_text
            logprobs = self._logprobs(state.entries) if state.entries else None
            return [self._chunk(index, {"text": prompt_text, "logprobs": logprobs})]
        return []

    def _scored(self, event: Scored) -> list[str]:
        state = self.choices[event.index]
        offset = 0
        for p in event.prompt:
            state.entries.append(Entry(p.token_id, p.logprob, p.top_logprobs, offset))
            offset += len(self.tok.token_text(p.token_id))
        return self._open(event.index)

    def _token(self, event: Token) -> list[str]:
        out = self._open(event.index)
        state, ev = self.choices[event.index], event.event
        entry = None
        if ev.logprob is not None and not ev.flush:
            entry = Entry(ev.token_id, ev.logprob, ev.top_logprobs, len(state.text))
            state.entries.append(entry)
        state.text += ev.text
        if not ev.text and entry is None:
            return out
        logprobs = self._logprobs([entry]) if entry is not None else None
        if self.chat:
            return out + [self._chunk(event.index, {"delta": {"content": ev.text}, "logprobs": logprobs})]
        return out + [self._chunk(event.index, {"text": ev.text, "logprobs": logprobs})]

    # ------------------------------------------------------------------ shapes
    def _head(self) -> dict[str, Any]:
        kind = "chat.completion.chunk" if self.chat else "text_completion"
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model}

    def _chunk(self, index: int, fields: dict[str, Any], finish: str | None = None) -> str:
        choice = {"index": index, **fields, "finish_reason": finish}
        if "logprobs" not in choice:
            choice["logprobs"] = None
        body = {**self._head(), "choices": [choice]}
        if self.plan.include_usage:
            body["usage"] = None
        return sse(body)

    def _logprobs(self, entries: list[Entry]) -> dict[str, Any]:
        if self.chat:
            return {"content": [self._chat_entry(e) for e in entries], "refusal": None}
        tops = []
        for e in entries:
            if e.top is None:
                tops.append(None)
                continue
            top: dict[str, float] = {}
            for token, lp in e.top:
                top.setdefault(self.tok.token_text(token), lp)  # most likely first: keep the first of equal texts
            tops.append(top)
        return {
            "tokens": [self.tok.token_text(e.token_id) for e in entries],
            "token_logprobs": [e.logprob for e in entries],
            "top_logprobs": tops,
            "text_offset": [e.offset for e in entries],
        }

    def _chat_entry(self, e: Entry) -> dict[str, Any]:
        def one(token: int, lp: float | None) -> dict[str, Any]:
            return {"token": self.tok.token_text(token), "logprob": lp, "bytes": self.tok.token_bytes(token)}

        return {**one(e.token_id, e.logprob), "top_logprobs": [one(t, lp) for t, lp in e.top or []]}

    def usage(self) -> dict[str, Any]:
        results = [s.result for _, s in sorted(self.choices.items()) if s.result is not None]
        prompt = sum(len(ids) for ids in self.plan.prompt_ids)
        completion = sum(len(r.token_ids) for r in results)
        usage: dict[str, Any] = {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
        }
        stats = [r.stats.to_dict() for r in results]
        if len(stats) == 1:
            usage["solo_stats"] = stats[0]
        else:
            usage["solo_stats_per_choice"] = stats
        return usage

    def body(self) -> dict[str, Any]:
        """The whole response of a non-streamed request (every choice finished)."""
        choices = []
        for index, state in sorted(self.choices.items()):
            result = state.result
            assert result is not None
            logprobs = self._logprobs(state.entries) if self.plan.logprobs is not None else None
            if self.chat:
                message = {"role": "assistant", "content": result.text}
                choices.append(
                    {"index": index, "message": message, "logprobs": logprobs, "finish_reason": result.finish_reason}
                )
            else:
                text = (self.plan.prompt_texts[state.prompt] if self.plan.echo else "") + result.text
                choices.append(
                    {"index": index, "text": text, "logprobs": logprobs, "finish_reason": result.finish_reason}
                )
        kind = "chat.completion" if self.chat else "text_completion"
        return {
            "id": self.id,
            "object": kind,
            "created": self.created,
            "model": self.model,
            "choices": choices,
            "usage": self.usage(),
        }

"""OpenAI-compatible HTTP API for one engine: /v1/completions, /v1/chat/completions (both with
streaming), /v1/models, /health and /metrics (acceptance statistics, the watchdog's warnings).

Batch size is 1 by design: requests are served one at a time, in arrival order, so each gets the
whole machine. Malformed requests get a 400 with a message naming the problem.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
import uuid
from collections.abc import Iterator
from typing import Any, Literal

from fastapi import FastAPI, HTTPException, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from pydantic import BaseModel, Field

from solo.engine.engine import Engine, GenerationParams
from solo.engine.sampling import SamplingParams
from solo.tokenizer import Tokenizer


class SamplingFields(BaseModel):
    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=0.0, ge=0.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=0, ge=0)
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    ignore_eos: bool = False


class CompletionRequest(SamplingFields):
    prompt: str | list[int]


class ChatMessage(BaseModel):
    role: Literal["system", "user", "assistant", "human"]
    content: str


class ChatRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)


def build_app(engine: Engine, model_name: str, default_max_tokens: int = 256) -> FastAPI:
    app = FastAPI(title="solo", version="0.1.0")
    lock = threading.Lock()  # one request at a time: batch size 1
    served = {"requests": 0, "tokens": 0}

    @app.exception_handler(RequestValidationError)
    async def bad_request(_: Request, exc: RequestValidationError) -> JSONResponse:
        problems = "; ".join(f"{'.'.join(str(p) for p in e['loc'][1:])}: {e['msg']}" for e in exc.errors())
        return JSONResponse(status_code=400, content=_error(f"invalid request: {problems}"))

    @app.exception_handler(HTTPException)
    async def http_error(_: Request, exc: HTTPException) -> JSONResponse:
        return JSONResponse(status_code=exc.status_code, content=_error(str(exc.detail)))

    def params_of(req: SamplingFields) -> GenerationParams:
        stop = (req.stop,) if isinstance(req.stop, str) else tuple(req.stop or ())
        try:
            sampling = SamplingParams(req.temperature, req.top_k, req.top_p, req.seed)
            return GenerationParams(req.max_tokens or default_max_tokens, sampling, stop, req.ignore_eos)
        except ValueError as e:
            raise HTTPException(400, str(e)) from e

    def check_model(req: SamplingFields) -> None:
        if req.model not in (None, model_name):
            raise HTTPException(404, f"model '{req.model}' is not served here; this server serves '{model_name}'.")

    def generate_events(prompt, params: GenerationParams) -> Iterator[tuple[str, Any]]:
        with lock:
            try:
                generation = engine.stream(prompt, params)
                for event in generation:
                    yield "token", event
            except ValueError as e:
                yield "error", str(e)
                return
            result = generation.result
            served["requests"] += 1
            served["tokens"] += len(result.token_ids)
            yield "done", result

    def run_to_end(prompt, params):
        for kind, payload in generate_events(prompt, params):
            if kind == "error":
                raise HTTPException(400, payload)
            if kind == "done":
                return payload
        raise HTTPException(500, "generation ended without a result")

    def usage(result) -> dict[str, Any]:
        s = result.stats
        return {
            "prompt_tokens": s.prompt_tokens,
            "completion_tokens": s.completion_tokens,
            "total_tokens": s.prompt_tokens + s.completion_tokens,
            "solo_stats": s.to_dict(),
        }

    def stream_response(prompt, params, chat: bool) -> StreamingResponse:
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        created = int(time.time())
        kind_name = "chat.completion.chunk" if chat else "text_completion"

        def chunk(text: str | None, finish: str | None, extra: dict | None = None) -> str:
            if chat:
                delta = {} if text is None else {"content": text}
                choice = {"index": 0, "delta": delta, "finish_reason": finish}
            else:
                choice = {"index": 0, "text": text or "", "finish_reason": finish}
            body = {"id": rid, "object": kind_name, "created": created, "model": model_name, "choices": [choice]}
            body.update(extra or {})
            return f"data: {json.dumps(body)}\n\n"

        def body() -> Iterator[str]:
            if chat:
                yield f"data: {json.dumps({'id': rid, 'object': kind_name, 'created': created, 'model': model_name, 'choices': [{'index': 0, 'delta': {'role': 'assistant'}, 'finish_reason': None}]})}\n\n"  # noqa: E501
            for kind, payload in generate_events(prompt, params):
                if kind == "token" and payload.text:
                    yield chunk(payload.text, None)
                elif kind == "error":
                    yield f"data: {json.dumps(_error(payload))}\n\n"
                elif kind == "done":
                    yield chunk(None if chat else "", payload.finish_reason, {"usage": usage(payload)})
            yield "data: [DONE]\n\n"

        return StreamingResponse(body(), media_type="text/event-stream")

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest):
        check_model(req)
        params = params_of(req)
        if req.stream:
            return stream_response(req.prompt, params, chat=False)
        result = await asyncio.to_thread(run_to_end, req.prompt, params)
        return {
            "id": f"cmpl-{uuid.uuid4().hex}",
            "object": "text_completion",
            "created": int(time.time()),
            "model": model_name,
            "usage": usage(result),
            "choices": [{"index": 0, "text": result.text, "finish_reason": result.finish_reason, "logprobs": None}],
        }

    @app.post("/v1/chat/completions")
    async def chat_completions(req: ChatRequest):
        check_model(req)
        params = params_of(req)
        prompt = Tokenizer.chat_prompt([m.model_dump() for m in req.messages])
        if req.stream:
            return stream_response(prompt, params, chat=True)
        result = await asyncio.to_thread(run_to_end, prompt, params)
        return {
            "id": f"chatcmpl-{uuid.uuid4().hex}",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": model_name,
            "usage": usage(result),
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": result.text},
                    "finish_reason": result.finish_reason,
                }
            ],
        }

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model_name, "object": "model", "owned_by": "solo"}]}

    @app.get("/health")
    async def health():
        return {"status": "ok", "engine": engine.describe()}

    @app.get("/metrics", response_class=PlainTextResponse)
    async def metrics():
        lines = [f"solo_requests_total {served['requests']}", f"solo_generated_tokens_total {served['tokens']}"]
        totals, watchdog = engine.acceptance, engine.watchdog
        if watchdog is not None:
            lines += [
                f"solo_spec_verify_rounds_total {totals.rounds}",
                f"solo_spec_draft_tokens_total {totals.drafted}",
                f"solo_spec_accepted_tokens_total {totals.accepted}",
                f"solo_spec_accept_length {totals.accept_length or 0:.4f}",
                f"solo_spec_rolling_accept_length {watchdog.rolling_accept_length or 0:.4f}",
                f"solo_spec_low_acceptance_warnings_total {watchdog.warnings}",
            ]
            lines += [
                f'solo_spec_position_acceptance{{position="{i}"}} {r:.4f}' for i, r in enumerate(totals.per_position())
            ]
        return "\n".join(lines) + "\n"

    return app


def _error(message: str) -> dict[str, Any]:
    return {"error": {"message": message, "type": "invalid_request_error"}}

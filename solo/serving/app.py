"""The OpenAI-compatible HTTP API for one engine: /v1/completions and /v1/chat/completions (streamed
or not), /v1/models, the vLLM-style /tokenize, /detokenize and /tokenizer_info (what
lm-evaluation-harness's remote tokenizer reads), /health and /metrics.

Batch size is 1 by design: the engine worker (solo.serving.worker) serves requests one at a time in
arrival order. A handler validates and plans its request completely (solo.serving.schemas,
solo.serving.plan) before it queues anything or sends a byte, then only awaits the worker's events.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException

from solo.engine.engine import Engine
from solo.serving.guard import Limits, RequestGuard
from solo.serving.metrics import CONTENT_TYPE, ServerMetrics
from solo.serving.plan import Plan, plan_chat, plan_completion
from solo.serving.responses import Formatter, sse
from solo.serving.schemas import (
    ApiError,
    ChatRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
    error_body,
    parse_body,
)
from solo.serving.worker import Done, EngineWorker, Failed, Job

log = logging.getLogger("solo.serving")


@dataclass
class ServeOptions:
    model_name: str = "solo"
    default_max_tokens: int = 256  # when a request gives no max_tokens (capped by the context)
    max_queue: int | None = None  # requests that may wait for the engine; the next gets a 429
    request_timeout_s: float | None = None  # arrival to last token; past it a 504 (or an error event)
    api_key: str | None = None
    limits: Limits = field(default_factory=Limits)


def build_app(
    engine: Engine, model_name: str = "solo", default_max_tokens: int = 256, options: ServeOptions | None = None
) -> FastAPI:
    opts = options or ServeOptions(model_name=model_name, default_max_tokens=default_max_tokens)
    metrics = ServerMetrics(engine)
    worker = EngineWorker(engine, metrics, opts.max_queue)

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI):
        worker.start()
        try:
            yield
        finally:
            worker.shutdown()
            await asyncio.to_thread(worker.join, 10.0)

    app = FastAPI(title="solo", version="0.1.0", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.worker = worker
    app.state.metrics = metrics
    app.add_middleware(RequestGuard, limits=opts.limits, metrics=metrics, api_key=opts.api_key)

    # ------------------------------------------------------------------ errors, all in the OpenAI shape
    @app.exception_handler(ApiError)
    async def api_error(_: Request, exc: ApiError) -> JSONResponse:
        return JSONResponse(status_code=exc.status, content=exc.body(), headers=exc.headers)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        if exc.status_code == 404:
            message = (
                f"no route {request.method} {request.url.path}; solo serves /v1/completions, "
                "/v1/chat/completions, /v1/models, /tokenize, /detokenize, /tokenizer_info, /health, /metrics."
            )
        elif exc.status_code == 405:
            message = f"method {request.method} is not allowed on {request.url.path}."
        else:
            message = str(exc.detail)
        return JSONResponse(status_code=exc.status_code, content=error_body(message), headers=exc.headers)

    @app.exception_handler(RequestValidationError)
    async def validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
        return JSONResponse(status_code=400, content=error_body(f"invalid request: {exc.errors()}"))

    @app.exception_handler(Exception)
    async def internal_error(_: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error", exc_info=exc)
        return JSONResponse(
            status_code=500, content=error_body(f"internal error: {type(exc).__name__}", "server_error")
        )

    # ------------------------------------------------------------------ generation
    def check_model(name: str | None) -> None:
        if name not in (None, opts.model_name):
            raise ApiError(
                404,
                f"model '{name}' is not served here; this server serves '{opts.model_name}'.",
                param="model",
                code="model_not_found",
            )

    def planned_completion(raw: bytes) -> Plan:
        req = parse_body(CompletionRequest, raw)
        check_model(req.model)
        return plan_completion(req, engine, opts.default_max_tokens)

    def planned_chat(raw: bytes) -> Plan:
        req = parse_body(ChatRequest, raw)
        check_model(req.model)
        return plan_chat(req, engine, opts.default_max_tokens)

    async def respond(plan: Plan, request: Request) -> Response:
        job = worker.submit(plan, asyncio.get_running_loop(), opts.request_timeout_s)
        fmt = Formatter(plan, engine.tokenizer, opts.model_name)
        if plan.stream:
            return JobStream(job, _stream(job, fmt))
        return await _collect(job, fmt, request)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        plan = await run_in_threadpool(planned_completion, await request.body())
        return await respond(plan, request)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        plan = await run_in_threadpool(planned_chat, await request.body())
        return await respond(plan, request)

    # ------------------------------------------------------------------ models, tokenizer, health, metrics
    def model_card() -> dict[str, Any]:
        return {
            "id": opts.model_name,
            "object": "model",
            "created": 0,
            "owned_by": "solo",
            "max_model_len": engine.max_positions,
        }

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str) -> dict[str, Any]:
        check_model(model_id)
        return model_card()

    @app.post("/tokenize")
    async def tokenize(request: Request) -> dict[str, Any]:
        req = parse_body(TokenizeRequest, await request.body())
        check_model(req.model)
        if (req.prompt is None) == (req.messages is None):
            raise ApiError(400, "give exactly one of prompt and messages.", "prompt")
        if req.prompt is not None:
            ids = await run_in_threadpool(engine.tokenizer.encode, req.prompt)
        else:
            messages = [{"role": m.role, "content": m.text(i)} for i, m in enumerate(req.messages or [])]
            ids = await run_in_threadpool(engine.tokenizer.chat_ids, messages)
        return {"tokens": ids, "count": len(ids), "max_model_len": engine.max_positions}

    @app.post("/detokenize")
    async def detokenize(request: Request) -> dict[str, Any]:
        req = parse_body(DetokenizeRequest, await request.body())
        check_model(req.model)
        vocab = engine.model.config.vocab_size
        bad = [t for t in req.tokens if not 0 <= t < vocab]
        if bad:
            raise ApiError(400, f"tokens: ids {bad[:5]} are outside the vocabulary [0, {vocab}).", "tokens")
        return {"prompt": engine.tokenizer.decode(req.tokens, skip_special_tokens=False)}

    @app.get("/tokenizer_info")
    async def tokenizer_info() -> dict[str, Any]:
        tok = engine.tokenizer
        eos = tok.token_text(tok.eos_ids[0]) if tok.eos_ids else None
        return {
            "tokenizer_class": "solo.tokenizer.Tokenizer",
            "eos_token": eos,
            "bos_token": None,
            "pad_token": None,
            "chat_template": None,
            "model_max_length": engine.max_positions,
            "vocab_size": engine.model.config.vocab_size,
        }

    @app.get("/health")
    async def health() -> JSONResponse:
        closing = worker.closing
        body = {
            "status": "shutting_down" if closing else "ok",
            "queue_length": worker.queue_length,
            "busy": worker.busy,
            "engine": engine.describe(),
        }
        return JSONResponse(status_code=503 if closing else 200, content=body)

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(metrics.text(), media_type=CONTENT_TYPE)

    return app


class JobStream(StreamingResponse):
    """A streamed response that cancels its job however the stream ends (a client that disconnects,
    a send that fails, the task cancelled at shutdown); a no-op once the job finished."""

    def __init__(self, job: Job, content) -> None:
        super().__init__(content, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        self.job = job

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.job.cancel("disconnect")


async def _stream(job: Job, fmt: Formatter):
    while True:
        event = await job.next_event()
        if isinstance(event, Failed):
            yield sse(error_body(event.message, event.type))
            break
        if isinstance(event, Done):
            for chunk in fmt.end_chunks():
                yield chunk
            break
        for chunk in fmt.chunks(event):
            yield chunk
    yield sse("[DONE]")


async def _collect(job: Job, fmt: Formatter, request: Request) -> Response:
    """Await a non-streamed job; a client that disconnects cancels it."""

    async def watch() -> None:
        while True:
            message = await request.receive()
            if message["type"] == "http.disconnect":
                job.cancel("disconnect")
                return

    watcher = asyncio.create_task(watch())
    try:
        while True:
            event = await job.next_event()
            if isinstance(event, Failed):
                return JSONResponse(status_code=event.status, content=error_body(event.message, event.type))
            if isinstance(event, Done):
                return JSONResponse(content=fmt.body())
            fmt.chunks(event)
    finally:
        watcher.cancel()
        job.cancel("disconnect")  # a no-op when it finished; else this handler was cancelled

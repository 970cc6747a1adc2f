"""The ASGI layer in front of the routes: size and time limits on what a client sends, Bearer
authentication, and the count of responses by status.

Before a route runs, the whole body is read here within `body_timeout_s` (a body shorter than its
Content-Length, or one trickled byte by byte, gets a 408 and the connection is closed) and at most
`max_body_bytes` of it (413, after reading and dropping the rest up to 8x the limit, so that a client
still sending reads the answer instead of a reset). Headers beyond `max_header_bytes` get a 431. Every refusal is a JSON
error in the OpenAI shape. After the body, the route's `receive` passes straight through, so a
client's disconnect still reaches the route (which cancels its job).
"""

from __future__ import annotations

import asyncio
import hmac
import json
from dataclasses import dataclass

from solo.serving.metrics import ServerMetrics
from solo.serving.schemas import error_body

OPEN_PATHS = ("/health", "/metrics")  # never behind --api-key (health checks, Prometheus scrapes)


@dataclass(frozen=True)
class Limits:
    max_body_bytes: int = 8 * 1024 * 1024
    body_timeout_s: float = 10.0
    max_header_bytes: int = 16 * 1024


class RequestGuard:
    def __init__(self, app, limits: Limits, metrics: ServerMetrics, api_key: str | None = None) -> None:
        self.app = app
        self.limits = limits
        self.metrics = metrics
        self.api_key = api_key.encode() if api_key else None

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope.get("path", "")

        async def counted(message) -> None:
            if message["type"] == "http.response.start":
                self.metrics.response(path, message["status"])
            await send(message)

        headers = scope.get("headers", [])
        limits = self.limits
        if sum(len(k) + len(v) + 4 for k, v in headers) > limits.max_header_bytes:
            return await reply(counted, 431, f"request headers exceed {limits.max_header_bytes} bytes.")
        if self.api_key is not None and path not in OPEN_PATHS and not self._authorized(headers):
            return await reply(
                counted,
                401,
                "missing or wrong API key: send the header 'Authorization: Bearer <key>' (solo serve --api-key).",
                type="authentication_error",
                code="invalid_api_key",
                headers={"WWW-Authenticate": "Bearer"},
            )
        length = _header(headers, b"content-length")
        if length is not None:
            if not length.isdigit():
                return await reply(counted, 400, f"Content-Length {length[:40]!r} is not a number.", close=True)
            if int(length) > limits.max_body_bytes:
                await _drain(receive, limits, asyncio.get_running_loop().time() + limits.body_timeout_s)
                return await reply(
                    counted, 413, f"the body ({length} bytes) exceeds {limits.max_body_bytes} bytes.", close=True
                )
        body = bytearray()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + limits.body_timeout_s
        while True:
            try:
                message = await asyncio.wait_for(receive(), max(0.0, deadline - loop.time()))
            except asyncio.TimeoutError:
                return await reply(
                    counted,
                    408,
                    f"the body did not arrive within {limits.body_timeout_s:g} s (shorter than its Content-Length?).",
                    close=True,
                )
            if message["type"] == "http.disconnect":
                return None  # the client left before its request was complete
            body += message.get("body", b"")
            if len(body) > limits.max_body_bytes:
                if message.get("more_body", False):
                    await _drain(receive, limits, deadline)
                return await reply(counted, 413, f"the body exceeds {limits.max_body_bytes} bytes.", close=True)
            if not message.get("more_body", False):
                break
        replayed = False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": bytes(body), "more_body": False}
            return await receive()

        await self.app(scope, replay, counted)

    def _authorized(self, headers) -> bool:
        value = _header(headers, b"authorization") or ""
        scheme, _, token = value.partition(" ")
        return scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), self.api_key or b"")


DRAIN_FACTOR = 8  # an oversized body is read (and dropped) up to 8x the limit before the 413


async def _drain(receive, limits: Limits, deadline: float) -> None:
    """Read and drop the rest of an oversized body, so that a client still sending it reads the 413
    instead of a connection reset; bounded in bytes and time, after which the connection is closed
    unread."""
    loop = asyncio.get_running_loop()
    budget = DRAIN_FACTOR * limits.max_body_bytes
    while budget > 0:
        try:
            message = await asyncio.wait_for(receive(), max(0.0, deadline - loop.time()))
        except asyncio.TimeoutError:
            return
        if message["type"] != "http.request" or not message.get("more_body", False):
            return
        budget -= len(message.get("body", b""))


def _header(headers, name: bytes) -> str | None:
    for k, v in headers:
        if k.lower() == name:
            return v.decode("latin-1")
    return None


async def reply(
    send,
    status: int,
    message: str,
    type: str = "invalid_request_error",
    code: str | None = None,
    headers: dict[str, str] | None = None,
    close: bool = False,
) -> None:
    """A complete JSON error response (with Connection: close when the rest of the body is unread)."""
    payload = json.dumps(error_body(message, type, None, code)).encode()
    raw = [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode())]
    raw += [(k.lower().encode(), v.encode()) for k, v in (headers or {}).items()]
    if close:
        raw.append((b"connection", b"close"))
    await send({"type": "http.response.start", "status": status, "headers": raw})
    await send({"type": "http.response.body", "body": payload, "more_body": False})

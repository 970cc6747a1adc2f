"""Running the API: the listening socket is bound before the model loads (a port in use is reported
at once), uvicorn is configured with bounded headers (in size and in time) and keep-alive, and
SIGTERM/SIGINT first stop the engine worker (queued requests get a 503, the running one stops at its
next round) so the server exits promptly instead of waiting for long streams."""

from __future__ import annotations

import asyncio
import socket
import sys

import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from solo.serving.app import ServeOptions, build_app

__all__ = ["PortInUse", "ServeOptions", "bind", "build_app", "make_server", "serve"]


class PortInUse(ValueError):
    """The port cannot be bound; the message says which and what to do."""


def bind(host: str, port: int) -> socket.socket:
    """A listening socket on host:port (SO_REUSEADDR, as uvicorn sets it), or PortInUse."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        message = f"cannot listen on {host}:{port}: {e.strerror or e}. Pick another --port or stop what uses it."
        raise PortInUse(message) from None
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


class HeaderDeadlineProtocol(H11Protocol):
    """uvicorn's h11 protocol, closing a connection whose next request's headers are not complete
    within `header_timeout_s` of its opening or of its previous response: a client that trickles
    headers cannot hold a connection (bodies have their own deadline, solo.serving.guard)."""

    header_timeout_s = 10.0
    _header_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self._arm_header_deadline()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._arm_header_deadline()

    def connection_lost(self, exc) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
        super().connection_lost(exc)

    def _arm_header_deadline(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
        if not self.transport.is_closing():
            self._header_timer = self.loop.call_later(self.header_timeout_s, self._header_deadline)

    def _header_deadline(self) -> None:
        between_requests = self.cycle is None or self.cycle.response_complete
        if between_requests and not self.transport.is_closing():
            self.transport.close()


class _Server(uvicorn.Server):
    """uvicorn's server; an exit signal also shuts the engine worker down (on the event loop)."""

    def __init__(self, config: uvicorn.Config, app) -> None:
        super().__init__(config)
        self._app = app
        self._loop: asyncio.AbstractEventLoop | None = None

    async def serve(self, sockets=None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets=sockets)

    def handle_exit(self, sig, frame) -> None:
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._app.state.worker.shutdown)
        super().handle_exit(sig, frame)


def make_server(engine, options: ServeOptions, log_level: str = "info") -> _Server:
    """The uvicorn server for `engine` (h11 with bounded headers, short keep-alive, a bounded graceful
    shutdown); `run(sockets=[...])` serves until an exit signal or `should_exit`."""
    app = build_app(engine, options=options)
    protocol = type("Protocol", (HeaderDeadlineProtocol,), {"header_timeout_s": options.limits.body_timeout_s})
    config = uvicorn.Config(
        app,
        http=protocol,
        h11_max_incomplete_event_size=max(64 * 1024, 4 * options.limits.max_header_bytes),
        timeout_keep_alive=5,
        timeout_graceful_shutdown=10,
        log_level=log_level,
        access_log=False,
    )
    return _Server(config, app)


def serve(engine, sock: socket.socket, options: ServeOptions, log_level: str = "info") -> None:
    server = make_server(engine, options, log_level)
    host, port = sock.getsockname()[:2]
    print(f"solo serve: {options.model_name} on http://{host}:{port}/v1 (Ctrl-C or SIGTERM stops)", file=sys.stderr)
    server.run(sockets=[sock])
    # the engine is the caller's again only once its worker thread has ended (under tensor parallelism
    # the caller then releases the other ranks, from this thread)
    server._app.state.worker.join()

"""Running the API: the listening socket is bound before the model loads (a port in use is reported
at once), uvicorn is configured with bounded headers and keep-alive, and SIGTERM/SIGINT first stop
the engine worker (queued requests get a 503, the running one stops at its next round) so the
server exits promptly instead of waiting for long streams."""

from __future__ import annotations

import asyncio
import socket
import sys

import uvicorn

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
    config = uvicorn.Config(
        app,
        http="h11",
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

"""Helpers for the server tests: a `solo serve` subprocess, an in-process server on a thread, raw
HTTP. Every wait is bounded."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(base: str, proc: subprocess.Popen | None = None, timeout_s: float = 240) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"solo serve exited ({proc.returncode}): {proc.stderr.read() if proc.stderr else ''}")
        try:
            if httpx.get(f"{base}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.25)
    raise TimeoutError(f"{base} did not become healthy in {timeout_s} s")


class SoloServe:
    """`python -m solo.cli serve ARGS` on a free port; `stop()` sends SIGTERM and returns the seconds
    it took to exit (SIGKILL after `timeout_s`)."""

    def __init__(self, *args: str, env: dict[str, str] | None = None) -> None:
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        full_env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", **(env or {})}
        self.log = open(os.devnull, "w")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "solo.cli", "serve", "--port", str(self.port), *args],
            stdout=self.log,
            stderr=subprocess.PIPE,
            text=True,
            env=full_env,
        )
        try:
            wait_healthy(self.base, self.proc)
        except BaseException:
            self.stop()
            raise

    def stop(self, timeout_s: float = 30) -> float:
        start = time.monotonic()
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self.log.close()
        if self.proc.stderr is not None:
            self.proc.stderr.close()
        return time.monotonic() - start


class ThreadServer:
    """The same server `solo serve` runs (solo.serving.server.make_server), on a thread of this
    process, on a free port (no signals: `close()` stops it)."""

    def __init__(self, engine, options) -> None:
        from solo.serving.server import bind, make_server

        self.sock = bind("127.0.0.1", 0)
        self.base = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.server = make_server(engine, options, log_level="warning")
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 60
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("the in-process server did not start")
            time.sleep(0.05)

    @property
    def app(self):
        return self.server.config.app

    def close(self) -> None:
        self.app.state.worker.shutdown()
        self.server.should_exit = True
        self.thread.join(30)
        self.sock.close()
        assert not self.thread.is_alive(), "the in-process server did not stop"


def raw_http(port: int, data: bytes, timeout_s: float = 15) -> bytes:
    """Send raw bytes, read until the server closes or the timeout; the bytes received."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout_s) as s:
        s.sendall(data)
        chunks = []
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                chunk = s.recv(65536)
            except TimeoutError:
                break
            if not chunk:
                break
            chunks.append(chunk)
            if b"\r\n\r\n" in b"".join(chunks) and _complete(b"".join(chunks)):
                break
        return b"".join(chunks)


def _complete(response: bytes) -> bool:
    head, _, body = response.partition(b"\r\n\r\n")
    for line in head.split(b"\r\n"):
        if line.lower().startswith(b"content-length:"):
            return len(body) >= int(line.split(b":")[1])
    return False

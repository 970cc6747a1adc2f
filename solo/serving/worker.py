"""The engine worker: one thread owns the engine and serves a bounded FIFO queue of jobs, one at a
time (batch size 1).

Request handlers never touch the engine. They submit a `Job` (refused at once with a 429 when the
queue is full, a 503 while shutting down) and await its events, which the worker hands to their
event loop without ever waiting for them: a slow or vanished client cannot hold the engine. A job
is cancelled by its handler (client gone, time out) or by shutdown; a queued job leaves the queue
at once, a running one is closed at its next decode round (`Generation.close()`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import threading
import time
from collections import deque
from dataclasses import dataclass

from solo.engine.engine import Engine, GenerationResult, GenerationStats
from solo.engine.request import PromptLogprob, StreamEvent
from solo.serving.metrics import ServerMetrics
from solo.serving.plan import Plan
from solo.serving.schemas import ApiError

log = logging.getLogger("solo.serving")


# --------------------------------------------------------------------------- events, in order
@dataclass
class Started:
    queue_wait_s: float


@dataclass
class Scored:
    index: int
    prompt: list[PromptLogprob]


@dataclass
class Token:
    index: int
    event: StreamEvent


@dataclass
class Finished:
    index: int
    result: GenerationResult


@dataclass
class Failed:
    """Ends the job: nothing follows."""

    status: int
    message: str
    type: str = "server_error"


@dataclass
class Done:
    """Ends the job: every choice finished."""


Event = Started | Scored | Token | Finished | Failed | Done

CANCEL_STATUS = {
    "timeout": (504, "timeout_error"),
    "shutdown": (503, "server_error"),
    "disconnect": (499, "client_closed_request"),
}


class Job:
    """One request in the worker's hands; its events go to the handler's event loop."""

    def __init__(self, plan: Plan, loop: asyncio.AbstractEventLoop, timeout_s: float | None, worker: EngineWorker):
        self.plan = plan
        self.loop = loop
        self.arrived = time.monotonic()
        self.deadline = self.arrived + timeout_s if timeout_s else None
        self.timeout_s = timeout_s
        self.cancel_reason: str | None = None
        self._cancelled = threading.Event()
        self._events: asyncio.Queue[Event] = asyncio.Queue()
        self._worker = worker
        self.finished = False  # a terminal event was sent

    @property
    def cancelled(self) -> bool:
        return self._cancelled.is_set()

    def cancel(self, reason: str) -> None:
        """Stop this job: out of the queue now, or closed at the engine's next round. Idempotent."""
        if self._cancelled.is_set() or self.finished:
            return
        self.cancel_reason = reason
        self._cancelled.set()
        self._worker.withdraw(self)

    def failure(self) -> Failed:
        status, kind = CANCEL_STATUS.get(self.cancel_reason or "", (500, "server_error"))
        if self.cancel_reason == "timeout":
            message = f"the request took longer than --request-timeout {self.timeout_s:g} s (queue wait included)."
        elif self.cancel_reason == "shutdown":
            message = "the server is shutting down; the request was cancelled."
        else:
            message = f"the request was cancelled ({self.cancel_reason})."
        return Failed(status, message, kind)

    def push(self, event: Event) -> None:
        """From the worker thread: hand an event to the handler's loop (never blocks)."""
        if isinstance(event, Failed | Done):
            self.finished = True
        with contextlib.suppress(RuntimeError):  # a closed loop: nobody is listening any more
            self.loop.call_soon_threadsafe(self._events.put_nowait, event)

    async def next_event(self) -> Event:
        """The next event; a Failed(504) when the deadline passes first (the job is then cancelled)."""
        timeout = None if self.deadline is None else max(0.0, self.deadline - time.monotonic())
        try:
            return await asyncio.wait_for(self._events.get(), timeout)
        except asyncio.TimeoutError:
            self.cancel("timeout")
            return self.failure()


class EngineWorker:
    """The thread that owns the engine. `max_queue`: jobs that may wait (None: unbounded)."""

    def __init__(self, engine: Engine, metrics: ServerMetrics, max_queue: int | None = None) -> None:
        self.engine = engine
        self.metrics = metrics
        self.max_queue = max_queue
        self._cond = threading.Condition(threading.RLock())
        self._queue: deque[Job] = deque()
        self._current: Job | None = None
        self._closing = False
        self._service_s = 1.0  # moving mean of a job's time in the engine (for Retry-After)
        self._thread = threading.Thread(target=self._loop, name="solo-engine", daemon=True)

    # ------------------------------------------------------------------ handler side
    def start(self) -> None:
        """Start the thread (idempotent: the app's lifespan starts it, a first job would too)."""
        with self._cond:
            if not self._thread.is_alive() and not self._closing:
                self._thread.start()

    @property
    def queue_length(self) -> int:
        return len(self._queue)

    @property
    def busy(self) -> bool:
        return self._current is not None

    @property
    def closing(self) -> bool:
        return self._closing

    def submit(self, plan: Plan, loop: asyncio.AbstractEventLoop, timeout_s: float | None = None) -> Job:
        with self._cond:
            if self._closing:
                raise ApiError(503, "the server is shutting down.", type="server_error", code="shutting_down")
            if self.max_queue is not None and len(self._queue) >= self.max_queue:
                wait = self.retry_after()
                raise ApiError(
                    429,
                    f"the queue is full ({len(self._queue)} requests waiting, --max-queue {self.max_queue}); "
                    f"retry in about {wait} s.",
                    type="rate_limit_error",
                    code="queue_full",
                    headers={"Retry-After": str(wait)},
                )
            self.start()
            job = Job(plan, loop, timeout_s, self)
            self._queue.append(job)
            self.metrics.queue_length.set(len(self._queue))
            self._cond.notify()
        return job

    def retry_after(self) -> int:
        """Seconds until a place is likely to free up: the running job's mean service time."""
        return max(1, min(3600, math.ceil(self._service_s)))

    def withdraw(self, job: Job) -> None:
        """A cancelled job leaves the queue at once (a running one stops at its next round)."""
        with self._cond:
            if job in self._queue:
                self._queue.remove(job)
                self.metrics.queue_length.set(len(self._queue))
                self.metrics.cancelled.labels(reason=job.cancel_reason or "unknown").inc()
                job.push(job.failure())

    def shutdown(self) -> None:
        """Refuse new jobs, cancel the queued ones (503) and the running one (at its next round)."""
        with self._cond:
            self._closing = True
            for job in list(self._queue):
                job.cancel("shutdown")
            if self._current is not None:
                self._current.cancel("shutdown")
            self._cond.notify_all()

    def join(self, timeout: float | None = None) -> bool:
        if self._thread.ident is None:  # never started
            return True
        self._thread.join(timeout)
        return not self._thread.is_alive()

    # ------------------------------------------------------------------ the worker thread
    def _loop(self) -> None:
        while True:
            with self._cond:
                while not self._queue and not self._closing:
                    self._cond.wait()
                if not self._queue:
                    return
                job = self._queue.popleft()
                self._current = job
                self.metrics.queue_length.set(len(self._queue))
                self.metrics.running.set(1)
            began = time.monotonic()
            try:
                self._serve(job)
            except Exception as e:  # the worker survives anything a request does
                log.exception("request failed in the engine")
                job.push(Failed(500, f"internal error: {type(e).__name__}: {e}"))
            finally:
                with self._cond:
                    self._current = None
                    self.metrics.running.set(0)
                self._service_s = 0.8 * self._service_s + 0.2 * (time.monotonic() - began)

    def _serve(self, job: Job) -> None:
        m = self.metrics
        started = time.monotonic()
        m.queue_wait.observe(started - job.arrived)
        if job.deadline is not None and started > job.deadline:
            job.cancel("timeout")
        if job.cancelled:
            return self._end_cancelled(job)
        job.push(Started(started - job.arrived))
        first_token = True
        results: list[GenerationResult] = []
        try:
            for choice in job.plan.choices:
                if job.cancelled:
                    break
                if choice.score_top is not None:
                    job.push(Scored(choice.index, self.engine.score(choice.prompt_ids, choice.score_top)))
                if choice.params is None:  # scoring only (max_tokens 0)
                    result = GenerationResult("", [], "length", GenerationStats(prompt_tokens=len(choice.prompt_ids)))
                else:
                    generation = self.engine.stream(choice.prompt_ids, choice.params)
                    try:
                        for event in generation:
                            if job.cancelled or self._expired(job):
                                break
                            if first_token and not event.flush:
                                m.ttft.observe(time.monotonic() - job.arrived)
                                first_token = False
                            job.push(Token(choice.index, event))
                    finally:
                        generation.close()  # a no-op once it ended; else it stops at this round
                    result = generation.result
                    assert result is not None
                results.append(result)  # counted even when cancelled: the tokens were made
                if job.cancelled:
                    break
                job.push(Finished(choice.index, result))
        except ValueError as e:  # a request the engine refuses (the plan checks most of this before)
            job.push(Failed(400, str(e), "invalid_request_error"))
            return
        finally:
            for result in results:
                m.record_result(result)
        if job.cancelled:
            return self._end_cancelled(job)
        m.e2e.observe(time.monotonic() - job.arrived)
        job.push(Done())

    def _expired(self, job: Job) -> bool:
        if job.deadline is not None and time.monotonic() > job.deadline:
            job.cancel("timeout")
            return True
        return False

    def _end_cancelled(self, job: Job) -> None:
        self.metrics.cancelled.labels(reason=job.cancel_reason or "unknown").inc()
        job.push(job.failure())

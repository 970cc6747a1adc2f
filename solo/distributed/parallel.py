"""Tensor-parallel process state: world, rank, process groups, and the collectives the model runs.

One process per shard, launched by ``torchrun`` (env:// rendezvous: RANK, WORLD_SIZE, LOCAL_RANK,
MASTER_ADDR, MASTER_PORT). The model's collectives go over the main group: NCCL on GPUs, gloo on
CPUs. Host-side coordination (each request's prompt and parameters, a per-round continue flag,
error agreement) goes over a separate gloo group, so it never waits on the GPU stream and never
interleaves with a captured graph's NCCL calls.

At world size 1 every collective is a no-op returning its input: the single-process engine runs
the same code. Collectives are timed as they run in the step (on a CPU the wall time of the call,
which includes waiting for the slowest rank; on a GPU, when asked, CUDA events around them), so the
start-up check and `solo bench` report what the all-reduces cost instead of assuming it. (A
CUDA graph's replay runs its collectives without Python: they are counted and timed in the start-up
check's eager steps, not in replayed requests.)

The GPU path (NCCL, all-reduce and all-gather inside captured graphs) is written to be capturable
(no host synchronisation, static shapes) but has not been run on GPUs yet.
"""

from __future__ import annotations

import os
import platform
import statistics
import time
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.distributed as dist

__all__ = [
    "CollectiveStats",
    "TensorParallel",
    "TensorParallelError",
    "init_tensor_parallel",
    "launch_hint",
]


EXPERT_SPLITS = ("auto", "expert", "width")  # how routed experts are split (solo.distributed.sharding)


class TensorParallelError(ValueError):
    """Tensor parallelism was requested but cannot run as asked; the message says why and the fix."""


def launch_hint(size: int) -> str:
    return (
        f"launch with torchrun --standalone --nproc-per-node {size} -m solo.cli COMMAND --tensor-parallel {size} ... "
        "(one process per shard; several nodes: torchrun's --nnodes, --node-rank and --rdzv-endpoint flags)"
    )


@dataclass
class CollectiveStats:
    """Collectives executed eagerly by this rank and the seconds they took (graph replays are not seen)."""

    all_reduces: int = 0
    all_reduce_s: float = 0.0
    all_gathers: int = 0
    all_gather_s: float = 0.0
    controls: int = 0  # host-side broadcasts on the control group (request, per-round flag)
    control_s: float = 0.0

    def copy(self) -> CollectiveStats:
        return CollectiveStats(**asdict(self))

    def since(self, earlier: CollectiveStats) -> CollectiveStats:
        now, before = asdict(self), asdict(earlier)
        return CollectiveStats(**{k: now[k] - before[k] for k in now})

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["all_reduce_us_mean"] = round(1e6 * self.all_reduce_s / self.all_reduces, 1) if self.all_reduces else None
        d["all_gather_us_mean"] = round(1e6 * self.all_gather_s / self.all_gathers, 1) if self.all_gathers else None
        d["control_us_mean"] = round(1e6 * self.control_s / self.controls, 1) if self.controls else None
        return d

    @property
    def seconds(self) -> float:
        return self.all_reduce_s + self.all_gather_s + self.control_s


class TensorParallel:
    """The process's place in a tensor-parallel group, and the collectives on it."""

    def __init__(
        self,
        world: int = 1,
        rank: int = 0,
        backend: str | None = None,
        group: Any = None,
        control: Any = None,
        device: torch.device | str = "cpu",
        expert_split: str = "auto",
    ) -> None:
        self.world = world
        self.rank = rank
        self.backend = backend  # "nccl", "gloo", or None at world size 1
        self.group = group
        self.control = control
        self.device = torch.device(device)
        self.expert_split = expert_split  # requested: "auto", "expert" or "width" (see solo.distributed.sharding)
        self.stats = CollectiveStats()
        self.cuda_timing = False  # GPU: time collectives with CUDA events (no host synchronisation in the step)
        self._events: list[tuple[torch.cuda.Event, torch.cuda.Event, str]] = []
        # CPU ranks on one host: the model's collectives through shared memory (solo.distributed.shm)
        # where that measured faster than gloo at start-up; `transport_us` holds what was measured
        self.shm: Any = None
        self.transport = backend
        self.transport_us: dict[str, float] = {}

    @classmethod
    def single(cls, expert_split: str = "auto") -> TensorParallel:
        return cls(expert_split=expert_split)

    @property
    def enabled(self) -> bool:
        return self.world > 1

    @property
    def leader(self) -> bool:
        return self.rank == 0

    def describe(self) -> dict[str, Any]:
        info: dict[str, Any] = {"world_size": self.world, "rank": self.rank, "backend": self.backend}
        if self.world > 1:
            info["all_reduce_transport"] = self.transport
        if self.transport_us:
            info["transport_us"] = self.transport_us
        return info

    # ------------------------------------------------------------------ the model's collectives
    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum `x` over the ranks, in place; returns it (a no-op at world size 1)."""
        if self.world == 1:
            return x
        start = self._start()
        if self.shm is not None and self.shm.fits(x):
            self.shm.all_reduce(x)
        else:
            dist.all_reduce(x, group=self.group)
        self._stop(start, "all_reduce")
        return x

    def all_gather_last(self, x: torch.Tensor) -> torch.Tensor:
        """Concatenate every rank's `x` [..., n] along the last dimension, in rank order -> [..., world * n]."""
        if self.world == 1:
            return x
        x = x.contiguous()
        start = self._start()
        if self.shm is not None and self.shm.fits(x):
            gathered = self.shm.all_gather_last(x)
        elif self.backend == "nccl":  # one flat buffer (graph-capturable), then ranks moved to the last dimension
            out = torch.empty((self.world, *x.shape), dtype=x.dtype, device=x.device)
            dist.all_gather_into_tensor(out, x, group=self.group)
            gathered = out.movedim(0, -2).reshape(*x.shape[:-1], self.world * x.shape[-1])
        else:
            parts = [torch.empty_like(x) for _ in range(self.world)]
            dist.all_gather(parts, x, group=self.group)
            gathered = torch.cat(parts, dim=-1)
        self._stop(start, "all_gather")
        return gathered

    def _start(self) -> Any:
        if self.device.type != "cuda":
            return time.perf_counter()
        if not self.cuda_timing or torch.cuda.is_current_stream_capturing():
            return None
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def _stop(self, start: Any, kind: str) -> None:
        if kind == "all_reduce":
            self.stats.all_reduces += 1
        else:
            self.stats.all_gathers += 1
        if start is None:
            return
        if isinstance(start, float):
            elapsed = time.perf_counter() - start
            if kind == "all_reduce":
                self.stats.all_reduce_s += elapsed
            else:
                self.stats.all_gather_s += elapsed
            return
        end = torch.cuda.Event(enable_timing=True)
        end.record()
        self._events.append((start, end, kind))

    def resolve_timings(self) -> None:
        """GPU: add the CUDA-event timings recorded so far to `stats` (synchronises; call outside the step)."""
        if not self._events:
            return
        torch.cuda.synchronize()
        for start, end, kind in self._events:
            seconds = start.elapsed_time(end) / 1e3
            if kind == "all_reduce":
                self.stats.all_reduce_s += seconds
            else:
                self.stats.all_gather_s += seconds
        self._events.clear()

    # ------------------------------------------------------------------ host-side coordination (gloo)
    def broadcast_object(self, obj: Any) -> Any:
        """Rank 0's `obj` on every rank (over the control group)."""
        if self.world == 1:
            return obj
        start = time.perf_counter()
        box = [obj if self.rank == 0 else None]
        dist.broadcast_object_list(box, src=0, group=self.control)
        self.stats.controls += 1
        self.stats.control_s += time.perf_counter() - start
        return box[0]

    def broadcast_ints(self, values: list[int]) -> list[int]:
        """Rank 0's small list of integers on every rank (a fixed-size int64 tensor over the control group)."""
        if self.world == 1:
            return values
        start = time.perf_counter()
        t = torch.tensor(values, dtype=torch.int64)
        if self.shm is not None:  # CPU ranks on one host: through the shared segment (rank 0's slot)
            t = self.shm.broadcast(t)
        else:
            dist.broadcast(t, src=0, group=self.control)
        self.stats.controls += 1
        self.stats.control_s += time.perf_counter() - start
        return t.tolist()

    def gather_objects(self, obj: Any) -> list[Any]:
        """Every rank's `obj`, in rank order, on every rank (over the control group)."""
        if self.world == 1:
            return [obj]
        out: list[Any] = [None] * self.world
        dist.all_gather_object(out, obj, group=self.control)
        return out

    def agree(self, error: BaseException | None, what: str) -> None:
        """Every rank learns whether any rank failed at `what`; all raise together (no rank is left
        waiting in a collective for one that gave up). The local exception is re-raised where it happened."""
        if self.world == 1:
            if error is not None:
                raise error
            return
        messages = self.gather_objects(None if error is None else f"{type(error).__name__}: {error}")
        if error is not None:
            raise error
        failed = [(r, m) for r, m in enumerate(messages) if m is not None]
        if failed:
            rank, message = failed[0]
            raise TensorParallelError(f"{what} failed on rank {rank} of {self.world}: {message}")

    def close(self) -> None:
        """Destroy the process groups and drop this object's handles on them. A handle still held at exit keeps
        gloo's C++ group alive until the interpreter's finalisation, whose destructor then aborts the process
        (SIGABRT, "terminate called without an active exception") in about one exit of three."""
        if self.world > 1 and dist.is_initialized():
            dist.destroy_process_group()
        self.group = self.control = None


TRANSPORTS = ("auto", "gloo", "shm")


def init_tensor_parallel(
    size: int, device: str | None = None, expert_split: str = "auto", transport: str = "auto"
) -> TensorParallel:
    """Join the group torchrun launched (`size` processes), or the single-process state for size 1.

    `device` "cuda" means this process's GPU (cuda:LOCAL_RANK) and the NCCL backend; "cpu" gloo.
    Refuses, with the fix, a size that is not what was launched, and `--tensor-parallel N` without torchrun.
    On CPUs, `transport` picks how the model's all-reduces and all-gathers travel: "gloo", "shm"
    (shared memory, ranks on one x86-64 host), or "auto": both are timed now and the faster is used."""
    if transport not in TRANSPORTS:
        raise TensorParallelError(f"unknown transport {transport!r}; choose one of {', '.join(TRANSPORTS)}.")
    if expert_split not in EXPERT_SPLITS:
        raise TensorParallelError(f"unknown expert split {expert_split!r}; choose one of {', '.join(EXPERT_SPLITS)}.")
    if size < 1:
        raise TensorParallelError(f"--tensor-parallel must be >= 1, got {size}.")
    launched = os.environ.get("WORLD_SIZE")
    if size == 1:
        if launched is not None and int(launched) > 1:
            raise TensorParallelError(
                f"this process is one of {launched} that torchrun launched, but --tensor-parallel is 1: pass "
                f"--tensor-parallel {launched} (or run solo without torchrun for one process)."
            )
        return TensorParallel.single(expert_split)
    if not dist.is_available():
        raise TensorParallelError(f"--tensor-parallel {size}: this torch build has no torch.distributed.")
    if launched is None:
        raise TensorParallelError(
            f"--tensor-parallel {size} needs {size} processes, but this one was not started by torchrun "
            f"(no WORLD_SIZE in the environment): {launch_hint(size)}."
        )
    if int(launched) != size:
        raise TensorParallelError(
            f"--tensor-parallel {size}, but torchrun launched {launched} processes: give torchrun "
            f"--nproc-per-node {size} (over all nodes), or pass --tensor-parallel {launched}."
        )
    cuda = (device or "cpu").startswith("cuda")
    backend = "nccl" if cuda else "gloo"
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if cuda:
        count = torch.cuda.device_count()
        if local_rank >= count:
            raise TensorParallelError(
                f"rank with LOCAL_RANK {local_rank} has no GPU: this node shows {count}. Launch at most {count} "
                "processes per node (--nproc-per-node)."
            )
        torch.cuda.set_device(local_rank)
        where = torch.device("cuda", local_rank)
    else:
        where = torch.device("cpu")
    if dist.is_initialized():
        if dist.get_world_size() != size or dist.get_backend() != backend:
            raise TensorParallelError(
                f"torch.distributed is already initialised with {dist.get_world_size()} ranks on "
                f"{dist.get_backend()}; --tensor-parallel {size} on {where.type} needs {size} ranks on {backend}."
            )
    else:
        kwargs: dict[str, Any] = {"device_id": where} if cuda else {}
        dist.init_process_group(backend, **kwargs)
    control = dist.new_group(backend="gloo")
    tp = TensorParallel(size, dist.get_rank(), backend, dist.group.WORLD, control, where, expert_split)
    if backend == "gloo":
        _choose_cpu_transport(tp, transport)
    return tp


def shm_unavailable(tp: TensorParallel) -> str | None:
    """Why shared-memory collectives cannot run this group (None: they can)."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return f"shared-memory collectives rely on x86-64 store ordering; this is {platform.machine()}"
    local = os.environ.get("LOCAL_WORLD_SIZE")
    if local is None or int(local) != tp.world:
        return "the ranks are not all on this host"
    if not os.path.isdir("/dev/shm"):
        return "no /dev/shm"
    return None


def _choose_cpu_transport(tp: TensorParallel, transport: str, trials: int = 5, calls: int = 10) -> None:
    """gloo or shared memory for the model's collectives: rank 0 decides (from its timing of both, a
    decode step's all-reduce of 4 KB) and every rank follows."""
    if transport == "gloo":
        return
    why = tp.broadcast_object(shm_unavailable(tp))
    if why is not None:
        if transport == "shm":
            raise TensorParallelError(f"transport shm: {why}.")
        return
    from solo.distributed.shm import SharedMemoryCollectives

    shm = SharedMemoryCollectives(tp)
    if transport == "shm":
        tp.shm, tp.transport = shm, "shm"
        return
    x = torch.zeros(1, 1024)
    times: dict[str, list[float]] = {"gloo": [], "shm": []}
    for _ in range(trials):  # interleaved, so both see the same machine
        for name in times:
            tp.shm = shm if name == "shm" else None
            tp.all_reduce(x)  # warm
            start = time.perf_counter()
            for _ in range(calls):
                tp.all_reduce(x)
            times[name].append((time.perf_counter() - start) / calls)
    tp.stats = CollectiveStats()
    measured = {name: round(1e6 * statistics.median(t), 1) for name, t in times.items()}
    measured = tp.broadcast_object(measured)  # rank 0's timing decides for all
    tp.transport_us = measured
    fastest = min(measured, key=measured.get)
    tp.shm, tp.transport = (shm if fastest == "shm" else None), fastest

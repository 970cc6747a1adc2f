"""All-reduce and all-gather through shared memory, for CPU ranks on one host.

gloo moves every collective through TCP sockets: on a small host each all-reduce of a decode step
costs a millisecond or more of wake-ups, several times the step's own arithmetic. Ranks on one host
can instead exchange through one shared-memory segment: each rank writes its tensor into its slot
and publishes a sequence number; once every rank's number has reached the collective's, each rank
reads all the slots and sums them itself, always in rank order 0..N-1, so every rank gets the same
bits. Two buffers alternate (a rank can be at most one collective ahead of the slowest, which
has finished reading the other buffer before it published the number that let this one go on).

Ordering: the slot is written by torch's copy kernel (ordinary stores) before the sequence number,
and read after it; x86-64 keeps stores in order and loads in order, so a rank that sees the number
sees the data. That is why this path is used only on x86-64 (elsewhere: gloo). Tensors larger
than a slot (long prefills) go through gloo: the choice depends only on the tensor's size, which
is the same on every rank, so all ranks always take the same path.
"""

from __future__ import annotations

import os
import time
import uuid

import torch

SLOT_BYTES = 2 << 20  # per rank and buffer: decode and verification steps fit, long prefills use gloo
LINE = 8  # int64 entries per sequence number: one 64-byte cache line each
SPIN = 20  # polls before yielding the core (ranks may share one: then the peer runs in the yield)
YIELDS = 2000  # yields before sleeping between polls (a peer still computing, e.g. a long prefill)
SLEEP_S = 50e-6
TIMEOUT_S = 600.0


class SharedMemoryCollectives:
    """One host's ranks exchanging through a segment in /dev/shm (created by rank 0, unlinked once all
    ranks have mapped it, so nothing is left behind)."""

    def __init__(self, tp, slot_bytes: int = SLOT_BYTES) -> None:
        self.rank, self.world = tp.rank, tp.world
        self.slot_bytes = slot_bytes
        header = self.world * LINE * 8
        size = header + 2 * self.world * slot_bytes
        path = tp.broadcast_object(f"/dev/shm/solo-tp-{uuid.uuid4().hex}" if tp.rank == 0 else None)
        if tp.rank == 0:
            with open(path, "wb") as f:
                f.truncate(size)
        tp.gather_objects(None)  # the file exists
        segment = torch.from_file(path, shared=True, size=size, dtype=torch.uint8)
        tp.gather_objects(None)  # every rank has mapped it
        if tp.rank == 0:
            os.unlink(path)
        self._segment = segment
        self.counters = segment[:header].view(torch.int64).view(self.world, LINE)
        self.data = segment[header:].view(2, self.world, slot_bytes)
        self.seq = 0

    def fits(self, x: torch.Tensor) -> bool:
        return x.numel() * x.element_size() <= self.slot_bytes

    def _exchange(self, x: torch.Tensor) -> list[torch.Tensor]:
        """Publish `x`, wait for every rank's, return all ranks' tensors (views of the segment) in rank order."""
        self.seq += 1
        buffer = self.seq % 2
        nbytes = x.numel() * x.element_size()

        def slot(rank: int) -> torch.Tensor:
            return self.data[buffer, rank, :nbytes].view(x.dtype).view(x.shape)

        slot(self.rank).copy_(x)
        self.counters[self.rank, 0] = self.seq
        polls, start = 0, None
        while int(self.counters[:, 0].min()) < self.seq:
            polls += 1
            if polls >= SPIN:  # a peer is late (busy, or descheduled): give the core away, then sleep
                if polls < SPIN + YIELDS:
                    os.sched_yield()
                else:
                    time.sleep(SLEEP_S)
                start = start or time.monotonic()
                if time.monotonic() - start > TIMEOUT_S:
                    late = [r for r in range(self.world) if int(self.counters[r, 0]) < self.seq]
                    raise RuntimeError(
                        f"shared-memory collective {self.seq}: ranks {late} did not arrive in {TIMEOUT_S} s"
                    )
        return [slot(r) for r in range(self.world)]

    def all_reduce(self, x: torch.Tensor) -> None:
        parts = self._exchange(x)
        total = parts[0].clone()
        for part in parts[1:]:
            total += part
        x.copy_(total)

    def broadcast(self, x: torch.Tensor) -> torch.Tensor:
        """Rank 0's `x` (every rank passes a tensor of the same shape)."""
        return self._exchange(x)[0].clone()

    def all_gather_last(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat(self._exchange(x.contiguous()), dim=-1)

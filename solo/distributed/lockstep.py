"""How the ranks of a tensor-parallel group run every request together, provably in lockstep.

Every rank computes the same logits (the LM head's all-gather gives each the same full row), so
each one's sampler, seeded alike, picks the same tokens, and the same stop conditions end the
request at the same token. Rank 0 leads, and checks this as it goes:

  * at the start of a request it broadcasts the request (which decoder, the prompt's ids, the
    parameters; a sampled request without a seed gets one drawn here, so all generators agree);
  * before each decode round it broadcasts "continue", and when its consumer stops (a stop
    condition, a closed stream, an error) "stop"; then the ranks exchange a digest of the tokens
    they emitted, and all raise `LockstepError` if any differs.

The other ranks either run the same program (`solo generate`, `solo check`: each compares the
broadcast request with its own and refuses a different one) or `follow`: they receive each request
and run it (`solo serve`, `solo bench`, where only rank 0 talks to clients or writes reports). A
cancelled stream on rank 0 therefore stops every rank at the same round. All of this is host-side,
on the gloo control group, once per round: nothing is added inside a step (or a CUDA graph).
"""

from __future__ import annotations

import logging
import secrets
from collections.abc import Iterator
from dataclasses import replace
from typing import Any

from solo.distributed.parallel import TensorParallel

log = logging.getLogger("solo.distributed")

STOP, GO = 0, 1
STARTING = "starting a request"
_MOD = (1 << 61) - 1


class LockstepError(RuntimeError):
    """The ranks disagree (a different request, different tokens): they no longer compute one model."""


class TokenDigest:
    """A running hash of the emitted tokens (the same on every rank while they agree)."""

    def __init__(self) -> None:
        self.count = 0
        self.value = 0

    def add(self, tokens: list[int]) -> None:
        for token in tokens:
            self.value = (self.value * 1_000_003 + token + 1) % _MOD
        self.count += len(tokens)


def lockstep_rounds(rounds: Iterator[Any], tp: TensorParallel) -> Iterator[Any]:
    """The decoder's rounds, pulled on every rank only when rank 0 pulls them (see the module docstring)."""
    digest = TokenDigest()
    got_stop = False  # a follower that received rank 0's stop
    try:
        while True:
            if tp.leader:
                tp.broadcast_ints([GO])
            elif tp.broadcast_ints([GO])[0] == STOP:
                got_stop = True
                return
            round_ = next(rounds)
            digest.add(round_.tokens)
            yield round_
    finally:
        try:
            if tp.leader:
                tp.broadcast_ints([STOP])
            elif not got_stop and tp.broadcast_ints([STOP])[0] != STOP:
                raise LockstepError(
                    f"rank {tp.rank} ended its request while rank 0 went on decoding: the ranks disagree on "
                    "where the request stops."
                )
            digests = tp.gather_objects((digest.count, digest.value))
            if len(set(digests)) > 1:
                raise LockstepError(
                    f"the ranks emitted different tokens (count, digest per rank: {digests}): they no longer "
                    "decode the same sequence."
                )
        finally:
            rounds.close()


def request_message(kind: str, decoder: str, ids: list[int], **fields: Any) -> dict[str, Any]:
    return {"kind": kind, "decoder": decoder, "ids": list(ids), **fields}


def seeded(params: Any) -> Any:
    """A sampled request without a seed gets one (rank 0 draws it; every rank's generator uses it)."""
    sampling = params.sampling
    if sampling.greedy or sampling.seed is not None:
        return params
    return replace(params, sampling=replace(sampling, seed=secrets.randbelow(1 << 62)))


def begin(tp: TensorParallel, message: dict[str, Any]) -> dict[str, Any]:
    """The start of a request in a program every rank runs: rank 0's request, checked against this rank's."""
    if message["kind"] == "stream" and tp.leader:
        message = {**message, "params": seeded(message["params"])}
    theirs = tp.broadcast_object(message if tp.leader else None)
    error = None
    if not tp.leader:
        leading = dict(theirs)
        if "params" in message and message["params"].sampling.seed is None:  # the seed rank 0 drew
            params = theirs["params"]
            leading["params"] = replace(params, sampling=replace(params.sampling, seed=None))
        if message != leading:
            error = LockstepError(
                f"rank {tp.rank} was asked for a different request than rank 0 ({_summary(message)} vs "
                f"{_summary(theirs)}): every rank must run the same program."
            )
    tp.agree(error, STARTING)  # all ranks refuse it together
    return theirs


def _summary(message: dict[str, Any]) -> str:
    ids = message.get("ids", [])
    return f"{message.get('kind')} on {message.get('decoder')}, {len(ids)} prompt tokens {ids[:4]}..."


def follow(engines: list[Any]) -> int:
    """A follower rank's loop (solo serve, solo bench on ranks > 0): run each request rank 0 starts, on
    the engine with the same decoder, until rank 0 releases the followers. Returns the requests run.
    A request every rank refuses (ValueError: rank 0 answers it) is skipped; anything else is raised,
    which ends this process (torchrun then stops the group)."""
    tp = engines[0].tp
    by_decoder = {type(e.decoder).__name__: e for e in engines}
    served = 0
    while True:
        message = tp.broadcast_object(None)
        if message["kind"] == "stop":
            return served
        engine = by_decoder[message["decoder"]]
        try:
            engine.follow_request(message)
        except ValueError as e:
            log.debug("rank %d: request refused as on rank 0: %s", tp.rank, e)
        served += 1


def release_followers(tp: TensorParallel) -> None:
    """Rank 0, at the end of a led program: the followers' `follow` returns."""
    if tp.enabled and tp.leader:
        tp.broadcast_object({"kind": "stop"})

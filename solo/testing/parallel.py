"""Tensor-parallel runs for tests: N gloo processes on this machine, and what they produced.

`run_ranks(fn, world, *args)` starts `world` processes (spawned, each a rank with the env://
variables torchrun would set, a free port per run), calls `fn(*args)` in each and returns the ranks'
results in rank order; an exception in any rank is raised here with its message. The rank functions
below are what the tests run (they live in the package so spawned processes can import them).
"""

from __future__ import annotations

import io
import os
import queue as queues
import socket
from collections.abc import Callable
from typing import Any

import torch


class RankFailed(RuntimeError):
    """A rank raised; the message is its exception."""


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(fn: Callable, rank: int, world: int, port: int, args: tuple, out: Any) -> None:
    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_WORLD_SIZE=str(world),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    torch.set_num_threads(1)
    try:
        buffer = io.BytesIO()  # as bytes: tensors sent through the queue as shared memory die with this process
        torch.save(fn(*args), buffer)
        out.put((rank, True, buffer.getvalue()))
    except BaseException as e:  # reported to the parent, which raises it
        out.put((rank, False, f"{type(e).__name__}: {e}"))
    finally:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()


def run_ranks(fn: Callable, world: int, *args: Any, timeout: float = 600.0) -> list[Any]:
    """`fn(*args)` on `world` gloo ranks; their return values in rank order (see the module docstring)."""
    import multiprocessing

    ctx = multiprocessing.get_context("spawn")
    out = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_entry, args=(fn, rank, world, port, args, out), daemon=True) for rank in range(world)]
    for p in procs:
        p.start()
    results: dict[int, tuple[bool, Any]] = {}
    try:
        while len(results) < world:
            try:
                rank, ok, value = out.get(timeout=timeout)
            except queues.Empty:
                missing = sorted(set(range(world)) - set(results))
                raise RankFailed(f"ranks {missing} gave no result in {timeout} s") from None
            results[rank] = (ok, value)
    finally:
        for p in procs:
            p.join(10)
            if p.is_alive():
                p.kill()
    failed = {rank: value for rank, (ok, value) in results.items() if not ok}
    if failed:
        raise RankFailed("; ".join(f"rank {rank}: {message}" for rank, message in sorted(failed.items())))
    return [torch.load(io.BytesIO(results[rank][1]), weights_only=False) for rank in range(world)]


# --------------------------------------------------------------------------- what the ranks run
def record_head(model: Any) -> list[torch.Tensor]:
    """Every output of the model's LM head (target and NEXTN draft calls, in order), as float64 copies."""
    seen: list[torch.Tensor] = []
    model.lm_head.register_forward_hook(lambda _m, _i, out: seen.append(out.detach().double().clone()))
    return seen


def greedy_runs(
    path: str,
    prompt: list[int],
    max_tokens: int,
    tensor_parallel: int = 1,
    moe_split: str = "auto",
    lm_head: str = "fp32",
    transport: str = "auto",
    float64: bool = False,
) -> dict[str, Any]:
    """Greedy decoding of `prompt`, plain and with NEXTN (when the checkpoint has the layer), fp32 on the
    CPU (`float64`: the whole model and its head in float64, the rounding reference), as one rank of
    `tensor_parallel` (1: one process). Per decoder: the tokens and every LM-head output; and the
    rank's shard."""
    from solo.distributed.parallel import init_tensor_parallel
    from solo.engine.engine import Engine, GenerationParams
    from solo.speculative.nextn import NextNDecoder

    tp = init_tensor_parallel(tensor_parallel, "cpu", moe_split, transport)
    plain = Engine.from_pretrained(
        path, lm_head=lm_head, tensor_parallel=tp, dtype=torch.float64 if float64 else torch.float32
    )
    if float64:
        plain.model.lm_head.weight.data = plain.model.lm_head.weight.data.double()
    engines = {"plain": plain}
    if plain.model.nextn is not None:
        engines["nextn"] = Engine(plain.model, plain.tokenizer, NextNDecoder(plain.model))
    logits = record_head(plain.model)
    shard = plain.model.shard
    out: dict[str, Any] = {
        "shard": shard.describe(plain.model.config),
        "moe_split": shard.experts,
        "transport": tp.transport,
    }
    for name, engine in engines.items():
        logits.clear()
        result = engine.generate(prompt, GenerationParams(max_tokens=max_tokens, ignore_eos=True))
        out[name] = {
            "tokens": result.token_ids,
            "logits": list(logits),
            "collectives": result.stats.tensor_parallel,
            "accept_length": result.stats.accept_length,
        }
    return out


def sampled_runs(path: str, prompt: list[int]) -> dict[str, Any]:
    """Sampled decoding on two ranks: without a seed (rank 0 draws one for all), and with a seed that
    differs between the ranks, which every rank must refuse (the error is returned)."""
    from solo.distributed.parallel import init_tensor_parallel
    from solo.engine.engine import Engine, GenerationParams
    from solo.engine.sampling import SamplingParams

    tp = init_tensor_parallel(2, "cpu")
    engine = Engine.from_pretrained(path, lm_head="fp32", tensor_parallel=tp)

    def params(seed: int | None) -> GenerationParams:
        return GenerationParams(max_tokens=12, ignore_eos=True, sampling=SamplingParams(temperature=1.0, seed=seed))

    unseeded = engine.generate(prompt, params(None)).token_ids
    try:
        engine.generate(prompt, params(10 + tp.rank))
        refused = None
    except (ValueError, RuntimeError) as e:  # rank 0: TensorParallelError, the refusing rank: LockstepError
        refused = f"{type(e).__name__}: {e}"
    after = engine.generate(prompt, params(7)).token_ids  # the group still works after the refusal
    return {"unseeded": unseeded, "refused": refused, "after": after}


def collectives_probe(transport: str) -> dict[str, Any]:
    """The group's collectives on rank-dependent data, small (a decode step's) and larger than a
    shared-memory slot (a long prefill's), through `transport`."""
    from solo.distributed.parallel import init_tensor_parallel
    from solo.distributed.shm import SLOT_BYTES

    tp = init_tensor_parallel(2, "cpu", transport=transport)
    g = torch.Generator().manual_seed(tp.rank)
    small, large = torch.randn(3, 256, generator=g), torch.randn(SLOT_BYTES // 4 + 1, generator=g)
    out = {"transport": tp.transport, "small": small.clone(), "large": large.clone()}
    out["small_sum"] = tp.all_reduce(small.clone())
    out["large_sum"] = tp.all_reduce(large.clone())
    out["gathered"] = tp.all_gather_last(small[:, :8] + tp.rank)
    out["flag"] = tp.broadcast_ints([7 + tp.rank, 1])
    out["many"] = [tp.all_reduce(torch.full((4,), float(i + tp.rank))).tolist() for i in range(50)]
    return out

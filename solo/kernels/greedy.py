"""Greedy decoding's picks over the vocabulary in one launch: the argmax of each logits row and, for a
speculative round, the greedy acceptance of the drafts.

`torch.argmax` over one 157,184-wide row is a memset and a reduction kernel (8-9 us each on the H200,
about 14 us on the critical path), and the greedy acceptance after it seven more small kernels (compare,
cast, a two-kernel cumulative product, sum, gather, add). Here the row is cut into chunks: every program
reduces one chunk of one row to (value, index), parks it in a scratch buffer and bumps an acq_rel
counter; the last program to arrive reduces the chunks of every row in a fixed order, writes the
argmaxes (and the acceptance) and resets the counter, so a CUDA graph replays it without a memset.

The picks are `torch.argmax`'s exactly: the largest value, the lowest index among equal ones, and a NaN
above every number (the lowest NaN index). Triton's interpreter runs it on the CPU for the tests; the
model's CPU path keeps `torch.argmax`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from solo.kernels.triton_epilogues import split_scratch

CHUNK = 4096  # logits per program: 39 programs per 157,184-wide row
FIRST_ROWS = 16  # the first scratch buffers hold this many rows (a verification window's at most)
_SCRATCH: dict[tuple, torch.Tensor] = {}


@triton.jit
def _best(value, index, nan, BIG: tl.constexpr):
    """(value, index, is-NaN) of the best of a block: any NaN beats every number (its lowest index),
    else the largest value at its lowest index. `index` holds BIG where a lane is not a candidate."""
    any_nan = tl.max(nan.to(tl.int32), axis=0) > 0
    nan_index = tl.min(tl.where(nan, index, BIG), axis=0)
    top = tl.max(tl.where(nan, -float("inf"), value), axis=0)
    top_index = tl.min(tl.where((value == top) & ~nan, index, BIG), axis=0)
    return tl.where(any_nan, float("nan"), top), tl.where(any_nan, nan_index, top_index), any_nan


@triton.jit
def _greedy_kernel(
    logits_ptr,
    stride,
    V,
    value_ptr,
    index_ptr,
    count_ptr,
    out_ptr,
    drafts_ptr,
    accepted_ptr,
    next_ptr,
    ROWS: tl.constexpr,
    CHUNKS: tl.constexpr,
    CHUNK_SIZE: tl.constexpr,
    CHUNKS_POW2: tl.constexpr,
    ROWS_POW2: tl.constexpr,
    ACCEPT: tl.constexpr,
):
    chunk = tl.program_id(0)
    row = tl.program_id(1)
    BIG: tl.constexpr = 2**31 - 1
    cols = chunk * CHUNK_SIZE + tl.arange(0, CHUNK_SIZE)
    ok = cols < V
    x = tl.load(logits_ptr + row * stride + cols, mask=ok, other=-float("inf")).to(tl.float32)
    value, index, _ = _best(x, tl.where(ok, cols, BIG), (x != x) & ok, BIG)
    tl.store(value_ptr + row * CHUNKS + chunk, value)
    tl.store(index_ptr + row * CHUNKS + chunk, index)
    tl.debug_barrier()
    arrived = tl.atomic_add(count_ptr, 1, sem="acq_rel", scope="gpu")
    if arrived == ROWS * CHUNKS - 1:  # the last program: every row's chunks are parked
        c = tl.arange(0, CHUNKS_POW2)
        here = c < CHUNKS
        rr = tl.arange(0, ROWS_POW2)
        picks = tl.zeros((ROWS_POW2,), dtype=tl.int32)
        run = 1  # (greedy acceptance) whether every draft so far matched
        accepted = 0
        for r in tl.static_range(ROWS):
            v = tl.load(value_ptr + r * CHUNKS + c, mask=here, other=-float("inf"), cache_modifier=".cg")
            i = tl.load(index_ptr + r * CHUNKS + c, mask=here, other=BIG, cache_modifier=".cg")
            _, pick, _ = _best(v, i, (v != v) & here, BIG)
            tl.store(out_ptr + r, pick.to(tl.int64))
            picks = tl.where(rr == r, pick, picks)
            if ACCEPT and r < ROWS - 1:  # drafts [ROWS - 1]: a leading run of matches is accepted
                run = run * (tl.load(drafts_ptr + r) == pick).to(tl.int32)
                accepted += run
        if ACCEPT:  # the target's pick after the accepted run
            tl.store(accepted_ptr, accepted.to(tl.int64))
            tl.store(next_ptr, tl.sum(tl.where(rr == accepted, picks, 0), axis=0).to(tl.int64))
        tl.atomic_xchg(count_ptr, 0, sem="relaxed", scope="gpu")


def _launch(
    logits: torch.Tensor, drafts: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    if logits.ndim != 2 or logits.stride(-1) != 1:
        raise ValueError(f"greedy picks take row-major logits [rows, vocabulary], got {tuple(logits.shape)}")
    rows, vocab = logits.shape
    chunks = triton.cdiv(vocab, CHUNK)
    device = logits.device
    most = FIRST_ROWS * chunks
    values = split_scratch(_SCRATCH, (str(device), "values"), rows * chunks, torch.float32, False, device, most)
    indices = split_scratch(_SCRATCH, (str(device), "indices"), rows * chunks, torch.int32, False, device, most)
    count = split_scratch(_SCRATCH, (str(device), "count"), 1, torch.int32, True, device)
    picks = torch.empty(rows, dtype=torch.int64, device=device)
    accepted = following = None
    if drafts is not None:
        accepted = torch.empty(1, dtype=torch.int64, device=device)
        following = torch.empty(1, dtype=torch.int64, device=device)
    _greedy_kernel[(chunks, rows)](
        logits,
        logits.stride(0),
        vocab,
        values,
        indices,
        count,
        picks,
        drafts if drafts is not None else picks,  # (unused pointers without a round's acceptance)
        accepted if accepted is not None else picks,
        following if following is not None else picks,
        ROWS=rows,
        CHUNKS=chunks,
        CHUNK_SIZE=CHUNK,
        CHUNKS_POW2=triton.next_power_of_2(chunks),
        ROWS_POW2=triton.next_power_of_2(rows),
        ACCEPT=drafts is not None,
        num_warps=8,
    )
    return picks, accepted, following


def argmax_rows(logits: torch.Tensor) -> torch.Tensor:
    """`logits.argmax(-1)` for logits [rows, V] (fp32 or bf16), in one launch: [rows] int64."""
    return _launch(logits, None)[0]


def greedy_accept(target_logits: torch.Tensor, drafts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """solo.speculative.acceptance.accept_greedy in one launch: target_logits [S + 1, V], drafts [S]
    int64 -> (accepted count [1], next token [1])."""
    if drafts.shape != (target_logits.shape[0] - 1,) or drafts.dtype != torch.int64:
        want = target_logits.shape[0] - 1
        raise ValueError(f"drafts must be int64 [{want}], got {drafts.dtype} {tuple(drafts.shape)}")
    _, accepted, following = _launch(target_logits, drafts.contiguous())
    assert accepted is not None and following is not None
    return accepted, following

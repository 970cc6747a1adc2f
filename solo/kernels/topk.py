"""The top-k cut of sampling (k <= 64) over the vocabulary in one launch.

`torch.topk` of k = 29 over a 157,184-wide row is a radix select of about 18 kernels on the H200 (four
passes of digit counts and scans, a gather and a sort: about 55 us on the critical path), once per draft
step and once for the verification window of a sampled NEXTN round. Here every program takes one chunk
of one row and keeps its best k as 64-bit keys (the logit's bits in an order-preserving integer, then
the column, lower columns first among equal logits) with `tl.topk`; the last program to arrive (an
acq_rel counter it resets, so a CUDA graph replays it without a memset) merges each row's candidates
the same way and writes the values and their columns, in descending order.

The values are torch.topk's exactly; among equal logits the lower column comes first (torch leaves that
order unspecified). Registered as the custom op `solo::top_k_rows`, so `torch.compile` (the GPU's
sampling distribution) calls it as one opaque op. Triton's interpreter runs it on the CPU for the tests;
the model's CPU path keeps `torch.topk`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from solo.kernels.triton_epilogues import split_scratch

MOST_K = 64  # larger cuts stay on torch.topk
CHUNK = 4096  # logits per program
FIRST_ROWS = 16  # the first scratch buffer holds this many rows
_SCRATCH: dict[tuple, torch.Tensor] = {}


@triton.jit
def _keys(x, cols):
    """int64 keys ordering (logit, -column) as integers: the fp32 bits made order-preserving (negative
    numbers' magnitude bits flipped), then 2^31 - 1 - column below them."""
    bits = x.to(tl.int32, bitcast=True)
    ordered = tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)
    return (ordered.to(tl.int64) << 32) | (0x7FFFFFFF - cols).to(tl.int64)


@triton.jit
def _top_k_kernel(
    x_ptr,
    stride,
    V,
    key_ptr,
    count_ptr,
    value_ptr,
    index_ptr,
    K: tl.constexpr,
    K_POW2: tl.constexpr,
    ROWS: tl.constexpr,
    CHUNKS: tl.constexpr,
    CHUNK_SIZE: tl.constexpr,
    MERGE_POW2: tl.constexpr,
):
    chunk = tl.program_id(0)
    row = tl.program_id(1)
    LOWEST: tl.constexpr = -(2**63)  # past the vocabulary: below every logit's key, -inf's included
    cols = chunk * CHUNK_SIZE + tl.arange(0, CHUNK_SIZE)
    ok = cols < V
    x = tl.load(x_ptr + row * stride + cols, mask=ok, other=0.0).to(tl.float32)
    keys = tl.where(ok, _keys(x, cols), LOWEST)
    best = tl.topk(keys, K_POW2)
    tl.store(key_ptr + (row * CHUNKS + chunk) * K_POW2 + tl.arange(0, K_POW2), best)
    tl.debug_barrier()
    arrived = tl.atomic_add(count_ptr, 1, sem="acq_rel", scope="gpu")
    if arrived == ROWS * CHUNKS - 1:  # the last program: merge every row's candidates
        m = tl.arange(0, MERGE_POW2)
        out = tl.arange(0, K_POW2)
        for r in tl.static_range(ROWS):
            cand = tl.load(
                key_ptr + r * CHUNKS * K_POW2 + m, mask=m < CHUNKS * K_POW2, other=LOWEST, cache_modifier=".cg"
            )
            top = tl.topk(cand, K_POW2)
            high = (top >> 32).to(tl.int32)
            value = tl.where(high < 0, high ^ 0x7FFFFFFF, high).to(tl.float32, bitcast=True)
            column = 0x7FFFFFFF - (top & 0x7FFFFFFF)
            tl.store(value_ptr + r * K + out, value, mask=out < K)
            tl.store(index_ptr + r * K + out, column, mask=out < K)
        tl.atomic_xchg(count_ptr, 0, sem="relaxed", scope="gpu")


def _launch(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    rows, vocab = logits.shape
    chunks = triton.cdiv(vocab, CHUNK)
    k_pow2 = max(2, triton.next_power_of_2(k))  # tl.topk(x, 1) fails before triton-lang/triton#10952 (3.6)
    device = logits.device
    first = FIRST_ROWS * chunks * k_pow2
    keys = split_scratch(_SCRATCH, (str(device), "keys"), rows * chunks * k_pow2, torch.int64, False, device, first)
    count = split_scratch(_SCRATCH, (str(device), "count"), 1, torch.int32, True, device)
    values = torch.empty((rows, k), dtype=torch.float32, device=device)
    indices = torch.empty((rows, k), dtype=torch.int64, device=device)
    _top_k_kernel[(chunks, rows)](
        logits,
        logits.stride(0),
        vocab,
        keys,
        count,
        values,
        indices,
        K=k,
        K_POW2=k_pow2,
        ROWS=rows,
        CHUNKS=chunks,
        CHUNK_SIZE=CHUNK,
        MERGE_POW2=triton.next_power_of_2(chunks * k_pow2),
        num_warps=8,
    )
    return values, indices


@torch.library.custom_op("solo::top_k_rows", mutates_args=())
def top_k_rows(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(values fp32, columns int64), each [rows, k], descending, of logits [rows, V] (fp32): torch.topk's
    values; among equal logits the lower column first. 1 <= k <= MOST_K <= V."""
    if logits.ndim != 2 or logits.dtype != torch.float32 or not 1 <= k <= min(MOST_K, logits.shape[1]):
        raise ValueError(f"top_k_rows takes fp32 [rows, V] and 1 <= k <= {MOST_K}, got {tuple(logits.shape)}, k={k}")
    return _launch(logits.contiguous(), k)


@top_k_rows.register_fake
def _(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    rows = logits.shape[0]
    return logits.new_empty((rows, k)), logits.new_empty((rows, k), dtype=torch.int64)


# tl.topk (Triton 3.3 and later): where this Triton lacks it, every cut stays on torch.topk
AVAILABLE = hasattr(tl, "topk")


def top_k(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """logits.topk(k) along the last dimension (fp32 logits [..., V]): one launch on a GPU for k up to
    MOST_K (`top_k_rows`), torch.topk elsewhere."""
    if AVAILABLE and logits.is_cuda and logits.dtype == torch.float32 and 1 <= k <= min(MOST_K, logits.shape[-1]):
        values, indices = top_k_rows(logits.reshape(-1, logits.shape[-1]), k)
        shape = (*logits.shape[:-1], k)
        return values.reshape(shape), indices.reshape(shape)
    return logits.topk(k, dim=-1)

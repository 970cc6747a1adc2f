"""The top-k cut of sampling (k <= 64) over the vocabulary in one launch.

`torch.topk` of k = 29 over a 157,184-wide row is a radix select of about 18 kernels on the H200 (four
passes of digit counts and scans, a gather and a sort: about 55 us on the critical path), once per draft
step and once for the verification window of a sampled NEXTN round. Here every program takes one chunk
of one row and keeps its best k as 64-bit keys (the logit's bits in an order-preserving integer, then
the column, lower columns first among equal logits) with `tl.topk`; the last program of a row to arrive
(an acq_rel counter of the row, which it resets, so a CUDA graph replays it without a memset) merges the
row's candidates the same way and writes the values and their columns, in descending order. The rows
merge in parallel (before the thirty-fifth session one program merged every row in turn: on the H100 a
call took 96 us for the 4 rows of a verification window against 38 for one row, so about 19 us a row's
merge of 1,248 candidates; `docs/results/h100_bench_lab89.json`). With `GROUP` the merge has two levels:
the last program of each group of GROUP chunks merges the group's candidates, and the row's last group
merger merges those.

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
# logits a program, and chunks whose candidates one program merges first (0: the row's last program merges them all):
# on the H100, k = 29 over 157,184 logits, 1 row 25.8 -> 12.8 us and 4 rows 42.4 -> 22.6 us against 4,096 and 0, the
# fastest of dev/topk_sweep.py's grid (docs/results/h100_topk_sweep_lab89.log; torch.topk 61.4 and 76.8 us)
CHUNK = 1024
GROUP = 8
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
def _best(src_ptr, n, K_POW2: tl.constexpr, N_POW2: tl.constexpr):
    """The best K_POW2 of the n keys at src_ptr (written by other programs: read from the L2), descending."""
    m = tl.arange(0, N_POW2)
    return tl.topk(tl.load(src_ptr + m, mask=m < n, other=-(2**63), cache_modifier=".cg"), K_POW2)


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
    GROUP: tl.constexpr,
    GROUPS: tl.constexpr,
    GROUP_POW2: tl.constexpr,
    MERGE_POW2: tl.constexpr,
):
    """Program (chunk, row): the chunk's best K_POW2 keys to key_ptr[row, chunk]. With GROUP, the last of a
    group's programs to arrive merges the group's candidates into key_ptr[ROWS, ...] (the level above), and the
    last group merger of the row merges those; without, the row's last program merges its CHUNKS candidates. The
    counters (a row's groups', then the rows') are reset by the programs that merge, so a CUDA graph replays it."""
    chunk = tl.program_id(0)
    row = tl.program_id(1)
    LOWEST: tl.constexpr = -(2**63)  # past the vocabulary: below every logit's key, -inf's included
    cols = chunk * CHUNK_SIZE + tl.arange(0, CHUNK_SIZE)
    ok = cols < V
    x = tl.load(x_ptr + row * stride + cols, mask=ok, other=0.0).to(tl.float32)
    keys = tl.where(ok, _keys(x, cols), LOWEST)
    tl.store(key_ptr + (row * CHUNKS + chunk) * K_POW2 + tl.arange(0, K_POW2), tl.topk(keys, K_POW2))
    tl.debug_barrier()
    row_count = count_ptr + ROWS * GROUPS + row
    if GROUP > 0:
        group = chunk // GROUP
        members = tl.minimum(GROUP, CHUNKS - group * GROUP)
        group_count = count_ptr + row * GROUPS + group
        arrived = tl.atomic_add(group_count, 1, sem="acq_rel", scope="gpu")
        last_in_row = arrived < 0  # (False, as the tensor the branch below assigns)
        if arrived == members - 1:  # the group's last program: its members' candidates, merged one level up
            upper = key_ptr + ROWS * CHUNKS * K_POW2 + row * GROUPS * K_POW2
            first = key_ptr + (row * CHUNKS + group * GROUP) * K_POW2
            dst = upper + group * K_POW2
            tl.store(dst + tl.arange(0, K_POW2), _best(first, members * K_POW2, K_POW2, GROUP_POW2))
            tl.atomic_xchg(group_count, 0, sem="relaxed", scope="gpu")
            tl.debug_barrier()
            last_in_row = tl.atomic_add(row_count, 1, sem="acq_rel", scope="gpu") == GROUPS - 1
        src = key_ptr + ROWS * CHUNKS * K_POW2 + row * GROUPS * K_POW2  # the row's merged groups
        n = GROUPS * K_POW2
    else:
        last_in_row = tl.atomic_add(row_count, 1, sem="acq_rel", scope="gpu") == CHUNKS - 1
        src = key_ptr + row * CHUNKS * K_POW2
        n = CHUNKS * K_POW2
    if last_in_row:  # the row's last: its values and columns, in descending order
        top = _best(src, n, K_POW2, MERGE_POW2)
        high = (top >> 32).to(tl.int32)
        value = tl.where(high < 0, high ^ 0x7FFFFFFF, high).to(tl.float32, bitcast=True)
        column = 0x7FFFFFFF - (top & 0x7FFFFFFF)
        out = tl.arange(0, K_POW2)
        tl.store(value_ptr + row * K + out, value, mask=out < K)
        tl.store(index_ptr + row * K + out, column, mask=out < K)
        tl.atomic_xchg(row_count, 0, sem="relaxed", scope="gpu")


def kernel_constexprs(rows: int, vocab: int, k: int, chunk: int, group: int) -> dict[str, int]:
    """The kernel's compile-time arguments for `rows` rows of `vocab` logits, the best `k`, `chunk` logits a
    program and `group` chunks merged first (0: none)."""
    if chunk < 2 or chunk & (chunk - 1) or group < 0 or group & (group - 1):
        raise ValueError(
            f"top_k: chunk must be a power of two >= 2 and group 0 or a power of two, got {chunk}, {group}"
        )
    chunks = triton.cdiv(vocab, chunk)
    k_pow2 = max(2, triton.next_power_of_2(k))  # tl.topk(x, 1) fails before triton-lang/triton#10952 (3.6)
    groups = triton.cdiv(chunks, group) if group else 1
    return dict(
        K=k,
        K_POW2=k_pow2,
        ROWS=rows,
        CHUNKS=chunks,
        CHUNK_SIZE=chunk,
        GROUP=group,
        GROUPS=groups,
        GROUP_POW2=max(2, group * k_pow2),
        MERGE_POW2=triton.next_power_of_2((groups if group else chunks) * k_pow2),
    )


def _launch(logits: torch.Tensor, k: int, chunk: int | None = None, group: int | None = None):
    rows, vocab = logits.shape
    c = kernel_constexprs(rows, vocab, k, CHUNK if chunk is None else chunk, GROUP if group is None else group)
    device = logits.device
    per_row = (c["CHUNKS"] + (c["GROUPS"] if c["GROUP"] else 0)) * c["K_POW2"]
    keys = split_scratch(
        _SCRATCH, (str(device), "keys"), rows * per_row, torch.int64, False, device, FIRST_ROWS * per_row
    )
    counters = rows * (c["GROUPS"] + 1)
    count = split_scratch(
        _SCRATCH, (str(device), "count"), counters, torch.int32, True, device, FIRST_ROWS * (c["GROUPS"] + 1)
    )
    values = torch.empty((rows, k), dtype=torch.float32, device=device)
    indices = torch.empty((rows, k), dtype=torch.int64, device=device)
    _top_k_kernel[(c["CHUNKS"], rows)](logits, logits.stride(0), vocab, keys, count, values, indices, **c, num_warps=8)
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

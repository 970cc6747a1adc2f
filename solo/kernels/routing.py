"""Routing tables for grouped (indexed) MoE GEMMs: which assignment rows each block multiplies.

An assignment a = t*k + j is token t's j-th expert. A grouped GEMM runs blocks of ``block_m`` rows
that all use one expert: ``sorted_ids`` lists the rows of block b at [b*block_m, (b+1)*block_m)
(padding = n, the number of assignments), ``expert_ids[b]`` is its expert and ``num_tokens_padded``
(0-dim int32) counts the rows in use. Humming's indexed GEMMs and solo's grouped prefill kernels
(solo.kernels.triton_moe_grouped) read the same tables.
"""

from __future__ import annotations

import torch


def align_routing(topk_ids: torch.Tensor, block_m: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Humming's indexed-GEMM routing tables, computed on the device with static shapes.

    Assignments a = t*k + j are grouped by expert into blocks of ``block_m`` rows:
    sorted_ids [n*block_m] (padding = n), expert_ids [n] (one per block; unused blocks 0) and
    num_tokens_padded (0-dim int32, rows actually used). n = T*k is the most blocks ever needed,
    so nothing depends on the data's values at the host.
    """
    flat = topk_ids.reshape(-1).to(torch.int64)
    n = flat.numel()
    dev = flat.device
    sorted_e, order = torch.sort(flat, stable=True)
    pos = torch.arange(n, device=dev)
    is_new = torch.ones(n, dtype=torch.bool, device=dev)
    if n > 1:
        is_new[1:] = sorted_e[1:] != sorted_e[:-1]
    start = torch.cummax(torch.where(is_new, pos, torch.zeros_like(pos)), dim=0).values
    r = pos - start
    block_id = torch.cumsum((r % block_m == 0).to(torch.int64), dim=0) - 1
    slot = block_id * block_m + r % block_m
    sorted_ids = torch.full((n * block_m,), n, dtype=torch.int32, device=dev)
    sorted_ids.scatter_(0, slot, order.to(torch.int32))
    expert_ids = torch.zeros(n, dtype=torch.int32, device=dev)
    expert_ids.scatter_(0, block_id, sorted_e.to(torch.int32))
    num_tokens_padded = ((block_id[-1] + 1) * block_m).to(torch.int32).reshape(())
    return sorted_ids, expert_ids, num_tokens_padded


def one_block_per_assignment(n: int, block_m: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Routing tables for small calls (decode, verification), where sorting costs more than it saves.

    Every assignment a = 0..n-1 gets block a to itself: sorted_ids[a*block_m] = a, the rest padding (n);
    num_tokens_padded = n*block_m. Only expert_ids (= the flat top-k ids) depends on the routing, so
    these two tensors are constants per (n, block_m). An expert chosen by two tokens is read twice;
    at one token the top-k experts are distinct and the work equals that of sorted tables.
    """
    sorted_ids = torch.full((n * block_m,), n, dtype=torch.int32, device=device)
    sorted_ids[::block_m] = torch.arange(n, dtype=torch.int32, device=device)
    # torch.full, not torch.tensor: no host-to-device copy, so this is safe inside a graph capture
    return sorted_ids, torch.full((), n * block_m, dtype=torch.int32, device=device)

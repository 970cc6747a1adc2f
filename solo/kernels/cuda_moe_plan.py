"""The persistent decode kernel's plan, in plain Python: its variants and the tile-to-block schedule
it reads (solo/kernels/cuda/moe_decode.cu; the backend is solo/kernels/cuda_moe.py). Kept apart from
the backend so it can be built and tested without Triton or a GPU."""

from __future__ import annotations

import heapq
from dataclasses import dataclass

import torch

ORDERS = ("gate_up_first", "need")
# how decode_schedule spreads the tiles: "bytes" balances each block's whole share (gate_up and down), "gate_up"
# first its gate_up tiles (at most one more than any other block's), then the down tiles by bytes
BALANCES = ("bytes", "gate_up")
# kernel probes (moe_decode.cu PROBE): "" none, then copies only, no scale copies, no activation exchange,
# no down products
PROBES = ("", "copy_only", "no_scales", "no_exchange", "no_down_products")


@dataclass(frozen=True)
class DecodeKernelConfig:
    """Variants of the persistent kernel (docs/kernels.md says which were measured)."""

    order: str = "gate_up_first"  # or "need" (see decode_schedule)
    evict_first: bool = True  # L2 evict-first hint on the weight copies
    poll_ns: int = 64  # back-off between polls of the activations
    score_poll_ns: int = 64  # with the router inside: back-off between polls of the exchanged scores
    dependent_launch: bool = True  # programmatic dependent launch
    cooperative: bool = True  # ask the driver to guarantee all blocks resident
    trace: bool = False  # per-block globaltimer stamps (diagnostics)
    act_copies: int = 8  # copies of the activations in global memory (reads spread over more L2 slices)
    refresh_pending: bool = True  # each poll round reloads the stale activations of every pair not yet staged
    unroll_pairs: bool = True  # the down loop over slot pairs unrolled (False: one copy of its code)
    # with the router inside: only the kept groups' warps rank their experts, and only their best are
    # candidates (moe_decode.cu FAST_SELECT; the same choices, fewer instructions; on since the twelfth
    # session: neutral in the H200's decode step (docs/results/h200_ab_lab15.log); with the MLA switches and
    # CudaRouter.fast_select, verification 5.084 -> 5.022 ms at 32K on the H100 (h100_ab_mla_lab13.log))
    fast_select: bool = True
    # the producer issues the down copies only once this many of its earlier gate_up tiles have landed (0: at
    # once; moe_decode.cu DOWN_AFTER), so that the gate_up bytes every block waits for are not served beside
    # down bytes needed only after the activation exchange. 7 (all of a block's, at Ling shapes) since the
    # fifteenth session: -26.5 us on the decode step at 32K on the H100 (docs/results/h100_ab_lab18.log)
    down_after: int = 7
    # with the router inside: each selection lane reads its expert's bias before the wait, not after its
    # score arrived (moe_decode.cu BIAS_EARLY: one L2 round trip off the routing's path; the same choices).
    # On since the fifteenth session: -28.0 us on the decode step at 32K on the H100 (same log)
    bias_early: bool = True
    # with the router inside: the gate_up warps load x before the inputs' barrier, beside the publisher's read
    # of the launch number, not after it (moe_decode.cu X_EARLY: the same results)
    x_early: bool = True
    # with regions set (PersistentDecodeMoE.prefetch_next): when the kernel asks the L2 for them (moe_decode.cu
    # L2_NEXT_AT): 0 never, 1 once a block's copies landed, 2 once its activation exchange is done, 3 at its end,
    # 4 as soon as the previous kernel is complete (while it routes); 5 and 6 by the down warps with a line prefetch
    # each (the load path, not the copy engine), 5 once the previous kernel is complete, 6 before.
    # FusedDecodeStep.prefetch_next_weights sets it (1 on the cards of solo.fastpath.decode_step.L2_NEXT_CARDS)
    l2_next_at: int = 0
    # the tile schedule's balance (decode_schedule, BALANCES). "bytes" gives some blocks one gate_up tile more than
    # the byte share of the others (7 against 6 at Ling shapes, where the shared memory fits no other split), and
    # the activation exchange waits for the last gate_up tile anywhere; "gate_up" gives every block 5 or 6 and the
    # lighter ones a third down tile, which fits only with x_in_tiles (lost on the H100: the late blocks are late for
    # their gate_up warps' queue of tiles, not their bytes; docs/kernels.md)
    balance: str = "bytes"
    # x (the token's activations, 5 KB at Ling shapes) kept in the block's down area of the tile memory until the
    # gate_up warps hold it in registers (moe_decode.cu X_IN_TILES: the first down copy waits for them), not in a
    # buffer of its own
    x_in_tiles: bool = False
    # the producer keeps at most this many gate_up tiles in flight (moe_decode.cu GU_WINDOW; 0: all at once), so that
    # they land one after another while the gate_up warps work, not together at the end of the stream.
    # FusedDecodeStep.set_gate_up_window sets it (3 on the cards of solo.fastpath.decode_step.GATE_UP_WINDOW_CARDS)
    gate_up_window: int = 0
    # with gate_up_window: the window spans the down copies too (every copy group in issue order; WINDOW_DOWNS)
    window_downs: bool = False
    # the down warps do the first this many slot pairs' down products themselves while the gate_up warps still work
    # (moe_decode.cu EARLY_PAIRS; 0: every pair after the gate_up tiles, on every compute warp), and the schedule
    # issues those pairs' down rows right after the block's gate_up tiles of the pair (decode_schedule's early_pairs);
    # the same results bit for bit. Not with the shared expert inside. Lost on the H100 (twenty-first session): +121 /
    # +175 us a decode step at 32K for 1 / 2 pairs (docs/results/h100_ab_lab48.log): a pair's activations come only
    # with the slowest block's tiles of its slots, and its early down rows delay the gate_up tiles
    early_pairs: int = 0
    # with the router inside: each selection lane keeps four loads of its score in flight, this many ns apart
    # (moe_decode.cu SCORE_STAGGER; 0: one load, the back-off score_poll_ns, the next), so that a score is seen
    # about one L2 round trip after it lands instead of up to two; the same choices
    score_stagger: int = 0
    # with trace and the router inside: the selection runs twice (one copy of its code) and the trace stamps the
    # second run (moe_decode.cu SELECT_TWICE): what fetching its instructions costs the first; the same results
    select_twice: bool = False
    # with the router inside and fast_select: the groups ranked once, lane g group g, and only the ballot of the kept
    # groups kept (moe_decode.cu LEAN_SELECT); each lane's own group's rank zeroed keys no kept warp reads. The same
    # choices, half the group ranking's instructions. On since the twenty-second session: the kernel alone 18.51 ->
    # 18.05 us; the decode step at 32K on the H100 -0.1 / -8.1 us as a variant (docs/results/h100_ab_lab53.log), and
    # the selection as before +13.7 us against it as the product (docs/results/h100_ab_lab54.log)
    lean_select: bool = True
    # with the router inside: the threads that rank the top-k write the chosen experts for the producer, which starts
    # its copies after the ranking's barrier, not after warp 0 has also summed and divided the weights (moe_decode.cu
    # EARLY_IDS; the same results). Not with l2_next_at 5 or 6 (named barrier 1) or select_twice
    early_ids: bool = False
    # with the router inside: the producer warp alone chooses the experts from every expert's key and score, which the
    # selection warps write into shared memory (moe_decode.cu WARP_SELECT: warp reductions instead of ranks and
    # barriers, and the producer holds the experts it copies; the same choices and weights). Where groups are whole
    # 32-expert columns or there is no group limit (elsewhere the selection warps choose). Not with early_ids or
    # select_twice
    warp_select: bool = False
    probe: str = ""  # diagnostics, WRONG results, timing only: one of PROBES

    @property
    def probe_code(self) -> int:
        if self.probe not in PROBES:
            raise ValueError(f"probe must be one of {', '.join(map(repr, PROBES))}, got {self.probe!r}")
        return PROBES.index(self.probe)

    def defines(self) -> dict[str, int]:
        """moe_decode.cu's defines for these variants (the shapes, router and shared expert add theirs)."""
        if self.l2_next_at not in range(7):
            raise ValueError(f"l2_next_at must be 0 (never) or 1..6, got {self.l2_next_at}")
        if self.gate_up_window < 0:
            raise ValueError(f"gate_up_window is 0 (all at once) or the tiles in flight, got {self.gate_up_window}")
        if self.window_downs and not self.gate_up_window:
            raise ValueError("window_downs spans the down copies with gate_up_window's window: set gate_up_window")
        if self.balance not in BALANCES:
            raise ValueError(f"balance must be one of {', '.join(map(repr, BALANCES))}, got {self.balance!r}")
        if self.early_pairs < 0:
            raise ValueError(f"early_pairs is 0 (none) or the pairs the down warps do first, got {self.early_pairs}")
        if self.score_stagger < 0:
            raise ValueError(f"score_stagger is 0 (off) or ns between a lane's score loads, got {self.score_stagger}")
        if self.select_twice and not self.trace:
            raise ValueError("select_twice is a probe of the traced kernel: set trace too")
        if self.warp_select and (self.early_ids or self.select_twice):
            raise ValueError("warp_select: the producer chooses the experts; not with early_ids or select_twice")
        if self.early_ids and (self.l2_next_at in (5, 6) or self.select_twice):
            raise ValueError(
                "early_ids cannot run with l2_next_at 5 or 6 (both take named barrier 1) or with select_twice"
            )
        return {
            "EVICT_FIRST": int(self.evict_first),
            "TRACE": int(self.trace),
            "POLL_NS": self.poll_ns,
            "SCORE_POLL_NS": self.score_poll_ns,
            "ACT_COPIES": self.act_copies,
            "PROBE": self.probe_code,
            "REFRESH_PENDING": int(self.refresh_pending),
            "UNROLL_PAIRS": int(self.unroll_pairs),
            "FAST_SELECT": int(self.fast_select),
            "DOWN_AFTER": self.down_after,
            "BIAS_EARLY": int(self.bias_early),
            "X_EARLY": int(self.x_early),
            "L2_NEXT_AT": self.l2_next_at,
            "X_IN_TILES": int(self.x_in_tiles),
            "GU_WINDOW": self.gate_up_window,
            "WINDOW_DOWNS": int(self.window_downs),
            "EARLY_PAIRS": self.early_pairs,
            "SCORE_STAGGER": self.score_stagger,
            "SELECT_TWICE": int(self.select_twice),
            "LEAN_SELECT": int(self.lean_select),
            "EARLY_IDS": int(self.early_ids),
            "WARP_SELECT": int(self.warp_select),
        }


@dataclass(frozen=True)
class DecodeSchedule:
    table: torch.Tensor  # int32 [blocks, row_words]
    max_gate_up: int
    max_down: int
    block_bytes: list[int]  # weight bytes each block copies

    @property
    def most_bytes(self) -> int:
        return max(self.block_bytes)


def tile_bytes(hidden: int, inter: int, top_k: int) -> tuple[int, int]:
    """Shared-memory bytes of a gate_up tile and of a down tile, scale rows included (moe_decode.cu)."""
    return 8 * hidden + hidden // 2, top_k * (4 * inter + inter // 4)


def decode_schedule(
    blocks: int,
    hidden: int,
    inter: int,
    top_k: int,
    order: str = "gate_up_first",
    balance: str = "bytes",
    early_pairs: int = 0,
) -> DecodeSchedule:
    """The tile-to-block table the kernel reads (layout: moe_decode.cu, ROW_WORDS).

    A block's down tiles are consecutive output rows (one copy per slot moves them all). Copy order
    per block: "gate_up_first": its gate_up tiles (by slot), then its down rows slot pair by slot
    pair; "need": each slot pair's down rows right after the block's gate_up tiles of that pair;
    `early_pairs` (DecodeKernelConfig.early_pairs, which the down warps do first): those pairs' down rows as
    in "need" whatever the order.
    Balance: "bytes": the down tiles spread evenly, then each gate_up tile (in slot order) to the block
    with the fewest bytes; "gate_up": each gate_up tile (in slot order) to the block with the fewest
    gate_up tiles, then the down tiles' counts so that the blocks' bytes are as even as whole tiles allow
    (the ones with fewer gate_up tiles take more)."""
    if order not in ORDERS:
        raise ValueError(f"order must be one of {', '.join(ORDERS)}, got {order!r}")
    if balance not in BALANCES:
        raise ValueError(f"balance must be one of {', '.join(BALANCES)}, got {balance!r}")
    gu_bytes, dn_bytes = tile_bytes(hidden, inter, top_k)
    pairs = top_k // 2
    if not 0 <= early_pairs < pairs:
        raise ValueError(f"early_pairs must be 0..{pairs - 1} (the down warps leave the last pair), got {early_pairs}")
    in_need_order = pairs if order == "need" else early_pairs  # pairs whose down rows follow their own gate_up tiles
    gate_up: list[list[tuple[int, int]]] = [[] for _ in range(blocks)]
    if balance == "bytes":
        counts = [hidden // 8 // blocks + (b < hidden // 8 % blocks) for b in range(blocks)]
        heap = [(counts[b] * dn_bytes, b) for b in range(blocks)]
        step = gu_bytes
    else:
        heap = [(0, b) for b in range(blocks)]
        step = 1
    heapq.heapify(heap)
    for slot in range(top_k):
        for r in range(inter // 8):
            load, b = heapq.heappop(heap)
            gate_up[b].append((slot, 8 * r))
            heapq.heappush(heap, (load + step, b))
    if balance == "gate_up":  # each down tile to the block with the fewest bytes (ties: the lower index)
        counts = [0] * blocks
        heap = [(len(gate_up[b]) * gu_bytes, b) for b in range(blocks)]
        heapq.heapify(heap)
        for _ in range(hidden // 8):
            load, b = heapq.heappop(heap)
            counts[b] += 1
            heapq.heappush(heap, (load + dn_bytes, b))
    # each block's down tiles are consecutive rows, so one copy per slot moves all of them
    down: list[list[int]] = []
    first = 0
    for n in counts:
        down.append([8 * (first + j) for j in range(n)])
        first += n
    max_gu = max(len(x) for x in gate_up)
    max_dn = max(len(x) for x in down)
    row_words = 2 + max_gu + max_dn + max_gu + pairs
    table = torch.zeros((blocks, row_words), dtype=torch.int32)
    block_bytes = []
    for b in range(blocks):
        gus, dns = gate_up[b], down[b]
        groups: list[int] = []
        done_pairs = 0 if dns else pairs  # a block without down rows copies none
        for i, (slot, _) in enumerate(gus):
            while done_pairs < in_need_order and slot >= 2 * done_pairs + 2:
                groups.append(max_gu + done_pairs)
                done_pairs += 1
            groups.append(i)
        groups += [max_gu + p for p in range(done_pairs, pairs)]
        row = [len(gus), len(dns)]
        row += [slot << 16 | r for slot, r in gus] + [0] * (max_gu - len(gus))
        row += dns + [0] * (max_dn - len(dns))
        row += groups + [0] * (max_gu + pairs - len(groups))
        table[b] = torch.tensor(row, dtype=torch.int32)
        block_bytes.append(len(gus) * gu_bytes + len(dns) * dn_bytes)
    return DecodeSchedule(table, max_gu, max_dn, block_bytes)


def shared_tail(sched: DecodeSchedule, hidden: int, inter: int, top_k: int, shared_inter: int) -> tuple[int, list[int]]:
    """Where the shared expert's weights go in each block's tile area (moe_decode.cu SHARED): the byte
    offset of the tail (128-aligned) that holds a block's gate_up rows (16 rows of `hidden`) and its
    shared down rows (8 per down tile, `shared_inter` wide), and per block the first copy group (in
    issue order) whose bytes land in that tail, which the producer issues only once the shared expert
    is done with it (the block's group count where none does). Raises ValueError where it does not fit."""
    tail = 16 * hidden + 8 * sched.max_down * shared_inter
    offset = (sched.most_bytes - tail) // 128 * 128
    if offset < 0:
        raise ValueError(f"the shared expert's {tail} bytes exceed the {sched.most_bytes}-byte tile area")
    gu_bytes, dn_bytes = tile_bytes(hidden, inter, top_k)
    slot_bytes = dn_bytes // top_k  # one slot's words and scales for one down tile
    pairs = top_k // 2
    waits = []
    for row in sched.table.tolist():
        n_gu, n_dn = row[0], row[1]
        order = row[2 + sched.max_gate_up + sched.max_down :][: n_gu + (pairs if n_dn else 0)]
        first = len(order)
        for q, code in enumerate(order):
            if code < sched.max_gate_up:
                end = (code + 1) * gu_bytes
            else:
                p = code - sched.max_gate_up
                end = n_gu * gu_bytes + (2 * p + 2) * n_dn * slot_bytes
            if end > offset:
                first = q
                break
        waits.append(first)
    return offset, waits


def with_shared_column(sched: DecodeSchedule, waits: list[int]) -> DecodeSchedule:
    """The schedule with each block's first copy group into the shared tail as its row's last word."""
    column = torch.tensor(waits, dtype=torch.int32).unsqueeze(1)
    return DecodeSchedule(torch.cat([sched.table, column], dim=1), sched.max_gate_up, sched.max_down, sched.block_bytes)

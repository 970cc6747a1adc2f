"""The CUDA step kernels' launch arithmetic (solo.kernels.cuda_step), on the CPU: the persistent grid
(every task run once, by the block the kernel's loop gives it; the balanced grid no slower in rounds and
even in its blocks' loads), the warps that split K and the loads kept in flight."""

from __future__ import annotations

import itertools
import random

import pytest

# solo.kernels.cuda_step imports Triton: imported inside the tests, not at collection, where it would
# come before the modules that turn on Triton's CPU interpreter (they do so only if Triton is not loaded)


def rounds_per_block(tasks: int, grid: int) -> list[int]:
    """Tasks each block runs, as gemv_decode.cu's loop assigns them (task = block, block + grid, ...)."""
    counts = [0] * grid
    for task in range(tasks):
        counts[task % grid] += 1
    return counts


@pytest.mark.parametrize(
    ("tasks", "resident"),
    [(2564, 792), (320, 132), (320, 528), (96, 1056), (1537, 132 * 6)]
    + [(random.randint(1, 5000), random.randint(1, 2000)) for _ in range(20)],
)
def test_the_balanced_grid_keeps_the_rounds_and_evens_the_blocks(tasks, resident):
    from solo.kernels.cuda_step import persistent_grid

    plain, balanced = persistent_grid(tasks, resident), persistent_grid(tasks, resident, balanced=True)
    assert plain == min(tasks, resident) and 1 <= balanced <= plain
    full, even = rounds_per_block(tasks, plain), rounds_per_block(tasks, balanced)
    assert sum(even) == tasks and max(even) == max(full)  # every task once, no more rounds
    assert sum(c < max(even) for c in even) < max(even)  # fewer than `rounds` blocks run one task fewer
    assert min(even) >= max(even) - 1


def test_the_kda_projections_grid():
    """The case the balanced grid is for: 2,564 tasks over 792 resident blocks (188 of them with a fourth
    task) becomes 641 blocks of exactly 4."""
    from solo.kernels.cuda_step import persistent_grid

    assert rounds_per_block(2564, persistent_grid(2564, 792)).count(4) == 188
    assert persistent_grid(2564, 792, balanced=True) == 641
    assert set(rounds_per_block(2564, 641)) == {4}


def test_warps_divide_the_steps_and_the_ring_tiles_them():
    from solo.kernels.cuda_step import in_flight, warps_for

    for k in (768, 2560, 4096, 6144):
        for wanted in (4, 8, 10, 16):
            w = warps_for(k, wanted)
            assert 1 <= w <= wanted and (k // 64) % w == 0
            pf = in_flight(k // 64 // w, 8)
            assert 1 <= pf <= 8 and (k // 64 // w) % pf == 0


@pytest.mark.parametrize("tokens", [1, 4, 8])
@pytest.mark.parametrize(
    ("rows", "k", "warps", "swiglu"),
    [
        (20512, 2560, 4, False),
        (2560, 4096, 16, False),
        (768, 2560, 10, True),
        (2560, 6144, 16, False),
        (2560, 768, 12, False),
    ],
)
@pytest.mark.parametrize("per_sm", [1, 2, 3])
def test_the_bulk_ring_fits_its_share_of_the_sm(rows, k, warps, swiglu, tokens, per_sm):
    """gemv_decode.cu BULK's ring: at least two slots or none (the register path), within a block's share
    of an SM's shared memory, no more slots than asked for or than the block has tasks (unless two)."""
    from solo.kernels.cuda_step import SHARED_PER_BLOCK, SHARED_PER_SM, GemvLaunch, bulk_ring

    tasks = -(-rows // 8)
    for wanted, scales in itertools.product((2, 5, 12), (False, True)):
        if scales and -(-k // 128) % 4:  # (SCALE_IN_SLOT needs rows of whole 16-byte pieces)
            with pytest.raises(ValueError, match="16-byte"):
                bulk_ring(tokens, k, warps, swiglu, GemvLaunch(bulk=per_sm), tasks, 132, scales=True)
            continue
        cfg = GemvLaunch(bulk=per_sm, slots=wanted)
        slots, shared = bulk_ring(tokens, k, warps, swiglu, cfg, tasks, 132, scales=scales)
        if slots == 0:
            assert shared == 0
            continue
        base = tokens * (2 * k + 132 * warps)
        assert 2 <= slots <= max(2, min(wanted, -(-tasks // (per_sm * 132))))
        slot = (2 if swiglu else 1) * (8 * (k + 64) + (4 * -(-k // 128) if scales else 0))
        assert base + slots * slot <= shared
        assert shared <= min(SHARED_PER_BLOCK, SHARED_PER_SM // per_sm - 1024) and shared % 16 == 0
    # the KDA projections of one token: one block an SM holds 10 slots (210 KB in flight)
    assert bulk_ring(1, 2560, 8, False, GemvLaunch(bulk=1), 2564, 132)[0] == 10


@pytest.mark.parametrize("rows", [20512, 6816, 6144, 4096, 4095, 2560, 1536, random.randint(8, 30000)])
@pytest.mark.parametrize("card", ["NVIDIA H100 80GB HBM3", "NVIDIA H200", "NVIDIA H100 PCIe", ""])
def test_verification_takes_the_window_ring_only_on_its_cards_and_big_projections(rows, card):
    """The product's launch: 4 warps for thousands of rows, 16 below BIG_PROJECTION_ROWS; verification's
    calls of the big projections through WINDOW_RING on the cards it was measured faster on, elsewhere the
    one-token launch (no window)."""
    from solo.kernels.cuda_step import BIG_PROJECTION_ROWS, WINDOW_RING, WINDOW_RING_CARDS, choose_launch

    launch = choose_launch(rows, card)
    big = rows >= BIG_PROJECTION_ROWS
    assert launch.warps == (4 if big else 16) and launch.bulk == 0  # one token: the register path
    assert launch.window == (WINDOW_RING if big and card in WINDOW_RING_CARDS else None)
    assert choose_launch(rows) == choose_launch(rows, "some other GPU")
    if launch.window is not None:
        assert (launch.window.bulk, launch.window.warps, launch.window.window) == (2, 10, None)


def order_of(rows: int, rotate: int) -> list[int]:
    """The tasks in gemv_decode.cu's order (TASK_AT: position seq runs task (seq + ROTATE) mod TASKS)."""
    tasks = -(-rows // 8)
    return [(seq + rotate) % tasks if rotate else seq for seq in range(tasks)]


def _random_handoff() -> tuple[int, int, int]:
    rows = random.randrange(16, 30000, 8)
    first, last = sorted(random.sample(range(rows // 8 + 1), 2))
    return rows, 8 * first, 8 * last


@pytest.mark.parametrize(
    ("rows", "start", "end"),
    [(20512, 16384, 20480), (20512, 20480, 20512), (20512, 0, 8), (2564, 2552, 2560), (4104, 0, 4104)]
    + [_random_handoff() for _ in range(20)],
)
def test_a_handoff_orders_its_last_rows_last_and_signals_every_other_task(rows, start, end):
    """The KDA projections' hand-off: g (rows 16,384..20,479 of 20,512) after q, k, v, f and b. Every
    task runs once, the hand-off's tasks are exactly the order's tail, and every block whose position is
    among the first SIGNAL signals exactly once (the count the KDA kernel waits for)."""
    from solo.kernels.cuda_step import persistent_grid, task_order

    rotate, signal = task_order(rows, start, end)
    order = order_of(rows, rotate)
    tasks = -(-rows // 8)
    assert sorted(order) == list(range(tasks))
    assert set(order[signal:]) == set(range(start // 8, end // 8)), "the hand-off's rows end the order"
    assert len(order[signal:]) == (end - start) // 8
    for resident in {1, 7, 132, 792, 900, tasks}:
        grid = persistent_grid(tasks, resident)
        # a block signals at its last position below SIGNAL (gemv_decode.cu: seq < SIGNAL <= seq + grid)
        signals = [seq for seq in range(tasks) if seq < signal <= seq + grid]
        assert len(signals) == min(grid, signal) and len({seq % grid for seq in signals}) == len(signals)


@pytest.mark.parametrize(("start", "end"), [(4, 16), (16, 16), (24, 16), (0, 20520), (-8, 8)])
def test_a_handoff_of_rows_that_are_not_whole_tasks_is_refused(start, end):
    from solo.kernels.cuda_step import task_order

    with pytest.raises(ValueError, match="whole 8-row tasks"):
        task_order(20512, start, end)


def test_the_routers_scratch_outlives_its_kernel(monkeypatch):
    """A CUDA router's scores and arrival counters are made once per token count and kept when its kernel
    is built again (an A/B variant): graphs captured before count in them (the eleventh session's A/B lost
    them under such graphs and hung)."""
    import torch

    import solo.kernels.cuda_runtime as runtime
    from solo.kernels.cuda_step import CudaRouter
    from solo.kernels.fused_router import FusedRouter

    built = []
    monkeypatch.setattr(runtime, "CudaKernel", lambda *args: built.append(args) or object())
    experts, hidden = 256, 2560
    counters = torch.zeros(3, dtype=torch.int32)
    fused = FusedRouter(
        torch.randn(experts, hidden).to(torch.bfloat16),
        torch.randn(experts),
        torch.randn(hidden).to(torch.bfloat16),
        1e-6,
        8,
        8,
        4,
        True,
        2.5,
        counters[0:1],
        counters[1:2],
    )
    router = CudaRouter(fused, counters[2:3])
    tokens = random.randint(1, 8)
    router.kernel(tokens)
    scores, arrived = router.scratch(tokens)
    assert scores.shape == (tokens, experts) and torch.equal(arrived, torch.zeros(2, dtype=torch.int32))
    router._kernels = {}  # as an A/B does for a variant
    router.kernel(tokens)
    assert len(built) == 2 and all(a is b for a, b in zip(router.scratch(tokens), (scores, arrived), strict=True))


@pytest.mark.parametrize(
    "rows,row_bytes,start,nbytes,want",
    [
        (100, 10, 0, 250, [(0, 250)]),  # from row 0: one range
        (100, 10, 90, 250, [(900, 100), (0, 150)]),  # a rotated order wraps to row 0
        (100, 10, 90, 100, [(900, 100)]),  # exactly to the end
        (100, 10, 0, 5000, [(0, 1000)]),  # at most the whole weight
        (100, 10, 50, 5000, [(500, 500), (0, 500)]),
        (100, 10, 3, 0, []),
    ],
)
def test_the_bytes_a_projection_reads_first_follow_its_task_order(rows, row_bytes, start, nbytes, want):
    """FusedDecodeStep.prefetch_next_weights asks the L2 for the next input projection's first bytes in the
    order its one-token GEMV reads them: from the hand-off's rotated first row on, then from row 0."""
    from solo.fastpath.decode_step import reading_order_bytes

    assert reading_order_bytes(rows, row_bytes, start, nbytes) == want
    covered = sum(n for _, n in want)
    assert covered == min(nbytes, rows * row_bytes)
    with pytest.raises(ValueError, match="starts at a row"):
        reading_order_bytes(rows, row_bytes, rows, nbytes)


@pytest.mark.parametrize("card", ["NVIDIA H100 80GB HBM3", "NVIDIA H200", "NVIDIA A100-SXM4-80GB", ""])
def test_the_moe_kernels_ask_the_l2_for_later_weights_only_on_the_cards_measured(card):
    """The product's FusedDecodeStep.prefetch_next_weights is set at construction where l2_next_for gives a
    size: on the cards of L2_NEXT_CARDS (measured there), the next input projection's first wave of tasks."""
    from solo.fastpath.decode_step import L2_NEXT_CARDS, L2_NEXT_MEGABYTES, l2_next_for

    want = L2_NEXT_MEGABYTES if card == "NVIDIA H100 80GB HBM3" else None
    assert l2_next_for(card) == want
    assert (l2_next_for(card) is not None) == (card in L2_NEXT_CARDS)


@pytest.mark.parametrize("card", ["NVIDIA H100 80GB HBM3", "NVIDIA H200", ""])
def test_the_moe_kernels_keep_their_gate_up_tiles_in_a_window_only_on_the_cards_measured(card):
    """FusedDecodeStep.set_gate_up_window is set at construction where gate_up_window_for gives a window: on the cards
    of GATE_UP_WINDOW_CARDS (measured there); elsewhere the MoE kernels ask for all their tiles at once (the kernel
    config's default, as the other backends' users get it)."""
    from solo.fastpath.decode_step import GATE_UP_WINDOW, GATE_UP_WINDOW_CARDS, gate_up_window_for
    from solo.kernels.cuda_moe_plan import DecodeKernelConfig

    assert gate_up_window_for(card) == (3 if card in ("NVIDIA H100 80GB HBM3", "NVIDIA H200") else 0)
    assert (gate_up_window_for(card) > 0) == (card in GATE_UP_WINDOW_CARDS) and GATE_UP_WINDOW == 3
    assert DecodeKernelConfig().gate_up_window == 0


@pytest.mark.parametrize("card", ["NVIDIA H100 80GB HBM3", "NVIDIA H200", "NVIDIA H100 PCIe", ""])
def test_one_token_mla_attention_is_the_gluon_ring_only_on_the_cards_measured(card):
    """FusedMLA's one-token attention is the Gluon ring only on the cards of GLUON_RING_CARDS (measured there in the
    whole decode step); the class's launches leave it off (set per card at construction), verification never."""
    from solo.kernels.fused_mla import GLUON_RING_CARDS, FusedMLA, gluon_ring_for

    assert gluon_ring_for(card) == (card in ("NVIDIA H100 80GB HBM3", "NVIDIA H200"))
    assert gluon_ring_for(card) == (card in GLUON_RING_CARDS)
    assert not FusedMLA.ONE_TOKEN.gluon and not FusedMLA.WINDOW.gluon


@pytest.mark.parametrize("card", ["NVIDIA H100 80GB HBM3", "NVIDIA H200", "NVIDIA H100 PCIe", ""])
def test_verification_mla_attention_is_the_gluon_ring_only_on_the_cards_measured(card):
    """Verification's attention is the Gluon ring only on the cards of GLUON_WINDOW_CARDS, where it is measured in the
    whole verification step: the H100 (thirty-seventh session); the class's launch leaves it off (set per card at
    construction)."""
    from solo.kernels.fused_mla import GLUON_WINDOW_CARDS, FusedMLA, gluon_window_for

    assert gluon_window_for(card) == (card in GLUON_WINDOW_CARDS)
    assert gluon_window_for(card) == (card == "NVIDIA H100 80GB HBM3") and not FusedMLA.WINDOW.gluon


@pytest.mark.parametrize("card", ["NVIDIA H100 80GB HBM3", "NVIDIA H200", "NVIDIA H100 PCIe", ""])
def test_verification_shared_gate_up_runs_beside_its_router_only_on_the_cards_measured(card):
    """Verification's shared gate_up runs beside its router only on the cards of SHARED_BESIDE_CARDS, where it is
    measured in the whole verification step: the H100 (thirty-seventh session); the class leaves it off (a step sets it
    for its card at construction)."""
    from solo.fastpath.decode_step import SHARED_BESIDE_CARDS, FusedDecodeStep, shared_beside_for

    assert shared_beside_for(card) == (card in SHARED_BESIDE_CARDS) == (card == "NVIDIA H100 80GB HBM3")
    assert FusedDecodeStep.shared_beside_router is False


@pytest.mark.parametrize("card", ["NVIDIA H100 80GB HBM3", "NVIDIA H200", ""])
def test_verification_shared_down_runs_beside_its_router_only_on_the_cards_measured(card):
    """Verification's shared down (with its gate_up) runs beside its router only on the cards of
    SHARED_DOWN_BESIDE_CARDS, none until measured in the whole verification step; the class leaves it off."""
    from solo.fastpath.decode_step import SHARED_DOWN_BESIDE_CARDS, FusedDecodeStep, shared_down_beside_for

    assert shared_down_beside_for(card) == (card in SHARED_DOWN_BESIDE_CARDS) is False
    assert FusedDecodeStep.shared_down_beside is False


@pytest.mark.parametrize("card", ["NVIDIA H100 80GB HBM3", "NVIDIA H200"])
def test_one_token_mla_asks_the_l2_for_old_rows_early_only_on_the_cards_measured(card):
    """FusedMLA's one-token launch asks for each split's first step of old cache rows before its wait only on the
    cards of EARLY_CHUNK_CARDS (measured there); verification's launch never (the plain attention's)."""
    from solo.kernels.fused_mla import EARLY_CHUNK_CARDS, FusedMLA, early_chunks_for

    assert early_chunks_for(card) == (1 if card == "NVIDIA H100 80GB HBM3" else 0)
    assert (early_chunks_for(card) > 0) == (card in EARLY_CHUNK_CARDS)
    assert FusedMLA.ONE_TOKEN.early_chunks == 0 and FusedMLA.WINDOW.early_chunks == 0  # (set per card at construction)

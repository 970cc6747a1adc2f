"""The persistent one-token MoE kernel (``--moe-backend cuda``).

CPU: the tile schedule the kernel reads (every tile exactly once, byte balance, copy order, the
table layout) and the clear error where the backend cannot run. GPU (``-m gpu``, skipped without a
Hopper GPU): the kernel against an fp32 reference on fresh random weights and routings, poisoned
outputs, graph replays, the launch counter across its wrap, and which calls take the kernel.
"""

from __future__ import annotations

import pytest
import torch

from solo.kernels.cuda_moe_plan import DecodeKernelConfig, decode_schedule, tile_bytes
from solo.kernels.moe import MXFP4Experts
from solo.kernels.registry import BackendUnavailable, make_moe_backend
from solo.testing.moe import moe_reference_fp32, random_mxfp4_experts

SHAPES = [(132, 2560, 768, 8), (114, 2560, 768, 8), (20, 512, 256, 6), (7, 256, 256, 2), (40, 256, 256, 4)]


def decode_row(row: list[int], max_gu: int, max_dn: int, pairs: int):
    n_gu, n_dn = row[0], row[1]
    gu = [(c >> 16, c & 0xFFFF) for c in row[2 : 2 + n_gu]]
    dn = row[2 + max_gu : 2 + max_gu + n_dn]
    order = row[2 + max_gu + max_dn :][: n_gu + (pairs if n_dn else 0)]
    return gu, dn, order


@pytest.mark.parametrize("blocks,hidden,inter,top_k", SHAPES)
@pytest.mark.parametrize("order", ["need", "gate_up_first"])
@pytest.mark.parametrize("balance", ["bytes", "gate_up"])
def test_schedule_covers_every_tile_once_in_need_order(blocks, hidden, inter, top_k, order, balance):
    sched = decode_schedule(blocks, hidden, inter, top_k, order, balance)
    pairs = top_k // 2
    gu_bytes, dn_bytes = tile_bytes(hidden, inter, top_k)
    seen_gu, seen_dn = [], []
    for b in range(blocks):
        gu, dn, groups = decode_row(sched.table[b].tolist(), sched.max_gate_up, sched.max_down, pairs)
        seen_gu += gu
        seen_dn += dn
        assert sched.block_bytes[b] == len(gu) * gu_bytes + len(dn) * dn_bytes
        assert gu == sorted(gu)  # a block's gate_up tiles by slot
        assert dn == list(range(dn[0], dn[0] + 8 * len(dn), 8)) if dn else True  # consecutive rows
        # every copy group exactly once: gate_up tile i is code i, slot pair p's down rows max_gu + p
        down_groups = [sched.max_gate_up + p for p in range(pairs)] if dn else []
        assert sorted(groups) == sorted(list(range(len(gu))) + down_groups)
        position = {code: k for k, code in enumerate(groups)}
        for p, code in enumerate(down_groups):
            if p:  # the pairs in order
                assert position[code] > position[code - 1]
            for i, (slot, _) in enumerate(gu):
                if order == "gate_up_first" or slot <= 2 * p + 1:
                    assert position[i] < position[code]  # the pair's own gate_up tiles (all of them) come first
    assert sorted(seen_gu) == [(s, 8 * r) for s in range(top_k) for r in range(inter // 8)]
    assert sorted(seen_dn) == [8 * j for j in range(hidden // 8)]
    # balanced by bytes: no block more than one gate_up tile above the lightest it could have been
    assert sched.most_bytes - min(sched.block_bytes) <= gu_bytes + dn_bytes
    if balance == "gate_up":  # gate_up tiles first: no block two above another; then the bytes as even as they go
        counts = [int(n) for n in sched.table[:, 0]]
        assert max(counts) - min(counts) <= 1
        assert sched.max_gate_up == -(-top_k * inter // 8 // blocks)


def test_schedule_at_ling_shapes_fits_an_h200():
    sched = decode_schedule(132, 2560, 768, 8)
    assert (sched.max_gate_up, sched.max_down) == (7, 3)
    assert sched.most_bytes <= 227 * 1024 - 24 * 1024  # room left for the staged activations
    assert sum(sched.block_bytes) == 8 * (1536 * 1280 + 1536 * 80) + 8 * (2560 * 384 + 2560 * 24)


def test_schedule_at_ling_shapes_balanced_by_gate_up_tiles():
    """Balanced by bytes, 32 blocks take 7 gate_up tiles (the only nine-tile share that fits beside the Smem struct);
    balanced by gate_up tiles every block takes 5 or 6, and the blocks of 5 a third down tile. Its heaviest share
    fits an H200's or H100's 227 KB only with x in the tile memory (DecodeKernelConfig.x_in_tiles)."""
    from solo.kernels.cuda_moe import RouterSpec, _shared_bytes

    bytes_first = decode_schedule(132, 2560, 768, 8)
    gate_up_first = decode_schedule(132, 2560, 768, 8, balance="gate_up")
    shares = {(int(r[0]), int(r[1])) for r in gate_up_first.table}
    assert shares == {(6, 2), (6, 3), (5, 3)} and (7, 2) in {(int(r[0]), int(r[1])) for r in bytes_first.table}
    assert sum(gate_up_first.block_bytes) == sum(bytes_first.block_bytes)
    router, limit = RouterSpec(512, 8, 4, True, 132), 232_448
    assert _shared_bytes(bytes_first, 2560, 768, 8, router, 4) <= limit
    assert _shared_bytes(gate_up_first, 2560, 768, 8, router, 4) > limit
    assert _shared_bytes(gate_up_first, 2560, 768, 8, router, 4, x_in_tiles=True) <= limit


@pytest.mark.parametrize(  # (the down warps leave the last pair)
    "blocks,hidden,inter,top_k,early_pairs", [(*s, e) for s in SHAPES for e in (1, 2) if e < s[3] // 2]
)
def test_schedule_puts_early_pairs_down_rows_after_their_own_tiles(blocks, hidden, inter, top_k, early_pairs):
    """DecodeKernelConfig.early_pairs: the pairs the down warps do first have their down rows right after the block's
    gate_up tiles of the pair (before any tile of a later slot), the later pairs after every gate_up tile; the tiles
    and their owners are the product's."""
    pairs = top_k // 2
    sched = decode_schedule(blocks, hidden, inter, top_k, early_pairs=early_pairs)
    product = decode_schedule(blocks, hidden, inter, top_k)
    assert sched.block_bytes == product.block_bytes
    for b in range(blocks):
        gu, dn, groups = decode_row(sched.table[b].tolist(), sched.max_gate_up, sched.max_down, pairs)
        assert (gu, dn) == decode_row(product.table[b].tolist(), sched.max_gate_up, sched.max_down, pairs)[:2]
        if not dn:
            continue
        position = {code: k for k, code in enumerate(groups)}
        for p in range(pairs):
            code = sched.max_gate_up + p
            for i, (slot, _) in enumerate(gu):
                if p >= early_pairs or slot <= 2 * p + 1:
                    assert position[i] < position[code]  # its own tiles (early) or every tile (later pairs) first
                else:
                    assert position[i] > position[code]  # early: before any tile of a later slot


def test_schedule_rejects_early_pairs_beyond_the_last():
    with pytest.raises(ValueError, match="early_pairs must be 0..3"):
        decode_schedule(132, 2560, 768, 8, early_pairs=4)


def test_schedule_rejects_an_unknown_order():
    with pytest.raises(ValueError, match="order"):
        decode_schedule(4, 256, 256, 2, order="random")
    with pytest.raises(ValueError, match="balance"):
        decode_schedule(4, 256, 256, 2, balance="random")


def test_kernel_probes_are_named():
    assert DecodeKernelConfig().probe_code == 0 and DecodeKernelConfig(probe="copy_only").probe_code == 1
    with pytest.raises(ValueError, match="probe must be one of"):
        _ = DecodeKernelConfig(probe="fast").probe_code


def test_kernel_config_defines_name_every_variant():
    """The variants' defines as moe_decode.cu reads them (PersistentDecodeMoE.kernel_for and
    dev/nvrtc_resources.py both take them from here)."""
    kc = DecodeKernelConfig(
        evict_first=False, poll_ns=0, score_poll_ns=200, trace=True, act_copies=4, refresh_pending=False,
        unroll_pairs=False, fast_select=False, down_after=2, bias_early=False, x_early=False,
        l2_next_at=3, probe="no_scales", lean_select=False,
    )  # fmt: skip
    assert kc.defines() == {
        "EVICT_FIRST": 0, "TRACE": 1, "POLL_NS": 0, "SCORE_POLL_NS": 200, "ACT_COPIES": 4, "PROBE": 2,
        "REFRESH_PENDING": 0, "UNROLL_PAIRS": 0, "FAST_SELECT": 0, "DOWN_AFTER": 2, "BIAS_EARLY": 0,
        "X_EARLY": 0, "L2_NEXT_AT": 3, "X_IN_TILES": 0, "GU_WINDOW": 0,
        "WINDOW_DOWNS": 0, "EARLY_PAIRS": 0, "SCORE_STAGGER": 0, "SELECT_TWICE": 0, "LEAN_SELECT": 0,
        "EARLY_IDS": 0, "WARP_SELECT": 0,
    }  # fmt: skip
    assert DecodeKernelConfig().defines() == {
        "EVICT_FIRST": 1, "TRACE": 0, "POLL_NS": 64, "SCORE_POLL_NS": 64, "ACT_COPIES": 8, "PROBE": 0,
        "REFRESH_PENDING": 1, "UNROLL_PAIRS": 1, "FAST_SELECT": 1, "DOWN_AFTER": 7, "BIAS_EARLY": 1,
        "X_EARLY": 1, "L2_NEXT_AT": 0, "X_IN_TILES": 0, "GU_WINDOW": 0,
        "WINDOW_DOWNS": 0, "EARLY_PAIRS": 0, "SCORE_STAGGER": 0, "SELECT_TWICE": 0, "LEAN_SELECT": 1,
        "EARLY_IDS": 0, "WARP_SELECT": 0,
    }  # fmt: skip
    assert DecodeKernelConfig(balance="gate_up", x_in_tiles=True).defines()["X_IN_TILES"] == 1
    assert DecodeKernelConfig(gate_up_window=3).defines()["GU_WINDOW"] == 3
    with pytest.raises(ValueError, match="gate_up_window"):
        DecodeKernelConfig(gate_up_window=-1).defines()
    assert DecodeKernelConfig(gate_up_window=3, window_downs=True).defines()["WINDOW_DOWNS"] == 1
    with pytest.raises(ValueError, match="set gate_up_window"):
        DecodeKernelConfig(window_downs=True).defines()
    with pytest.raises(ValueError, match="l2_next_at must be 0"):
        DecodeKernelConfig(l2_next_at=7).defines()
    with pytest.raises(ValueError, match="balance must be one of"):
        DecodeKernelConfig(balance="even").defines()
    assert DecodeKernelConfig(early_pairs=2).defines()["EARLY_PAIRS"] == 2
    with pytest.raises(ValueError, match="early_pairs is 0"):
        DecodeKernelConfig(early_pairs=-1).defines()
    assert DecodeKernelConfig(score_stagger=128).defines()["SCORE_STAGGER"] == 128
    with pytest.raises(ValueError, match="score_stagger is 0"):
        DecodeKernelConfig(score_stagger=-1).defines()
    assert DecodeKernelConfig(lean_select=False).defines()["LEAN_SELECT"] == 0
    assert DecodeKernelConfig(trace=True, select_twice=True).defines()["SELECT_TWICE"] == 1
    with pytest.raises(ValueError, match="set trace too"):
        DecodeKernelConfig(select_twice=True).defines()
    assert DecodeKernelConfig(early_ids=True).defines()["EARLY_IDS"] == 1
    for clash in ({"l2_next_at": 5}, {"l2_next_at": 6}, {"trace": True, "select_twice": True}):
        with pytest.raises(ValueError, match="early_ids cannot run with"):
            DecodeKernelConfig(early_ids=True, **clash).defines()
    assert DecodeKernelConfig(warp_select=True).defines()["WARP_SELECT"] == 1
    for clash in ({"early_ids": True}, {"trace": True, "select_twice": True}):
        with pytest.raises(ValueError, match="warp_select: the producer chooses"):
            DecodeKernelConfig(warp_select=True, **clash).defines()


def test_warp_select_where_groups_are_whole_columns():
    """The producer warp chooses (moe_decode.cu WARP_SEL) where each group is whole 32-expert columns or there is no
    group limit; its shared memory then holds every expert's key and score (the rest of the block's shared memory
    stays larger at Ling shapes, so the block's footprint does not change there)."""
    from solo.kernels.cuda_moe import RouterSpec, _router_scratch_bytes, _shared_bytes, warp_selects

    ling = RouterSpec(512, 8, 4, True, 132)
    assert warp_selects(ling, True) and not warp_selects(ling, False)
    assert warp_selects(RouterSpec(64, 1, 1, True, 20), True)  # no group limit
    assert warp_selects(RouterSpec(256, 4, 2, True, 20), True)  # groups of two columns
    assert not warp_selects(RouterSpec(64, 8, 4, True, 20), True)  # groups of 8 inside a column
    assert _router_scratch_bytes(2560, ling, True) - _router_scratch_bytes(2560, ling) == 8 * 512 - 12 * 8 * 16
    sched = decode_schedule(132, 2560, 768, 8, "gate_up_first", "bytes")
    assert _shared_bytes(sched, 2560, 768, 8, ling, 4, warp_select=True) == _shared_bytes(sched, 2560, 768, 8, ling, 4)


def test_cuda_backend_on_cpu_is_a_clear_error():
    e, h, i = 4, 256, 256
    experts = MXFP4Experts(
        gate_up=torch.randint(0, 256, (e, 2 * i, h // 2), dtype=torch.uint8),
        gate_up_scale=torch.randint(118, 124, (e, 2 * i, h // 32), dtype=torch.uint8),
        down=torch.randint(0, 256, (e, h, i // 2), dtype=torch.uint8),
        down_scale=torch.randint(118, 124, (e, h, i // 32), dtype=torch.uint8),
    )
    with pytest.raises(BackendUnavailable, match="--moe-backend cuda needs an NVIDIA GPU"):
        make_moe_backend("cuda", experts, torch.bfloat16, None)


# ============================================================================== GPU


def _hopper() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 9


needs_hopper = pytest.mark.skipif(not _hopper(), reason="needs a Hopper (or newer) CUDA GPU")
H, I = 2560, 768


def routing(e: int, top_k: int, dtype: torch.dtype):
    ids = torch.randperm(e, device="cuda")[:top_k].view(1, top_k).to(dtype)
    w = torch.rand((1, top_k), device="cuda") + 0.05
    return ids, w / w.sum()


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


@pytest.fixture(scope="module")
def experts():  # (only GPU tests, all marked needs_hopper, use it)
    return random_mxfp4_experts(64, H, I, scales=(116, 126))


@pytest.mark.gpu
@needs_hopper
@pytest.mark.parametrize(
    "limit,id_dtype,top_k,kc",
    [
        (None, torch.int64, 8, DecodeKernelConfig()),
        (7.0, torch.int32, 6, DecodeKernelConfig(order="need", act_copies=1, evict_first=False)),
        (0.5, torch.int64, 8, DecodeKernelConfig(cooperative=False, trace=True)),  # the trace build: same results
        (None, torch.int32, 2, DecodeKernelConfig(dependent_launch=False, poll_ns=0)),
        (None, torch.int32, 8, DecodeKernelConfig(down_after=0)),  # the down copies at once
        (0.5, torch.int64, 8, DecodeKernelConfig(order="need", down_after=2)),  # gate_up tiles after a down pair
    ],
)
def test_gpu_persistent_matches_reference(experts, limit, id_dtype, top_k, kc):
    from solo.kernels.cuda_moe import PersistentDecodeMoE
    from solo.kernels.triton_moe import TritonMoE

    moe = PersistentDecodeMoE(experts, swiglu_limit=limit, kernel_config=kc)
    for _ in range(3):  # fresh inputs each time; the launch tags advance
        ids, w = routing(experts.gate_up.shape[0], top_k, id_dtype)
        x = torch.randn((1, H), device="cuda").to(torch.bfloat16)
        out = torch.full((1, H), float("nan"), dtype=torch.bfloat16, device="cuda")  # poisoned
        moe.forward(x, ids, w, out=out)
        torch.cuda.synchronize()
        assert not out.isnan().any()
        ref = moe_reference_fp32(experts, x, ids, w, limit)
        assert rel_err(out, ref) <= 1e-2
        gemv = TritonMoE.forward(moe, x, ids, w)  # the Triton GEMV kernels on the same weights
        assert rel_err(out, gemv.float()) <= 1e-2
    if kc.trace:  # both launch parities stamped, each block's end after its start
        tr = moe.trace.cpu()
        assert bool((tr[:, :, 1] > tr[:, :, 0]).all()) and bool((tr[:, :, 0] > 0).all())


@pytest.mark.gpu
@needs_hopper
@pytest.mark.parametrize("order", ["gate_up_first", "need"])
def test_gpu_late_down_copies_change_no_result(experts, order):
    """DecodeKernelConfig.down_after only delays when the producer issues the down copies: the same
    outputs bit for bit, also when one instance switches between the variants."""
    from solo.kernels.cuda_moe import PersistentDecodeMoE

    ids, w = routing(experts.gate_up.shape[0], 8, torch.int32)
    x = torch.randn((1, H), device="cuda").to(torch.bfloat16)
    plain = DecodeKernelConfig(order=order, down_after=0)
    want = PersistentDecodeMoE(experts, kernel_config=plain).forward(x, ids, w).clone()
    configs = [DecodeKernelConfig(order=order, down_after=a) for a in (1, 2, 7)]
    for kc in configs:
        moe = PersistentDecodeMoE(experts, kernel_config=kc)
        for _ in range(2):
            assert torch.equal(moe.forward(x, ids, w), want)
    moe = PersistentDecodeMoE(experts, kernel_config=plain)  # one instance through the variants (set_kernel_config)
    for kc in [plain, *configs, plain, *configs[::-1]]:
        moe.set_kernel_config(kc)
        assert torch.equal(moe.forward(x, ids, w), want)


@pytest.mark.gpu
@needs_hopper
def test_gpu_gate_up_window_balance_and_x_in_tiles_change_no_result(experts):
    """DecodeKernelConfig.gate_up_window only delays when the producer issues gate_up tiles, balance "gate_up" only
    moves tiles between blocks, x_in_tiles only where x waits (the first down copy lands on it once the gate_up
    warps hold it), and early_pairs only which warps run the first pairs' MMA chains (handed over mid-chain): the same
    outputs bit for bit as the product's kernel, with and without the router inside, one
    instance switching through the variants."""
    from solo.kernels.cuda_moe import PersistentDecodeMoE
    from solo.kernels.fused_router import FusedRouter

    variants = [
        DecodeKernelConfig(gate_up_window=1),  # every gate_up tile issued once the one before it landed
        DecodeKernelConfig(gate_up_window=3),
        DecodeKernelConfig(gate_up_window=2, order="need", down_after=0),
        DecodeKernelConfig(gate_up_window=3, window_downs=True, down_after=0),  # the downs in the window too
        DecodeKernelConfig(gate_up_window=1, window_downs=True, order="need", down_after=0),
        DecodeKernelConfig(balance="gate_up", x_in_tiles=True),
        DecodeKernelConfig(x_in_tiles=True),
        DecodeKernelConfig(x_in_tiles=True, order="need", down_after=0),  # the first down copy before the gate_up tiles
        DecodeKernelConfig(balance="gate_up", x_in_tiles=True, trace=True),
        DecodeKernelConfig(gate_up_window=3, early_pairs=1),  # the down warps do slot pair 0 first
        DecodeKernelConfig(gate_up_window=3, early_pairs=2, trace=True),
        DecodeKernelConfig(early_pairs=3, down_after=0),  # (every pair but the last, down rows at once)
    ]
    moe = PersistentDecodeMoE(experts, swiglu_limit=7.0)
    e = experts.gate_up.shape[0]
    router = FusedRouter(
        (torch.randn(e, H, device="cuda") * 0.02).to(torch.bfloat16),
        torch.randn(e, device="cuda") * 0.01,
        (1 + 0.1 * torch.randn(H, device="cuda")).to(torch.bfloat16),
        1e-6, 8, 8, 4, True, 2.5, torch.zeros(1, dtype=torch.int32, device="cuda"),
    )  # fmt: skip
    count = torch.zeros(1, dtype=torch.int32, device="cuda")
    for _ in range(2):  # fresh inputs
        ids, w = routing(e, 8, torch.int32)
        x = torch.randn((1, H), device="cuda").to(torch.bfloat16)
        moe.set_kernel_config(DecodeKernelConfig())
        want = moe.forward(x, ids, w).clone()
        want_routed = [t.clone() for t in moe.routed_forward(x, router, count)]
        for kc in [*variants, DecodeKernelConfig(), *variants[::-1]]:
            moe.set_kernel_config(kc)
            assert torch.equal(moe.forward(x, ids, w), want), kc
            got = moe.routed_forward(x, router, count)
            assert all(torch.equal(a, b) for a, b in zip(got, want_routed, strict=True)), kc


@pytest.mark.gpu
@needs_hopper
def test_gpu_asking_the_l2_for_later_weights_changes_no_result(experts):
    """PersistentDecodeMoE.prefetch_next with DecodeKernelConfig.l2_next_at 1..6 (moe_decode.cu L2_NEXT: bulk or
    line prefetches of other tensors' bytes, a hint) gives the plain kernel's outputs bit for bit, and a region is cut
    to its tensor and to whole 16-byte pieces; one that does not start 16-byte aligned is refused."""
    from solo.kernels.cuda_moe import PersistentDecodeMoE

    ids, w = routing(experts.gate_up.shape[0], 8, torch.int32)
    x = torch.randn((1, H), device="cuda").to(torch.bfloat16)
    want = PersistentDecodeMoE(experts).forward(x, ids, w).clone()
    later = torch.randn((3 << 20,), device="cuda").to(torch.float8_e4m3fn)  # 3 MB standing in for later weights
    other = torch.randn((4096, 777), device="cuda").to(torch.bfloat16)
    moe = PersistentDecodeMoE(experts)
    moe.prefetch_next([(later, 0, 1 << 30), (other, 4096, 1 << 20), (other, 0, 8)])  # (8 bytes: nothing)
    assert moe._l2_next.tolist() == [[later.data_ptr(), 3 << 20], [other.data_ptr() + 4096, 1 << 20]]
    assert moe._l2_regions() == 0  # l2_next_at 0: the product's kernel
    for at in (1, 2, 3, 4, 5, 6, 0, 2):
        moe.set_kernel_config(DecodeKernelConfig(l2_next_at=at))
        assert moe._l2_regions() == (2 if at else 0)
        for _ in range(2):
            assert torch.equal(moe.forward(x, ids, w), want), at
    tail = other.numel() * 2 - 112
    moe.prefetch_next([(other, tail, 1 << 20), (other, 0, 100)])  # cut to the tensor; to whole 16-byte pieces
    assert moe._l2_next.tolist() == [[other.data_ptr() + tail, 112], [other.data_ptr(), 96]]
    assert torch.equal(moe.forward(x, ids, w), want)
    with pytest.raises(ValueError, match="16-byte aligned"):
        moe.prefetch_next([(other, 2, 1024)])
    moe.prefetch_next([])
    assert moe._l2_regions() == 0 and torch.equal(moe.forward(x, ids, w), want)


@pytest.mark.gpu
@needs_hopper
def test_gpu_graph_replays_equal_eager_across_the_launch_counter_wrap(experts):
    from solo.kernels.cuda_moe import PersistentDecodeMoE

    moe = PersistentDecodeMoE(experts)
    ids, w = routing(experts.gate_up.shape[0], 8, torch.int64)
    x = torch.randn((1, H), device="cuda").to(torch.bfloat16)
    eager = moe.forward(x, ids, w).clone()
    moe._launches.fill_(moe.blocks * 65536 - 2 * moe.blocks)  # two launches before the counter wraps
    out = torch.empty_like(eager)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        moe.forward(x, ids, w, out=out)
    for _ in range(5):
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, eager)
        assert torch.equal(moe.forward(x, ids, w), eager)
    assert int(moe._launches) == 8 * moe.blocks  # 2 launches before the wrap, 8 after


@pytest.mark.gpu
@needs_hopper
def test_gpu_fewer_blocks_give_the_same_results_and_keep_their_own_exchange(experts):
    """PersistentDecodeMoE.set_blocks (a lab switch): the kernel on 4 SMs fewer gives the all-SM kernel's
    outputs, eagerly and from graphs of both block counts replayed in turn (each count keeps its exchange
    buffers and launch counter, whose value over the block count tags what the blocks exchange); a count
    outside 1..SMs is refused."""
    from solo.kernels.cuda_moe import PersistentDecodeMoE

    moe = PersistentDecodeMoE(experts)
    sms = moe.blocks
    x = torch.randn((1, H), device="cuda").to(torch.bfloat16)
    ids, w = routing(experts.gate_up.shape[0], 8, torch.int32)
    want = moe.forward(x, ids, w).clone()
    outs, graphs = [], []
    for blocks in (sms, sms - 4):
        moe.set_blocks(blocks)
        assert moe.blocks == blocks
        assert torch.equal(moe.forward(x, ids, w), want), blocks
        out = torch.empty_like(want)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            moe.forward(x, ids, w, out=out)
        outs.append(out)
        graphs.append(graph)
    assert int(moe._launches) == 1 * (sms - 4)  # (the eager launch of this count; the capture runs nothing)
    for _ in range(3):
        for graph, out in zip(graphs, outs, strict=True):
            out.fill_(float("nan"))
            graph.replay()
            torch.cuda.synchronize()
            assert torch.equal(out, want)
    moe.set_blocks(None)
    assert moe.blocks == sms and torch.equal(moe.forward(x, ids, w), want)
    for wrong in (0, sms + 1):
        with pytest.raises(ValueError, match="blocks"):
            moe.set_blocks(wrong)


@pytest.mark.gpu
@needs_hopper
def test_gpu_only_one_token_calls_take_the_persistent_kernel(experts):
    moe = make_moe_backend("cuda", experts, torch.bfloat16, None, top_k=8, max_tokens=4)
    before = dict(moe.path_calls)
    x = torch.randn((4, H), device="cuda").to(torch.bfloat16)
    ids = torch.stack([torch.randperm(64, device="cuda")[:8] for _ in range(4)])
    w = torch.rand((4, 8), device="cuda")
    moe(x[:1], ids[:1], w[:1])
    moe(x, ids, w)
    assert moe.path_calls["persistent"] - before["persistent"] == 1
    assert moe.path_calls["gemv"] - before["gemv"] == 1
    assert moe.family_for(1) == "persistent" and moe.family_for(4) == "gemv"
    from solo.kernels.cuda_moe import persistent_compile_report

    assert persistent_compile_report()["kernels"] >= 1


@pytest.mark.gpu
@needs_hopper
@pytest.mark.parametrize(
    ("fast_select", "bias_early", "x_early", "score_stagger", "lean_select", "early_ids", "warp_select"),
    [
        (False, False, False, 0, False, False, False),
        (True, False, True, 0, False, False, False),
        (True, True, True, 0, False, False, False),
        (True, True, True, 128, False, False, False),
        (True, True, True, 0, True, False, False),
        pytest.param(True, True, True, 0, True, True, False, id="early_ids"),
        pytest.param(False, True, True, 0, False, True, False, id="early_ids_full_ranking"),
        pytest.param(True, True, True, 0, True, False, True, id="warp_select"),
    ],
)
@pytest.mark.parametrize(
    "num_experts,groups,keep", [(512, 8, 4), (64, 8, 4), (64, 1, 1), (256, 4, 2)]
)  # Ling's router; groups inside a warp; no group limit; groups of two warps each
def test_gpu_router_inside_the_kernel_chooses_as_the_reference(
    num_experts, groups, keep, fast_select, bias_early, x_early, score_stagger, lean_select, early_ids, warp_select
):
    """One launch: RMSNorm of the residual stream, router scores, grouped top-k in every block, then the
    experts it chose. Against the model's Router in fp32 on the CPU (the same experts where the draw is
    clear of ties, weights within fp32 rounding), the reference RMSNorm (bf16 values as it rounds them),
    and the same kernel given the chosen routing (exactly: the routing is all that differs). With
    `fast_select` the selection ranks only the kept groups' warps (where groups are whole warps); with
    `bias_early` each selection lane reads its expert's bias before the kernel's wait; with `x_early` x is
    loaded before the inputs' barrier; with `score_stagger` each selection lane keeps four loads of its score in
    flight; with `lean_select` the groups are ranked once; with `early_ids` the producer starts its copies from
    the ranking's own writes, before the weights are summed; with `warp_select` the producer warp chooses (where
    groups are whole 32-expert columns)."""
    from solo.checkpoint.synthetic import synthetic_config
    from solo.kernels.cuda_moe import PersistentDecodeMoE
    from solo.kernels.fused_router import FusedRouter
    from solo.model.layers import RMSNorm
    from solo.model.moe import Router
    from solo.testing.rounding import assert_rmsnorm_rounding
    from solo.testing.routing import routing_margin

    experts = random_mxfp4_experts(num_experts, H, I, scales=(116, 126))
    moe = PersistentDecodeMoE(experts, swiglu_limit=7.0)
    moe.set_kernel_config(
        DecodeKernelConfig(
            fast_select=fast_select,
            bias_early=bias_early,
            x_early=x_early,
            score_stagger=score_stagger,
            lean_select=lean_select,
            early_ids=early_ids,
            warp_select=warp_select,
        )
    )
    config = synthetic_config(num_layers=1, num_experts=num_experts)
    ref = Router(config)
    ref.n_group, ref.topk_group = groups, keep
    count = torch.zeros(1, dtype=torch.int32, device="cuda")
    checked = 0
    for _ in range(20):  # fresh weights and inputs each draw; the launch tags advance
        ref.weight.data = (torch.randn(num_experts, H) * 0.02).to(torch.bfloat16).float()
        ref.expert_bias.data = torch.randn(num_experts) * 0.01
        norm = RMSNorm(H, 1e-6)
        norm.weight.data = (1 + 0.1 * torch.randn(H)).to(torch.bfloat16)
        x = (3 * torch.randn(1, H)).to(torch.bfloat16)
        xn_ref = norm(x)
        if routing_margin(ref, xn_ref) < 1e-5:
            continue
        router = FusedRouter(
            ref.weight.data.to(torch.bfloat16).cuda(),
            ref.expert_bias.data.cuda(),
            norm.weight.data.cuda(),
            1e-6,
            8,
            groups,
            keep,
            True,
            config.routed_scaling_factor,
            torch.zeros(1, dtype=torch.int32, device="cuda"),
        )
        assert moe.routed_unsupported(router) is None
        out, xn, ids, wts = moe.routed_forward(x.cuda(), router, count)
        want_w, want_ids = ref(xn_ref)
        # the sum of squares adds in another order than the reference's: 1 / rms may differ in its last bits
        assert_rmsnorm_rounding(xn.cpu(), x, norm.weight.data, 1e-6)
        assert torch.equal(ids.cpu().long(), want_ids)
        assert rel_err(wts.cpu(), want_w) < 1e-5
        given = moe.forward(xn, ids, wts)  # the kernel without its router, on the routing it chose
        torch.cuda.synchronize()
        assert torch.equal(out, given)
        assert rel_err(out, moe_reference_fp32(experts, xn, ids.long(), wts, 7.0)) <= 1e-2
        checked += 1
        if checked == 3:
            break
    assert checked == 3
    assert int(count) == 3
    # captured in a graph, replayed across the launch counter's wrap: the same result every time
    graph_out = torch.empty_like(out)
    moe._launches.fill_(moe.blocks * 65536 - 2 * moe.blocks)
    graph = torch.cuda.CUDAGraph()
    xc = x.cuda()
    with torch.cuda.graph(graph):
        o, _, _, _ = moe.routed_forward(xc, router, count)
        graph_out.copy_(o)
    for _ in range(4):
        graph_out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(graph_out, out)
    assert int(count) == 3 + 4  # once per launch (the capture itself runs nothing)


@pytest.mark.gpu
@needs_hopper
def test_gpu_router_inside_the_kernel_refuses_what_it_cannot_run():
    from solo.kernels.cuda_moe import PersistentDecodeMoE
    from solo.kernels.fused_router import FusedRouter

    experts = random_mxfp4_experts(64, H, I)
    moe = PersistentDecodeMoE(experts)
    counter = torch.zeros(1, dtype=torch.int32, device="cuda")
    weight = torch.randn(64, H, device="cuda").to(torch.bfloat16)
    bias, norm = torch.zeros(64, device="cuda"), torch.ones(H, device="cuda", dtype=torch.bfloat16)
    wide = FusedRouter(weight, bias, norm, 1e-6, 8, 64, 32, True, 1.0, counter)  # groups of one expert
    assert "groups" in moe.routed_unsupported(wide)
    other = FusedRouter(weight[:32].contiguous(), bias[:32], norm, 1e-6, 8, 1, 1, True, 1.0, counter)
    assert "differ" in moe.routed_unsupported(other)
    # the copies-only probe has no gate_up warps to route with: refused before it is built (it would never end)
    grouped = FusedRouter(weight, bias, norm, 1e-6, 8, 8, 4, True, 1.0, counter)
    assert moe.routed_unsupported(grouped) is None
    moe.set_kernel_config(DecodeKernelConfig(probe="copy_only"))
    with pytest.raises(ValueError, match="copy_only"):
        moe.kernel_for(8, False, moe.router_spec(grouped))


@pytest.mark.gpu
@needs_hopper
@pytest.mark.parametrize("num_experts,groups,keep", [(512, 8, 4), (64, 1, 1), (256, 4, 2)])
def test_gpu_warp_select_breaks_ties_as_the_selection_warps(num_experts, groups, keep):
    """Exact ties, which the reference test draws away from: experts share router rows and biases, 8 at a time
    (lanes 4q..4q+3 of two columns: ties within a lane and across lanes, and groups whose two best are equal), and
    on every other draw every group has the same rows (groups whose sums tie). The producer warp's choice
    (warp_select) must be the selection warps' (the lower index first among equal keys, the lower group among equal
    sums): the same experts, weights, normalised input and output bit for bit, on fresh draws."""
    from solo.kernels.cuda_moe import PersistentDecodeMoE
    from solo.kernels.fused_router import FusedRouter

    experts = random_mxfp4_experts(num_experts, H, I, scales=(116, 126))
    kernels = {
        ws: PersistentDecodeMoE(experts, swiglu_limit=7.0, kernel_config=DecodeKernelConfig(warp_select=ws))
        for ws in (False, True)
    }
    e = torch.arange(num_experts)
    count = torch.zeros(1, dtype=torch.int32, device="cuda")
    for draw in range(4):
        # 8 distinct rows a group, each for 8 of its experts (odd draws: the same 8 rows in every group)
        row = (e % 32) // 4 + (0 if draw % 2 else 8 * (e // (num_experts // groups)))
        unique, unique_bias = torch.randn(int(row.max()) + 1, H) * 0.02, torch.randn(int(row.max()) + 1) * 0.01
        router = FusedRouter(
            unique[row].to(torch.bfloat16).cuda(),
            unique_bias[row].cuda(),
            (1 + 0.1 * torch.randn(H)).to(torch.bfloat16).cuda(),
            1e-6,
            8,
            groups,
            keep,
            True,
            2.5,
            torch.zeros(1, dtype=torch.int32, device="cuda"),
        )
        x = (3 * torch.randn(1, H)).to(torch.bfloat16).cuda()
        results = []
        for moe in kernels.values():
            results.append([t.clone() for t in moe.routed_forward(x, router, count)])
            torch.cuda.synchronize()
        for a, b in zip(*results, strict=True):
            assert torch.equal(a, b)
        ids = results[0][2].long().cpu().view(-1)
        assert ids.unique().numel() == 8
        assert row[ids].unique().numel() < 8  # tied experts among the chosen: the draw tests the ties


def test_the_router_inside_the_kernel_states_what_it_runs():
    """CPU: which routers the persistent kernel takes (Ling's: 512 experts, 8 groups keep 4, top-8) and
    that its shared memory, router scratch included, fits an H200 block at Ling shapes."""
    from solo.kernels.cuda_moe import RouterSpec, _shared_bytes, router_unsupported

    ling = RouterSpec(512, 8, 4, True, 132)
    assert router_unsupported(2560, 8, ling) is None
    assert router_unsupported(2560, 8, RouterSpec(64, 8, 4, True, 132)) is None  # groups inside a warp
    assert router_unsupported(2560, 8, RouterSpec(64, 1, 1, False, 132)) is None  # no group limit
    assert "multiple of 32" in router_unsupported(2560, 8, RouterSpec(48, 1, 1, True, 132))
    assert "at most 32 groups" in router_unsupported(2560, 8, RouterSpec(512, 64, 8, True, 132))
    assert "power of two" in router_unsupported(2560, 8, RouterSpec(384, 16, 4, True, 132))  # groups of 24
    assert "fewer than top-k" in router_unsupported(2560, 8, RouterSpec(64, 16, 1, True, 132))  # 1 x 4 < 8
    assert "H / 4" in router_unsupported(256, 8, RouterSpec(128, 1, 1, True, 132))  # 4 warps select, 2 exist
    sched = decode_schedule(132, 2560, 768, 8)
    with_router = _shared_bytes(sched, 2560, 768, 8, ling)
    assert with_router == _shared_bytes(sched, 2560, 768, 8)  # its scratch shares the gate_up partials' space
    assert with_router <= 232448  # an H200 block's opt-in shared memory


def random_shared_expert(inter: int, limit: float | None):
    """A block-FP8 shared expert of fresh random codes and 128x128 block scales."""
    from solo.kernels.cuda_moe import SharedExpert

    def fp8(rows: int, cols: int) -> tuple[torch.Tensor, torch.Tensor]:
        codes = torch.randn(rows, cols, device="cuda").clamp(-8, 8).to(torch.float8_e4m3fn)
        scale = torch.rand(rows // 128, cols // 128, device="cuda") * 0.01 + 0.005
        return codes, scale

    gate_up, gate_up_scale = fp8(2 * inter, H)
    down, down_scale = fp8(H, inter)
    return SharedExpert(gate_up, gate_up_scale, down, down_scale, limit)


def dequantize_block_fp8(codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return codes.float() * scale.repeat_interleave(128, 0).repeat_interleave(128, 1)


@pytest.mark.gpu
@needs_hopper
@pytest.mark.parametrize("shared_inter,limit", [(768, 7.0), (256, None), (512, 0.5)])
def test_gpu_shared_expert_inside_the_kernel_updates_the_residual_as_the_separate_kernels(shared_inter, limit):
    """One launch of router, routed experts and shared expert writes x + shared + routed in place. Against
    the same kernel without the shared expert (same routing, same routed sum, exactly) and the shared
    expert in fp32 from the normalised x it returns, rounded as the separate kernels round it: the shared
    activations to bf16, the shared down to bf16, added to x, then the routed sum. The shared down's sums
    add in another order than the reference's, so a value near a bf16 rounding boundary may move by one
    step, rarely; also in a graph, across launches (the exchanged activations' tags advance)."""
    from solo.kernels.cuda_moe import PersistentDecodeMoE
    from solo.kernels.fused_router import FusedRouter

    experts = random_mxfp4_experts(512, H, I, scales=(116, 126))
    moe = PersistentDecodeMoE(experts, swiglu_limit=7.0)
    shared = random_shared_expert(shared_inter, limit)
    assert moe.shared_unsupported(8, shared) is None
    weight = (torch.randn(512, H, device="cuda") * 0.02).to(torch.bfloat16)
    norm_w = (1 + 0.1 * torch.randn(H, device="cuda")).to(torch.bfloat16)
    counters = torch.zeros(3, dtype=torch.int32, device="cuda")
    router = FusedRouter(weight, torch.randn(512, device="cuda") * 0.01, norm_w, 1e-6, 8, 8, 4, True, 2.5, counters[2:])
    gu, dn = (
        dequantize_block_fp8(shared.gate_up, shared.gate_up_scale),
        dequantize_block_fp8(shared.down, shared.down_scale),
    )

    def expected(x: torch.Tensor, xn: torch.Tensor, routed: torch.Tensor) -> torch.Tensor:
        h = xn.float() @ gu.T
        g, u = h[:, :shared_inter], h[:, shared_inter:]
        a = torch.nn.functional.silu(g)
        if limit is not None:
            a, u = a.clamp(max=limit), u.clamp(-limit, limit)
        y = (a * u).to(torch.bfloat16).float() @ dn.T
        return ((x.float() + y.to(torch.bfloat16).float()) + routed.float()).to(torch.bfloat16)

    def check(got: torch.Tensor, want: torch.Tensor) -> None:
        step = want.float().abs().clamp_min(1e-30) * 2.0**-7
        diff = (got.float() - want.float()).abs()
        assert bool((diff <= 2 * step).all()) and int((diff > 0).sum()) <= H // 100, int((diff > 0).sum())

    for _ in range(3):
        x = (3 * torch.randn(1, H, device="cuda")).to(torch.bfloat16)
        routed, xn, ids, wts = moe.routed_forward(x, router, counters[0:2])
        got = x.clone()
        out, xn2, ids2, wts2 = moe.routed_forward(got, router, counters[0:2], shared=shared, out=got)
        torch.cuda.synchronize()
        assert out.data_ptr() == got.data_ptr()
        assert torch.equal(xn2, xn) and torch.equal(ids2, ids) and torch.equal(wts2, wts)
        assert not torch.equal(got, x)
        check(got, expected(x, xn, routed))
    assert counters[:2].tolist() == [6, 3]  # every launch counts as moe_router, the shared ones as moe_shared too
    graph = torch.cuda.CUDAGraph()
    stream = torch.zeros_like(x)
    with torch.cuda.graph(graph):
        moe.routed_forward(stream, router, counters[0:2], shared=shared, out=stream)
    for _ in range(3):
        x = (3 * torch.randn(1, H, device="cuda")).to(torch.bfloat16)
        stream.copy_(x)
        graph.replay()
        routed, xn, _, _ = moe.routed_forward(x, router, counters[0:2])
        torch.cuda.synchronize()
        check(stream, expected(x, xn, routed))


@pytest.mark.gpu
@needs_hopper
def test_gpu_shared_expert_inside_the_kernel_refuses_what_it_cannot_run():
    from solo.kernels.cuda_moe import PersistentDecodeMoE, SharedExpert

    moe = PersistentDecodeMoE(random_mxfp4_experts(64, H, I))
    good = random_shared_expert(768, None)
    assert moe.shared_unsupported(8, good) is None
    bf16 = SharedExpert(good.gate_up.to(torch.bfloat16), good.gate_up_scale, good.down, good.down_scale, None)
    assert "block-FP8" in moe.shared_unsupported(8, bf16)
    odd = random_shared_expert(384, None)  # not a multiple of 256
    assert "multiple of 256" in moe.shared_unsupported(8, odd)
    rows = SharedExpert(good.gate_up, good.gate_up_scale[:, :1].contiguous(), good.down, good.down_scale, None)
    assert "block scales" in moe.shared_unsupported(8, rows)


@pytest.mark.parametrize("blocks,hidden,inter,top_k", [(132, 2560, 768, 8), (114, 2560, 768, 8), (78, 2560, 768, 8)])
@pytest.mark.parametrize("shared_inter", [768, 256])
def test_the_shared_experts_tail_is_written_only_after_the_shared_expert_is_done(
    blocks, hidden, inter, top_k, shared_inter
):
    """CPU: the shared expert's weights sit in the tail of each block's tile area; every copy group issued
    before the block's wait lands wholly below the tail, the one at the wait reaches into it, and the
    kernel's shared memory still fits an H200 block (Ling: 512 experts, router inside, 132 SMs)."""
    from solo.kernels.cuda_moe import RouterSpec, _shared_bytes
    from solo.kernels.cuda_moe_plan import shared_tail, with_shared_column

    sched = decode_schedule(blocks, hidden, inter, top_k)
    offset, waits = shared_tail(sched, hidden, inter, top_k, shared_inter)
    tail = 16 * hidden + 8 * sched.max_down * shared_inter
    assert offset % 128 == 0 and offset >= 0 and offset + tail <= sched.most_bytes
    gu_bytes, dn_bytes = tile_bytes(hidden, inter, top_k)
    pairs = top_k // 2
    for b in range(blocks):
        gu, dn, order = decode_row(sched.table[b].tolist(), sched.max_gate_up, sched.max_down, pairs)
        ends = [
            (code + 1) * gu_bytes
            if code < sched.max_gate_up
            else len(gu) * gu_bytes + (2 * (code - sched.max_gate_up) + 2) * len(dn) * dn_bytes // top_k
            for code in order
        ]
        assert all(end <= offset for end in ends[: waits[b]])
        assert waits[b] == len(order) or ends[waits[b]] > offset
    table = with_shared_column(sched, waits).table
    assert table.shape[1] == sched.table.shape[1] + 1 and table[:, -1].tolist() == waits
    if blocks == 132:  # (on fewer SMs the routed tiles alone do not fit)
        assert _shared_bytes(sched, hidden, inter, top_k, RouterSpec(512, 8, 4, True, blocks)) <= 232448


def test_a_shared_expert_too_large_for_the_tile_area_is_refused():
    from solo.kernels.cuda_moe_plan import shared_tail

    sched = decode_schedule(132, 256, 256, 2)  # small tiles: 2 slots of a narrow expert
    with pytest.raises(ValueError, match="exceed"):
        shared_tail(sched, 256, 256, 2, 4096)


def test_a_new_kernel_config_keeps_the_built_kernels_aside():
    """set_kernel_config (A/B variants) keeps the kernels built so far, with their schedule tables: graphs
    captured before read those tables (dropped, their memory went to later buffers and such a graph
    faulted in the eleventh session's A/B). The GPU test replays such graphs; this checks the bookkeeping."""
    from solo.kernels.cuda_moe import PersistentDecodeMoE

    moe = object.__new__(PersistentDecodeMoE)  # (the constructor needs a Hopper GPU)
    moe.kernel_config, moe._kernels, moe._retired = DecodeKernelConfig(), {}, []
    entry = (object(), None, torch.randint(0, 99, (int(torch.randint(4, 64, ())),)), 128)
    moe._kernels[(8, False, None, None)] = entry
    moe.set_kernel_config(DecodeKernelConfig(fast_select=False))
    assert not moe.kernel_config.fast_select and moe._kernels == {} and moe._retired[0] is entry

"""The decode step's CUDA kernels (solo.kernels.cuda_step) against the reference modules (Hopper GPU only).

Every prologue (none, RMSNorm, gated norm), scale kind (block, row) and epilogue (store, residual +
addend, SwiGLU with clamp) of the GEMV at Ling-3.0-flash's widths, for one token (decode) and several
(verification windows of 4 and 8, rows of their own strides), including row counts that are not a
multiple of a task's 8 rows, over launch configurations of each kind (warps splitting K, loads in
flight, one or many tasks a block); the router against the model's own Router on fresh random weights,
every token of a call (the same experts where the run is clear of ties, weights within fp32
rounding). Fresh random inputs every run. Skipped where the kernels cannot run (CPU, pre-Hopper).
"""

from __future__ import annotations

import pytest
import torch

from solo.kernels.cuda_step import cuda_step_unavailable
from solo.testing.rounding import assert_rmsnorm_rounding

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available() or cuda_step_unavailable("cuda") is not None,
        reason="needs a Hopper GPU with NVRTC",
    ),
]

DEVICE = "cuda"
LAUNCHES = {  # the product's choice; 4 warps with 4 loads in flight; one block per SM (many tasks a block)
    "auto": {},
    "4 warps, 4 in flight": dict(warps=4, max_in_flight=4),
    "one block per SM": dict(warps=16, blocks_per_sm=1),
    # registers capped for 3 blocks an SM (GemvLaunch.min_blocks; at K 4096 the build spills)
    "8 warps, 4 in flight, 3 blocks per SM": dict(warps=8, max_in_flight=4, min_blocks=3),
    # the weights through a ring of shared-memory slots filled by bulk copies (gemv_decode.cu BULK)
    "bulk ring": dict(bulk=1, warps=8),
    "bulk ring, 20 warps": dict(bulk=1, warps=20),  # (K 768: 12 warps, warps_for)
    "bulk ring, 2 blocks per SM, 2 slots": dict(bulk=2, slots=2),
}


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


def gemv(rows: int, k: int, scale_kind: str = "block", half: int | None = None, limit: float | None = None, **launch):
    """(CudaGemv, the dequantized fp32 weight on the CPU) with fresh random FP8 weights."""
    from solo.kernels.cuda_step import CudaGemv, GemvLaunch
    from solo.kernels.fused_gemv import FusedGemv
    from solo.quantization import formats

    w = torch.randn(rows, k) * 0.05
    if scale_kind == "block":
        w8, scale = formats.quantize_fp8_block(w)
        wf = formats.dequantize_fp8_block(w8, scale)
    else:
        w8, scale = formats.quantize_fp8_rowwise(w)
        wf = w8.float() * scale.float()[:, None]
    fused = FusedGemv(w8.to(DEVICE), scale.to(DEVICE), scale_kind, swiglu_half=half, swiglu_limit=limit, name="t")
    counter = torch.zeros(1, dtype=torch.int32, device=DEVICE)
    max_tokens = launch.pop("max_tokens", 8)
    return CudaGemv(fused, counter, GemvLaunch(**launch) if launch else None, max_tokens=max_tokens), wf


def project(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return (x.float() @ w.T).to(torch.bfloat16)


def rows_rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """The worst token's relative error (a token's rows must be right, not just the call's on average)."""
    return max(rel(a[i], b[i]) for i in range(b.shape[0]))


def normed_call(rows: int, k: int, half: int | None, tokens: int) -> tuple[torch.Tensor, dict]:
    """Fresh inputs of a normalised projection: x and the call's keywords (norm weight; a residual
    unless SwiGLU)."""
    x = (torch.randn(tokens, k) * 2).to(torch.bfloat16).to(DEVICE)
    norm = (1 + 0.2 * torch.randn(k)).to(torch.bfloat16).to(DEVICE)
    residual = None if half else torch.randn(tokens, rows).to(torch.bfloat16).to(DEVICE)
    return x, dict(norm_weight=norm, residual=residual)


def graph_replayed(g, x: torch.Tensor, kwargs: dict, like: torch.Tensor, captures: int, replays: int) -> torch.Tensor:
    """`g`'s output after `captures` calls captured in one CUDA graph, replayed `replays` times into an
    output zeroed before each replay."""
    out = torch.empty_like(like)
    g(x, out=out, **kwargs)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(captures):
            g(x, out=out, **kwargs)
    for _ in range(replays):
        out.zero_()
        graph.replay()
    torch.cuda.synchronize()
    return out


TOKENS = [1, 4, 8]


@pytest.mark.parametrize("tokens", TOKENS)
@pytest.mark.parametrize("launch", list(LAUNCHES))
@pytest.mark.parametrize(("rows", "k"), [(20512, 2560), (1001, 768), (2560, 6144)])
def test_norm_projection_and_residual(launch, rows, k, tokens):
    """RMSNorm -> projection (-> residual + addend), and the normalised x it can write, as the reference."""
    from solo.model.layers import RMSNorm

    g, wf = gemv(rows, k, **LAUNCHES[launch])
    x = (torch.randn(tokens, k) * 3).to(torch.bfloat16)
    x[-1] *= 5  # tokens of different scales: each token is normalised on its own
    norm = RMSNorm(k, 1e-6)
    norm.weight.data = (1 + 0.2 * torch.randn(k)).to(torch.bfloat16)
    xn = torch.empty(tokens, k, dtype=torch.bfloat16, device=DEVICE)
    got = g(x.to(DEVICE), norm_weight=norm.weight.data.to(DEVICE), eps=1e-6, xn_out=xn).cpu()
    assert rows_rel(got, project(norm(x), wf)) < 1e-2
    assert_rmsnorm_rounding(xn.cpu(), x, norm.weight.data, 1e-6)
    residual = torch.randn(tokens, rows).to(torch.bfloat16)
    addend = torch.randn(tokens, rows).to(torch.bfloat16)
    got = g(x.to(DEVICE), residual=residual.to(DEVICE), addend=addend.to(DEVICE)).cpu()
    want = residual + project(x, wf) + addend
    assert rows_rel(got - residual, want - residual) < 1e-2
    assert g.counter.item() == 2


@pytest.mark.parametrize("tokens", TOKENS)
@pytest.mark.parametrize("launch", list(LAUNCHES))
def test_gated_norm_projection_in_place(launch, tokens):
    """The KDA output: per-head gated RMSNorm -> o_proj -> residual, written over the residual stream;
    the gate is a column slice of a wider projection output (its own row stride), as in the step."""
    from solo.model.layers import GatedRMSNorm

    rows, k, group = 2560, 4096, 128
    g, wf = gemv(rows, k, **LAUNCHES[launch])
    o = torch.randn(tokens, k).to(torch.bfloat16)
    proj = torch.randn(tokens, 3 * k).to(torch.bfloat16)
    gate = proj[:, k : 2 * k]
    norm = GatedRMSNorm(group, 1e-6)
    norm.weight.data = (1 + 0.2 * torch.randn(group)).to(torch.bfloat16)
    normed = norm(o.view(tokens, k // group, group), gate.reshape(tokens, k // group, group)).view(tokens, k)
    stream = torch.randn(tokens, rows).to(torch.bfloat16)
    want = stream + project(normed, wf)
    x = stream.to(DEVICE)
    gate_dev = proj.to(DEVICE)[:, k : 2 * k]
    g(o.to(DEVICE), out=x, residual=x, norm_weight=norm.weight.data.to(DEVICE), gate=gate_dev, eps=1e-6)
    assert rows_rel(x.cpu() - stream, want - stream) < 1e-2


@pytest.mark.parametrize("tokens", TOKENS)
@pytest.mark.parametrize("launch", list(LAUNCHES))
def test_swiglu_pair(launch, tokens):
    """[gate; up] in one weight -> silu(gate) * up with the clamp (the shared expert)."""
    from solo.kernels.moe import swiglu

    half, k = 768, 2560
    g, wf = gemv(2 * half, k, half=half, limit=0.3, **LAUNCHES[launch])
    x = (torch.randn(tokens, k) * 2).to(torch.bfloat16)
    want = swiglu(project(x, wf[:half]), project(x, wf[half:]), 0.3)
    assert rows_rel(g(x.to(DEVICE)).cpu(), want) < 2e-2


@pytest.mark.parametrize("tokens", TOKENS)
@pytest.mark.parametrize(("rows", "k", "half"), [(20512, 2560, None), (1003, 4096, None), (1536, 2560, 768)])
def test_the_bulk_ring_computes_what_the_registers_do(rows, k, half, tokens):
    """The BULK variant changes where the weights wait, not the products or their order: bit for bit the
    register path's outputs, rows past the last full task included, over slots refilled many times."""
    import dataclasses

    g, _ = gemv(rows, k, half=half, limit=0.5 if half else None, warps=8)
    x = (torch.randn(tokens, k) * 2).to(torch.bfloat16).to(DEVICE)
    residual = None if half else torch.randn(tokens, rows).to(torch.bfloat16).to(DEVICE)
    want = g(x, residual=residual)
    for bulk, slots in ((1, 12), (2, 2), (1, 3)):
        g.launch_config = dataclasses.replace(g.launch_config, bulk=bulk, slots=slots)
        g._kernels.clear()
        got = g(x, residual=residual)
        ran = next(iter(g._kernels.values()))[3].get("SLOTS", 0)
        assert ran >= 2 or bulk == 2  # the ring ran (two blocks an SM: where two slots fit in half an SM)
        assert torch.equal(got, want), (bulk, slots, ran)


@pytest.mark.parametrize("tokens", [1, 4, 8])
@pytest.mark.parametrize(
    ("rows", "k", "last", "launch"),
    [
        (20512, 2560, (16384, 20480), "auto"),  # the KDA projections: g last
        (20512, 2560, (16384, 20480), "bulk ring"),
        (1003, 4096, (0, 504), "auto"),  # rows past the last full task come before the hand-off's
        (2560, 4096, (2552, 2560), "one block per SM"),  # one task last, many tasks a block
    ],
)
def test_a_handoff_reorders_the_tasks_and_signals_once_per_block(rows, k, last, launch, tokens):
    """With a hand-off the tasks run in another order (the hand-off's rows last) and each block signals
    once its other rows are stored: the same outputs bit for bit, and as many signals as `last_signals`
    says (the count the KDA kernel waits for)."""
    from solo.kernels.cuda_step import Handoff

    g, _ = gemv(rows, k, **LAUNCHES[launch])
    x = (torch.randn(tokens, k) * 2).to(torch.bfloat16).to(DEVICE)
    norm = (1 + 0.2 * torch.randn(k)).to(torch.bfloat16).to(DEVICE)
    want = g(x, norm_weight=norm)
    assert g.last_signals == 0
    counter = torch.zeros(2, dtype=torch.int32, device=DEVICE)
    got = g(x, norm_weight=norm, handoff=Handoff(counter, *last))
    assert torch.equal(got, want)
    assert 0 < g.last_signals == int(counter[0]) and int(counter[1]) == 0
    grid = next(built[1] for key, built in g._kernels.items() if key[-2] != (0, 0))  # (..., order, late_wait)
    if launch != "bulk ring":  # its registers capped: as many blocks per SM as without the hand-off
        assert grid == next(built[1] for key, built in g._kernels.items() if key[-2] == (0, 0))
    assert g.last_signals == min(grid, -(-rows // 8) - (last[1] - last[0]) // 8)


@pytest.mark.parametrize("tokens", [1, 4])
def test_a_late_wait_computes_what_the_early_wait_does(tokens):
    """gemv_decode.cu LATE_WAIT moves griddepcontrol.wait to the kernel's end: the same outputs bit for bit
    (the shared expert's gate_up: SwiGLU pair with its own RMSNorm), under PDL launches too."""
    from solo.kernels.pdl import LaunchPolicy

    g, _ = gemv(1536, 2560, half=768, limit=0.5)
    x = (torch.randn(tokens, 2560) * 2).to(torch.bfloat16).to(DEVICE)
    norm = (1 + 0.2 * torch.randn(2560)).to(torch.bfloat16).to(DEVICE)
    want = g(x, norm_weight=norm)
    assert torch.equal(g(x, norm_weight=norm, late_wait=True), want)
    g.fused.launch = LaunchPolicy(True)
    assert torch.equal(g(x, norm_weight=norm, late_wait=True), want)


@pytest.mark.parametrize("tokens", [1, 4])
@pytest.mark.parametrize(
    ("rows", "k", "half", "launch"),
    [
        (20512, 2560, None, {}),  # the KDA projections: 792 blocks, most take a dynamic third task
        (1003, 4096, None, dict(warps=16, blocks_per_sm=1)),  # many tasks a block, rows past the last task
        (1536, 2560, 768, {}),  # the shared gate_up: fewer tasks than two a block, nothing to take
    ],
)
def test_dynamic_tasks_compute_what_the_fixed_order_does(rows, k, half, launch, tokens):
    """GemvLaunch.dynamic takes a block's tasks after its first two from a counter: the same outputs bit
    for bit (a task's products and sums do not depend on the block that runs it), every task run once
    (rows past the last full task included), the counter reset for the next call, eagerly, under PDL
    and in a CUDA graph replayed many times, on the same grid as the fixed order."""
    import dataclasses

    from solo.kernels.pdl import LaunchPolicy

    g, _ = gemv(rows, k, half=half, limit=0.5 if half else None, **launch)
    # every call on this launch: on the cards of WINDOW_RING_CARDS the big projections' calls of several tokens
    # would run the window's bulk ring, which the variant does not change
    g.launch_config = dataclasses.replace(g.launch_config, window=None)
    x, kwargs = normed_call(rows, k, half, tokens)
    want = g(x, **kwargs)
    fixed_grid = next(iter(g._kernels.values()))[1]
    g.launch_config = dataclasses.replace(g.launch_config, dynamic=True)
    g._kernels.clear()
    for pdl in (False, True):
        g.fused.launch = LaunchPolicy(pdl)
        for _ in range(3):
            assert torch.equal(g(x, **kwargs), want)
            assert g.dynamic_counters.tolist() == [0, 0]
    kernel, grid, _, defines = next(iter(g._kernels.values()))
    assert defines["DYNAMIC"] == 1 and grid == fixed_grid
    assert torch.equal(graph_replayed(g, x, kwargs, want, captures=4, replays=10), want)
    assert g.dynamic_counters.tolist() == [0, 0]


@pytest.mark.parametrize("tokens", [1, 4])
@pytest.mark.parametrize(
    ("rows", "k", "half", "launch"),
    [
        (20512, 2560, None, {}),  # the KDA projections: asks past the last task are dropped
        (1003, 4096, None, dict(warps=16, blocks_per_sm=1)),  # many tasks a block, a last task of 3 rows
        (1536, 2560, 768, {}),  # the shared gate_up: a SwiGLU task asks for its up rows too
    ],
)
@pytest.mark.parametrize(
    ("ahead", "loop", "fetch"), [(1, True, 0), (2, True, 0), (4, False, 0), (0, True, 256), (2, True, 128)]
)
def test_l2_asks_change_no_result(rows, k, half, launch, tokens, ahead, loop, fetch):
    """GemvLaunch.l2_ahead only adds bulk prefetches to the L2 and l2_fetch a prefetch size to the weight
    loads (hints): the same outputs bit for bit as the register path, on the same grid, eagerly, under PDL
    and in a replayed CUDA graph."""
    import dataclasses

    from solo.kernels.pdl import LaunchPolicy

    g, _ = gemv(rows, k, half=half, limit=0.5 if half else None, **launch)
    g.launch_config = dataclasses.replace(g.launch_config, window=None)  # (as in the test above)
    x, kwargs = normed_call(rows, k, half, tokens)
    want = g(x, **kwargs)
    plain_grid = next(iter(g._kernels.values()))[1]
    g.launch_config = dataclasses.replace(g.launch_config, l2_ahead=ahead, l2_loop=loop, l2_fetch=fetch)
    g._kernels.clear()
    for pdl in (False, True):
        g.fused.launch = LaunchPolicy(pdl)
        assert torch.equal(g(x, **kwargs), want)
    _, grid, _, defines = next(iter(g._kernels.values()))
    asked = (defines.get("L2_AHEAD", 0), defines.get("L2_LOOP", 1), defines.get("L2_FETCH", 0))
    assert asked == (ahead, int(loop), fetch) and grid == plain_grid
    assert torch.equal(graph_replayed(g, x, kwargs, want, captures=1, replays=5), want)


@pytest.mark.parametrize("tokens", [1, 4])
@pytest.mark.parametrize(
    ("rows", "k", "warps", "in_flight", "blocks"),
    [(2560, 4096, 16, 8, 2), (2560, 4096, 8, 4, 3), (20512, 2560, 4, 8, 7)],
)
def test_more_blocks_an_sm_change_no_result(rows, k, warps, in_flight, blocks, tokens):
    """GemvLaunch.min_blocks only caps the registers (the output projections' shape, 320 tasks; the KDA
    projections', 2,564 tasks, where 7 blocks an SM spill): the same outputs bit for bit as the same warps
    without it, on a grid of that many blocks an SM, in a graph too."""
    import dataclasses

    g, _ = gemv(rows, k, warps=warps, max_in_flight=in_flight)
    x, kwargs = normed_call(rows, k, None, tokens)
    want = g(x, **kwargs)
    g.launch_config = dataclasses.replace(g.launch_config, min_blocks=blocks)
    g._kernels.clear()
    assert torch.equal(g(x, **kwargs), want)
    _, grid, _, defines = next(iter(g._kernels.values()))
    if tokens == 1:
        assert defines["MIN_BLOCKS"] == blocks and grid == min(-(-rows // 8), blocks * g.sms)
    assert torch.equal(graph_replayed(g, x, kwargs, want, captures=2, replays=3), want)


def test_l2_asks_refuse_the_bulk_ring_and_dynamic_tasks():
    x = torch.randn(1, 2560).to(torch.bfloat16).to(DEVICE)
    for extra in (dict(bulk=1), dict(dynamic=True)):
        g, _ = gemv(1536, 2560, half=768, limit=0.5, l2_ahead=1, **extra)
        with pytest.raises(ValueError, match="l2_ahead"):
            g(x)
    g, _ = gemv(1536, 2560, half=768, limit=0.5, l2_fetch=64)
    with pytest.raises(ValueError, match="l2_fetch"):
        g(x)


def test_dynamic_tasks_refuse_the_bulk_ring_and_the_late_wait():
    g, _ = gemv(1536, 2560, half=768, limit=0.5, bulk=1, dynamic=True)
    x = torch.randn(1, 2560).to(torch.bfloat16).to(DEVICE)
    with pytest.raises(ValueError, match="dynamic"):
        g(x)
    g, _ = gemv(1536, 2560, half=768, limit=0.5, dynamic=True)
    with pytest.raises(ValueError, match="dynamic"):
        g(x, norm_weight=torch.ones(2560, dtype=torch.bfloat16, device=DEVICE), late_wait=True)


@pytest.mark.parametrize("tokens", [1, 4])
def test_row_scales_in_bf16_and_fp32(tokens):
    """The LM head's format: one scale per row, bf16 or fp32 logits."""
    g, wf = gemv(3001, 2560, "row", warps=4)
    x = torch.randn(tokens, 2560).to(torch.bfloat16)
    want = x.float() @ wf.T
    assert rows_rel(g(x.to(DEVICE)).cpu(), want) < 1e-2
    out = torch.empty(tokens, 3001, dtype=torch.float32, device=DEVICE)
    assert rows_rel(g(x.to(DEVICE), out=out).cpu(), want) < 1e-5


def test_calls_past_max_tokens_go_to_the_triton_kernel():
    g, wf = gemv(512, 2560, max_tokens=1)  # the A/B setting: CUDA for one-token calls only
    x = torch.randn(4, 2560).to(torch.bfloat16)
    assert rows_rel(g(x.to(DEVICE)).cpu(), project(x, wf)) < 1e-2
    assert g.counter.item() == 0  # the CUDA kernel's counter did not move
    g8, wf8 = gemv(512, 2560)
    x = torch.randn(9, 2560).to(torch.bfloat16)  # wider than the kernel's 8 columns
    assert rows_rel(g8(x.to(DEVICE)).cpu(), project(x, wf8)) < 1e-2
    assert g8.counter.item() == 0


ROUTER_SHAPES = {  # (experts, groups, groups kept, top-k, renormalise)
    "ling": (512, 8, 4, 8, True),  # Ling-3.0-flash's router
    "64 in 8 groups keep 4, top-4, raw": (64, 8, 4, 4, False),  # groups narrower than a warp
    "64 no groups": (64, 1, 1, 8, True),
    "256 in 4 groups keep 2": (256, 4, 2, 8, True),
}


@pytest.mark.parametrize(
    ("shape", "tokens"),
    [
        ("ling", 1),
        ("ling", 4),
        ("ling", 8),
        ("64 in 8 groups keep 4, top-4, raw", 3),
        ("64 no groups", 1),
        ("256 in 4 groups keep 2", 4),
    ],
)
@pytest.mark.parametrize("fast_select", [False, True])
def test_the_router_chooses_as_the_reference(shape, tokens, fast_select):
    """The model's Router in fp32 on the same normalised input, every token of the call (each selected
    by its own block); drawn again when a run comes within rounding of a tie. `fast_select`: the
    selection ranks only the kept groups' warps (router_select.cuh FAST_SELECT, where groups are whole
    warps): the same choices as the full ranking, bit for bit, with the groups ranked once (lean_select) or per
    lane."""
    from solo.checkpoint.synthetic import synthetic_config
    from solo.kernels.cuda_step import CudaRouter
    from solo.kernels.fused_router import FusedRouter
    from solo.model.layers import RMSNorm
    from solo.model.moe import Router
    from solo.testing.routing import routing_margin

    experts, groups, keep, top_k, renorm = ROUTER_SHAPES[shape]
    config = synthetic_config(
        num_layers=1,
        num_experts=experts,
        n_group=groups,
        topk_group=keep,
        num_experts_per_tok=top_k,
        norm_topk_prob=renorm,
    )
    ref = Router(config)
    checked = 0
    for _ in range(20):
        ref.weight.data = torch.randn(experts, 2560) * 0.02
        ref.weight.data = ref.weight.data.to(torch.bfloat16).float()
        ref.expert_bias.data = torch.randn(experts) * 0.01
        norm = RMSNorm(2560, 1e-6)
        norm.weight.data = (1 + 0.1 * torch.randn(2560)).to(torch.bfloat16)
        x = torch.randn(tokens, 2560).to(torch.bfloat16)
        x[0] *= 4  # tokens of different scales: each is normalised on its own
        xn_ref = norm(x)
        if routing_margin(ref, xn_ref) < 1e-5:  # over every token
            continue
        counters = torch.zeros(3, dtype=torch.int32, device=DEVICE)
        fused = FusedRouter(
            ref.weight.data.to(torch.bfloat16).to(DEVICE),
            ref.expert_bias.data.to(DEVICE),
            norm.weight.data.to(DEVICE),
            1e-6,
            top_k,
            groups,
            keep,
            renorm,
            config.routed_scaling_factor,
            counters[0:1],
            counters[1:2],
        )
        router = CudaRouter(fused, counters[2:3])
        router.fast_select = fast_select
        xn, ids, wts = router(x.to(DEVICE))
        if fast_select:  # bit for bit the full ranking's, and the groups ranked per lane as before lean_select
            full = CudaRouter(fused, counters[2:3])
            full.fast_select = False
            assert all(torch.equal(a, b) for a, b in zip(full(x.to(DEVICE)), (xn, ids, wts), strict=True))
            per_lane = CudaRouter(fused, counters[2:3])
            per_lane.lean_select = False
            assert all(torch.equal(a, b) for a, b in zip(per_lane(x.to(DEVICE)), (xn, ids, wts), strict=True))
        want_w, want_ids = ref(xn_ref)
        # (its sum of squares adds in another order than the reference's: 1 / rms may differ in its last bits)
        assert_rmsnorm_rounding(xn.cpu(), x, norm.weight.data, 1e-6)
        # the same experts with the same weights; their order is their scores', and routing_margin guards only the
        # line between chosen and dropped, so two chosen within rounding of each other may come in either order
        got, want = ids.cpu().long().sort(-1), want_ids.sort(-1)
        assert torch.equal(got.values, want.values)
        assert rows_rel(wts.cpu().gather(1, got.indices), want_w.gather(1, want.indices)) < 1e-5
        again = router(x.to(DEVICE))  # the arrival counters reset themselves: same choice on a second launch
        assert torch.equal(again[1], ids) and torch.equal(again[2], wts)
        # (`full` and `per_lane` ran once more each)
        assert counters[2].item() == (4 if fast_select else 2) and counters[0].item() == 0
        checked += 1
        if checked == 3:
            break
    assert checked == 3

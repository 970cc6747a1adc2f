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
def test_schedule_covers_every_tile_once_in_need_order(blocks, hidden, inter, top_k, order):
    sched = decode_schedule(blocks, hidden, inter, top_k, order)
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


def test_schedule_at_ling_shapes_fits_an_h200():
    sched = decode_schedule(132, 2560, 768, 8)
    assert (sched.max_gate_up, sched.max_down) == (7, 3)
    assert sched.most_bytes <= 227 * 1024 - 24 * 1024  # room left for the staged activations
    assert sum(sched.block_bytes) == 8 * (1536 * 1280 + 1536 * 80) + 8 * (2560 * 384 + 2560 * 24)


def test_schedule_rejects_an_unknown_order():
    with pytest.raises(ValueError, match="order"):
        decode_schedule(4, 256, 256, 2, order="random")


def test_kernel_probes_are_named():
    assert DecodeKernelConfig().probe_code == 0 and DecodeKernelConfig(probe="copy_only").probe_code == 1
    with pytest.raises(ValueError, match="probe must be one of"):
        _ = DecodeKernelConfig(probe="fast").probe_code


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
    "num_experts,groups,keep", [(512, 8, 4), (64, 8, 4), (64, 1, 1), (256, 4, 2)]
)  # Ling's router; groups inside a warp; no group limit; groups of two warps each
def test_gpu_router_inside_the_kernel_chooses_as_the_reference(num_experts, groups, keep):
    """One launch: RMSNorm of the residual stream, router scores, grouped top-k in every block, then the
    experts it chose. Against the model's Router in fp32 on the CPU (the same experts where the draw is
    clear of ties, weights within fp32 rounding), the reference RMSNorm (bf16 values as it rounds them),
    and the same kernel given the chosen routing (exactly: the routing is all that differs)."""
    from solo.checkpoint.synthetic import synthetic_config
    from solo.kernels.cuda_moe import PersistentDecodeMoE
    from solo.kernels.fused_router import FusedRouter
    from solo.model.layers import RMSNorm
    from solo.model.moe import Router
    from solo.testing.routing import routing_margin

    experts = random_mxfp4_experts(num_experts, H, I, scales=(116, 126))
    moe = PersistentDecodeMoE(experts, swiglu_limit=7.0)
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
        # the sum of squares adds in another order than the reference's: a value on a bf16 rounding
        # boundary may move by one step, rarely
        step = xn_ref.float().abs().clamp_min(1e-30) * 2.0**-7
        diff = (xn.cpu().float() - xn_ref.float()).abs()
        assert bool((diff <= step).all()) and int((diff > 0).sum()) <= max(2, H // 1000)
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

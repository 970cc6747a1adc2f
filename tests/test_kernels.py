"""Triton MoE / FP8 kernels and the Humming backend against their torch references.

CPU part: Triton's interpreter (TRITON_INTERPRET=1) on small odd shapes. The interpreter must be
switched on before the kernel modules are imported, so on a machine without CUDA this module
switches it on itself; where that is not possible (a CUDA machine, or the kernels were imported
earlier by another test module) one test reruns this file's CPU tests in a subprocess.

GPU part (``-m gpu``, skipped without CUDA): Ling-3.0-flash shapes, bf16 tolerance against fp32
references, Humming, and CUDA-graph capture/replay.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from solo.testing.interpreter import interpret_without_gpu

if importlib.util.find_spec("triton") is None:
    pytest.skip("triton is not installed (pip install triton)", allow_module_level=True)

# TRITON_INTERPRET is read when triton (and its standard library) is first imported.
INTERPRET = interpret_without_gpu()

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from solo.assets import bundled_model  # noqa: E402
from solo.kernels import triton_fp8  # noqa: E402
from solo.kernels.moe import MXFP4Experts, TorchMoE, swiglu  # noqa: E402
from solo.kernels.triton_fp8 import Fp8Config, fp8_block_linear, fp8_rowwise_linear  # noqa: E402
from solo.kernels.triton_moe import MoEConfig, TritonMoE  # noqa: E402
from solo.kernels.triton_mxfp4_gemv import (  # noqa: E402
    _e2m1_pair,
    _e8m0,
    e2m1_standard_bytes,
    pack_e2m1_words,
    unpack_e2m1_words,
)
from solo.quantization.formats import (  # noqa: E402
    dequantize_fp8_block,
    dequantize_fp8_rowwise,
    dequantize_mxfp4,
    quantize_fp8_block,
    quantize_fp8_rowwise,
    quantize_mxfp4,
)
from solo.testing.moe import moe_reference_fp32, random_mxfp4_experts  # noqa: E402

cpu_only = pytest.mark.skipif(not INTERPRET, reason="interpreter tests run in a TRITON_INTERPRET=1 subprocess here")
gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(
    INTERPRET or not torch.cuda.is_available(), reason="needs a CUDA GPU (and no TRITON_INTERPRET)"
)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.double(), ref.double()
    return float((out - ref).norm() / ref.norm())


def mxfp4_experts(e: int, h: int, i: int, device: str = "cpu", seed: int | None = None) -> MXFP4Experts:
    g = torch.Generator(device="cpu")
    if seed is not None:
        g.manual_seed(seed)
    else:
        g.seed()
    gate_up = torch.randn((e, 2 * i, h), generator=g) * 0.05
    down = torch.randn((e, h, i), generator=g) * 0.05
    gp, gs = quantize_mxfp4(gate_up)
    dp, ds = quantize_mxfp4(down)
    return MXFP4Experts(gp.to(device), gs.to(device), dp.to(device), ds.to(device))


def random_routing(t: int, k: int, e: int, device: str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.stack([torch.randperm(e)[:k] for _ in range(t)]).to(device)
    w = torch.rand((t, k)) + 0.1
    w = (w / w.sum(-1, keepdim=True) * 2.5).to(device)
    return ids, w


# ============================================================================== CPU (interpreter)


@cpu_only
@pytest.mark.parametrize("limit", [None, 0.6])
@pytest.mark.parametrize(
    "config",
    [
        MoEConfig(gemv_max_tokens=0),
        MoEConfig(pf_block_t=16, pf_block_i=16, pf_block_h=32, pf_block_k=64, gemv_max_tokens=0),
        MoEConfig(gemv_max_tokens=0, pf_f16=False),
        MoEConfig(pf_block_t=16, pf_block_i=16, pf_block_h=32, pf_block_k=64, gemv_max_tokens=0, pf_f16=False),
    ],
    ids=["f16", "f16-small_tiles", "dot_scaled", "dot_scaled-small_tiles"],
)
def test_triton_moe_grouped_matches_torch_reference(limit, config):
    """The grouped tensor-core kernels (gemv_max_tokens=0 routes every T to them), on fp16 products and
    on tl.dot_scaled: tokens share experts (up to 19 x 4 assignments over 16 experts), blocks are
    partly padding, K tiles partial."""
    h, i, e, k = 160, 64, 16, 4
    experts = mxfp4_experts(e, h, i)
    moe = TritonMoE(experts, dtype=torch.bfloat16, swiglu_limit=limit, config=config)
    assert moe.uses_f16_prefill() == config.pf_f16
    ref = TorchMoE(experts, torch.float32, swiglu_limit=limit)
    for t in (1, 5, 19):
        x = torch.randn((t, h)).to(torch.bfloat16)
        ids, w = random_routing(t, k, e)
        out = torch.full((t, h), float("nan"), dtype=torch.bfloat16)
        res = moe.forward(x, ids, w, out=out)
        assert res.data_ptr() == out.data_ptr()
        assert not torch.isnan(out).any(), "output not fully written"
        expected = ref(x.float(), ids, w)
        # The interpreter truncates fp32 -> bf16 (the GPU rounds to nearest), so the bf16 act and
        # output carry up to twice the usual rounding error here.
        assert rel_err(out, expected) < 1e-2, (t, rel_err(out, expected))


@cpu_only
def test_grouped_f16_products_exact_at_the_scale_range_edges():
    """Random codes with E8M0 scales drawn from the whole range the fp16 path accepts (2^-23 .. 2^1);
    a checkpoint with a larger scale makes the kernels use tl.dot_scaled instead."""
    h, i, e, k, t = 128, 64, 8, 2, 3
    experts = MXFP4Experts(
        gate_up=torch.randint(0, 256, (e, 2 * i, h // 2), dtype=torch.uint8),
        gate_up_scale=torch.randint(104, 129, (e, 2 * i, h // 32), dtype=torch.uint8),
        down=torch.randint(0, 256, (e, h, i // 2), dtype=torch.uint8),
        down_scale=torch.randint(104, 129, (e, h, i // 32), dtype=torch.uint8),
    )
    moe = TritonMoE(experts, config=MoEConfig(gemv_max_tokens=0))
    assert moe.uses_f16_prefill()
    x = torch.randn((t, h)).to(torch.bfloat16)
    ids, w = random_routing(t, k, e)
    ref = TorchMoE(experts, torch.float32)(x.float(), ids, w)
    assert rel_err(moe.forward(x, ids, w), ref) < 1e-2
    experts.down_scale[0, 0, 0] = 129
    assert not TritonMoE(experts, config=MoEConfig(gemv_max_tokens=0)).uses_f16_prefill()


@cpu_only
@pytest.mark.parametrize(
    "config,limit",
    [
        (MoEConfig(), None),
        (MoEConfig(), 0.6),
        (MoEConfig(gv_gu_block_n=64, gv_gu_block_w=8, gv_dn_block_n=64, gv_dn_block_w=4, gv_dn_split_e=1), 0.6),
        (MoEConfig(gv_gu_block_n=32, gv_dn_block_n=32, gv_dn_block_w=4, gv_dn_split_e=3), None),
    ],
    ids=["default", "default-clamp", "masked_rows", "split3"],
)
def test_triton_moe_gemv_path_matches_reference(limit, config):
    """The CUDA-core GEMV kernels (T <= gemv_max_tokens) on shapes that leave partial tiles; at T = 4
    the down kernel takes its early-weights path (one expert per program; 1 or 3 K tiles here)."""
    h, i, e, k = 160, 96, 12, 3  # 20 words per gate_up row, 12 per down row: partial word tiles
    experts = mxfp4_experts(e, h, i)
    moe = TritonMoE(experts, dtype=torch.bfloat16, swiglu_limit=limit, config=config)
    ref = TorchMoE(experts, torch.float32, swiglu_limit=limit)
    for t in (1, 4):
        assert moe.uses_gemv(t)
        x = torch.randn((t, h)).to(torch.bfloat16)
        ids, w = random_routing(t, k, e)
        act = torch.full((t * k, i), float("nan"), dtype=torch.bfloat16)
        moe.launch_gemv_gate_up(x, ids.reshape(-1).contiguous(), act, k)
        assert not torch.isnan(act).any(), "activation not fully written"
        out = torch.full((t, h), float("nan"), dtype=torch.bfloat16)
        moe.forward(x, ids, w, out=out)
        assert not torch.isnan(out).any(), "output not fully written"
        assert rel_err(out, ref(x.float(), ids, w)) < 1e-2, (t, rel_err(out, ref(x.float(), ids, w)))
    assert not moe.uses_gemv(moe.config.gemv_max_tokens + 1)
    for name, buf in moe._scratch.items():
        if name.endswith("_cnt"):
            assert int(buf.abs().sum()) == 0, name


@cpu_only
@pytest.mark.parametrize(
    "config",
    [MoEConfig(), MoEConfig(gv_dn_block_n=64, gv_dn_split_e=1), MoEConfig(gv_dn_block_n=32, gv_dn_split_e=3)],
    ids=["default", "masked_rows", "split3"],
)
def test_gemv_down_adds_onto_the_residual_as_the_shared_down_did(config):
    """TritonMoE.add_onto_residual (verification's MoE layer end with its shared expert beside the router): the GEMV
    down kernel's last program adds (residual + shared) + its routed sum rounded to bf16, in fp32, rounded once,
    which is the shared down's epilogue's order. The same bits as forward() and that sum in torch, on fresh inputs,
    whole tiles, partial tiles and split sums alike; before_down runs between the two kernels."""
    h, i, e, k = 160, 96, 12, 3
    moe = TritonMoE(mxfp4_experts(e, h, i), dtype=torch.bfloat16, config=config)
    order: list[str] = []
    launch_down = moe.launch_gemv_down
    moe.launch_gemv_down = lambda *a, **kw: order.append("down") or launch_down(*a, **kw)
    for t in (1, 2, 4):
        x = torch.randn((t, h)).to(torch.bfloat16)
        ids, w = random_routing(t, k, e)
        residual = (torch.randn((t, h)) * 4).to(torch.bfloat16)
        shared = torch.randn((t, h)).to(torch.bfloat16)
        # (the routed sum in fp32, rounded to nearest by torch: the interpreter truncates in a bf16 store)
        routed = moe.forward(x, ids, w, out=torch.empty((t, h))).to(torch.bfloat16)
        expected = ((residual.float() + shared.float()) + routed.float()).to(torch.bfloat16)
        calls = moe.calls
        order.clear()
        moe.add_onto_residual(x, ids, w, residual, shared, before_down=lambda: order.append("join"))
        assert order == ["join", "down"] and moe.calls == calls + 1
        assert torch.equal(residual, expected), (t, (residual.float() - expected.float()).abs().max())
        assert not torch.equal(expected, routed)
    with pytest.raises(ValueError, match="alike"):
        moe.add_onto_residual(x, ids, w, residual, shared[:, :-1])
    for name, buf in moe._scratch.items():
        if name.endswith("_cnt"):
            assert int(buf.abs().sum()) == 0, name


@triton.jit
def _unpack_words_kernel(w_ptr, s_ptr, codes_ptr, scales_ptr, N: tl.constexpr):
    r = tl.arange(0, N)
    w = tl.load(w_ptr + r).to(tl.uint32, bitcast=True)
    for j in tl.static_range(4):
        lo, hi = _e2m1_pair(w, j)
        tl.store(codes_ptr + r * 8 + j, lo * 16384.0)
        tl.store(codes_ptr + r * 8 + (j + 4), hi * 16384.0)
    rs = tl.arange(0, 4 * N)
    tl.store(scales_ptr + rs, _e8m0(tl.load(s_ptr + rs)))


@cpu_only
def test_e2m1_word_unpacking_and_e8m0_are_exact():
    """The GEMV path's bit arithmetic on packed words, for every byte value (in shuffled words),
    equals the format."""
    raw = torch.arange(256, dtype=torch.uint8)[torch.randperm(256)]
    codes = torch.empty(512, dtype=torch.float32)
    scales = torch.empty(256, dtype=torch.float32)
    _unpack_words_kernel[(1,)](pack_e2m1_words(raw), raw, codes, scales, N=64)
    ones = torch.full((1,), 127, dtype=torch.uint8)
    expected = dequantize_mxfp4(raw.repeat(16).view(16, 256), ones.expand(16, 16).contiguous())[0]
    assert torch.equal(codes, expected), "E2M1 codes unpacked from 32-bit words differ from the format"
    normal = (raw > 0) & (raw < 255)  # E8M0 0 reads as 0 here (2^-127); 255 (NaN) as inf
    assert torch.equal(scales[normal], torch.exp2(raw[normal].double() - 127).float())


def test_packed_words_round_trip():
    """pack_e2m1_words is a bijection on the checkpoint's bytes (every byte value, random tensors)."""
    every = torch.arange(256, dtype=torch.uint8)[torch.randperm(256)].view(2, 128)
    assert torch.equal(unpack_e2m1_words(pack_e2m1_words(every)), every)
    raw = torch.randint(0, 256, (3, 7, 40), dtype=torch.uint8)
    words = pack_e2m1_words(raw)
    assert words.shape == (3, 7, 10) and words.dtype == torch.int32
    assert torch.equal(unpack_e2m1_words(words), raw)
    with pytest.raises(ValueError, match="multiple of 4"):
        pack_e2m1_words(torch.zeros((2, 6), dtype=torch.uint8))


def test_packed_words_in_slices_equal_one_pass(monkeypatch):
    """The packing runs in slices of rows (its int64 temporaries would not fit beside a full-shape model):
    slices that do not divide the rows give the same words as one pass."""
    import solo.kernels.triton_mxfp4_gemv as gemv

    raw = torch.randint(0, 256, (5, 9, 64), dtype=torch.uint8)
    whole = pack_e2m1_words(raw)
    for words in (16, 17, 48):  # one row a slice, one row (a partial second), three rows
        monkeypatch.setattr(gemv, "PACK_SLICE_WORDS", words)
        assert torch.equal(pack_e2m1_words(raw), whole)


@triton.jit
def _standard_bytes_kernel(w_ptr, out_ptr, R: tl.constexpr, C: tl.constexpr):
    rr = tl.arange(0, R)
    w = tl.load(w_ptr + rr[:, None] * C + tl.arange(0, C)[None, :]).to(tl.uint32, bitcast=True)
    tl.store(out_ptr + rr[:, None] * (4 * C) + tl.arange(0, 4 * C)[None, :], e2m1_standard_bytes(w))


@cpu_only
def test_in_kernel_unpacking_to_checkpoint_bytes():
    """e2m1_standard_bytes (the grouped kernels' way back to tl.dot_scaled's bytes) inverts the packing."""
    raw = torch.randint(0, 256, (4, 32), dtype=torch.uint8)
    out = torch.zeros_like(raw)
    _standard_bytes_kernel[(1,)](pack_e2m1_words(raw), out, R=4, C=8)
    assert torch.equal(out, raw)


@cpu_only
def test_moe_check_proves_both_kernel_families_ran():
    """`solo check`'s MoE check counts which Triton kernels ran: its prefill is one token longer than
    the GEMV path takes, so it runs the grouped kernels, and the decode step runs the GEMV kernels."""
    from solo.engine.engine import Engine
    from solo.preflight.checks import ACTIVE, check_moe_backend

    bundled = bundled_model()
    engine = Engine.from_pretrained(bundled, dtype=torch.bfloat16, moe_backend="triton", lm_head="bf16")
    check = check_moe_backend(engine, "triton")
    assert check.status == ACTIVE, check.reason
    layers = check.evidence["layers"]
    assert (check.evidence["gemv_calls"], check.evidence["tensor_core_calls"]) == (layers, layers)
    first = next(m.experts for m in engine.model.modules() if isinstance(getattr(m, "experts", None), TritonMoE))
    assert check.evidence["tokens"] == first.config.gemv_max_tokens + 2  # the prompt and one decode step
    assert check.evidence["prefill_products"] in ("fp16", "dot_scaled")
    assert "gemv_calls=" in check.line()


@cpu_only
def test_triton_moe_grouped_writes_every_activation():
    h, i, e, k, t = 96, 96, 8, 3, 6  # I=96 is not a multiple of the 64-row tile
    experts = mxfp4_experts(e, h, i)
    moe = TritonMoE(experts, config=MoEConfig(pf_block_i=64, pf_block_k=64, gemv_max_tokens=0))
    x = torch.randn((t, h)).to(torch.bfloat16)
    ids, w = random_routing(t, k, e)
    act = torch.full((t * k, i), float("nan"), dtype=torch.bfloat16)
    out = torch.full((t, h), float("nan"), dtype=torch.bfloat16)
    moe.launch_grouped(x, ids.reshape(-1).contiguous(), w.reshape(-1).contiguous(), act, out, k)
    assert not torch.isnan(act).any() and not torch.isnan(out).any()
    w_gu = dequantize_mxfp4(experts.gate_up, experts.gate_up_scale)[ids.reshape(-1)]
    hh = torch.einsum("ah,aoh->ao", x.float().repeat_interleave(k, 0), w_gu)
    expected = swiglu(hh[:, :i], hh[:, i:], None)
    assert rel_err(act, expected) < 1e-2


def _fp8_case(kind: str, n: int, kdim: int):
    w = torch.randn((n, kdim)) * 0.05
    if kind == "block":
        q, s = quantize_fp8_block(w)
        return q, s, dequantize_fp8_block(q, s)
    q, s = quantize_fp8_rowwise(w)
    return q, s, dequantize_fp8_rowwise(q, s)


@cpu_only
@pytest.mark.parametrize("kind", ["rowwise", "block"])
@pytest.mark.parametrize(
    "config",
    [
        None,
        Fp8Config(32, 64, 16, False, 4, 2),
        Fp8Config(16, 128, 8, True, 4, 2),
        Fp8Config(16, 64, 16, True, 2, 3, split_k=3),
        Fp8Config(32, 128, 16, False, 2, 3, split_k=8),
    ],
    ids=["default", "x_lhs", "small", "split3", "split8_x_lhs"],
)
def test_fp8_linear_matches_dequantized_matmul(kind, config):
    fn = fp8_block_linear if kind == "block" else fp8_rowwise_linear
    for n, kdim, t in ((200, 160, 1), (130, 96, 3), (72, 320, 5)):
        q, s, w = _fp8_case(kind, n, kdim)
        x = torch.randn((t, kdim)).to(torch.bfloat16)
        expected = x.float() @ w.T
        out = torch.full((t, n), float("nan"), dtype=torch.float32)
        fn(x, q, s, out=out, config=config)
        assert not torch.isnan(out).any(), "output not fully written"
        assert rel_err(out, expected) < 1e-5  # fp16 holds E4M3 and these bf16 inputs exactly
        out_bf = fn(x, q, s, config=config)
        assert out_bf.dtype == torch.bfloat16 and out_bf.shape == (t, n)
        assert rel_err(out_bf, expected) < 1e-2


@cpu_only
def test_fp8_split_k_is_deterministic_and_resets_its_counters():
    from solo.kernels.triton_fp8 import _SCRATCH, fp8_config

    q, s, w = _fp8_case("block", 200, 640)
    assert fp8_config("block", 200, 640).split_k > 1  # the default splits K for a small layer
    x = torch.randn((2, 640)).to(torch.bfloat16)
    first = fp8_block_linear(x, q, s, out_dtype=torch.float32)
    again = fp8_block_linear(x, q, s, out_dtype=torch.float32)
    assert torch.equal(first, again)  # partial sums meet in a fixed order
    assert rel_err(first, x.float() @ w.T) < 1e-5
    counters = [buf for (dev, name), buf in _SCRATCH.items() if name == "fp8_cnt"]
    assert counters and all(int(c.abs().sum()) == 0 for c in counters)  # ready for the next call / graph replay


@cpu_only
def test_fp8_linear_leading_dims_and_many_tokens():
    q, s, w = _fp8_case("rowwise", 48, 64)
    x = torch.randn((2, 9, 64)).to(torch.bfloat16)  # 18 rows: two token tiles of 16
    out = fp8_rowwise_linear(x, q, s, out_dtype=torch.float32)
    assert out.shape == (2, 9, 48)
    assert rel_err(out, x.float() @ w.T) < 1e-5


def test_triton_cache_dir_defaults_under_solo_cache(monkeypatch, tmp_path):
    monkeypatch.delenv("TRITON_CACHE_DIR", raising=False)
    monkeypatch.setenv("SOLO_CACHE_DIR", str(tmp_path))
    assert triton_fp8.configure_triton_cache() == str(tmp_path / "triton")
    assert (tmp_path / "triton").is_dir()
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "mine"))
    assert triton_fp8.configure_triton_cache() == str(tmp_path / "mine")
    report = triton_fp8.kernel_cache_report()
    assert report["cache_dir"] == str(tmp_path / "mine")
    for key in ("warmups", "compile_seconds", "all_cached", "new_cache_entries"):
        assert key in report


def test_backends_refuse_cpu_without_interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(RuntimeError, match="NVIDIA GPU"):
        triton_fp8.require_triton_device("--moe-backend triton", torch.device("cpu"))
    if not torch.cuda.is_available():
        from solo.kernels.humming_moe import HummingMoE

        with pytest.raises(RuntimeError, match="pip install humming-kernels"):
            HummingMoE(mxfp4_experts(4, 64, 32, seed=0))


def _indexed_gemm(x, weights, sorted_ids, expert_ids, num_padded, top_k, block_m):
    """What an indexed MoE GEMM computes from routing tables (Humming's contract, like vLLM's
    moe_align_block_size): block b multiplies expert_ids[b] with the rows sorted_ids[b*block_m:...]
    that are < n (row a reads input a // top_k); written out with Python loops."""
    n = x.shape[0] * top_k
    out = torch.full((n, weights.shape[1]), float("nan"))
    seen = torch.zeros(n, dtype=torch.int64)
    for b in range(int(num_padded) // block_m):
        for a in sorted_ids[b * block_m : (b + 1) * block_m].tolist():
            if a < n:
                out[a] = weights[int(expert_ids[b])] @ x[a // top_k]
                seen[a] += 1
    assert torch.equal(seen, torch.ones(n, dtype=torch.int64)), "every assignment exactly once"
    return out


@pytest.mark.parametrize("t", [1, 3, 4])
def test_humming_small_call_tables_equal_sorted_tables(t):
    """The constant one-block-per-assignment tables used for decode/verification compute the same
    thing as the sorted tables, also when tokens share experts."""
    from solo.kernels.routing import align_routing, one_block_per_assignment

    g = torch.Generator().manual_seed(100 + t)
    e, k, hdim, ndim = 6, 4, 8, 5
    ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)])  # repeats across tokens
    x = torch.randn((t, hdim), generator=g)
    wts = torch.randn((e, ndim, hdim), generator=g)
    for block_m in (1, 4, 16):
        sorted_ids, expert_ids, padded = align_routing(ids, block_m)
        want = _indexed_gemm(x, wts, sorted_ids, expert_ids, padded, k, block_m)
        const_ids, const_padded = one_block_per_assignment(t * k, block_m, torch.device("cpu"))
        got = _indexed_gemm(x, wts, const_ids, ids.reshape(-1).to(torch.int32), const_padded, k, block_m)
        torch.testing.assert_close(got, want)


@pytest.mark.skipif(INTERPRET, reason="the interpreter tests already run in this process")
def test_interpreter_suite_in_subprocess():
    env = dict(os.environ, TRITON_INTERPRET="1", CUDA_VISIBLE_DEVICES="")
    root = Path(__file__).resolve().parents[1]
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(root), env.get("PYTHONPATH")]))
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-x", "-m", "not gpu", "-p", "no:cacheprovider", __file__],
        cwd=root,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]


# ============================================================================== GPU

H, I, E, TOPK = 2560, 768, 512, 8


@pytest.fixture(scope="module")
def cuda_experts():
    if INTERPRET or not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    return random_mxfp4_experts(E, H, I)


@gpu
@needs_cuda
@pytest.mark.parametrize("t", [1, 4, 16])
@pytest.mark.parametrize("limit", [None, 7.0])
@pytest.mark.parametrize("path", ["gemv", "grouped"])
def test_gpu_triton_moe_real_shapes(cuda_experts, t, limit, path):
    config = MoEConfig() if path == "gemv" else MoEConfig(gemv_max_tokens=0)
    moe = TritonMoE(cuda_experts, dtype=torch.bfloat16, swiglu_limit=limit, config=config)
    assert moe.uses_gemv(t) == (path == "gemv")
    x = torch.randn((t, H), device="cuda").to(torch.bfloat16)
    ids, w = random_routing(t, TOPK, E, "cuda")
    out = torch.full((t, H), float("nan"), dtype=torch.bfloat16, device="cuda")
    moe.forward(x, ids, w, out=out)
    torch.cuda.synchronize()
    assert not torch.isnan(out).any()
    ref = moe_reference_fp32(cuda_experts, x, ids, w, limit)
    assert rel_err(out, ref) <= 1e-2
    # split reductions are deterministic and leave their counters at zero
    for _ in range(3):
        assert torch.equal(moe.forward(x, ids, w), out)
    assert all(int(b.abs().sum()) == 0 for n, b in moe._scratch.items() if n.endswith("_cnt"))


@gpu
@needs_cuda
def test_gpu_humming_matches_reference(cuda_experts):
    try:
        from solo.kernels.humming_moe import HummingMoE

        moe = HummingMoE(cuda_experts, dtype=torch.bfloat16)
    except RuntimeError as exc:
        pytest.skip(str(exc))
    for t in (1, 4):
        x = torch.randn((t, H), device="cuda").to(torch.bfloat16)
        ids, w = random_routing(t, TOPK, E, "cuda")
        out = moe(x, ids, w)
        ref = moe_reference_fp32(cuda_experts, x, ids, w)
        assert rel_err(out, ref) <= 1e-2, (t, rel_err(out, ref))
        # repeated experts across tokens (verification batches share experts)
        ids2 = ids.clone()
        ids2[-1] = ids[0]
        out2 = moe(x, ids2, w)
        assert rel_err(out2, moe_reference_fp32(cuda_experts, x, ids2, w)) <= 1e-2


def _graph_check(fn, inputs: list[torch.Tensor], fresh: list[torch.Tensor]) -> None:
    """Capture fn() over static inputs, replay after copying fresh data in, compare with eager."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        static_out = fn()
    for dst, src in zip(inputs, fresh, strict=True):
        dst.copy_(src)
    g.replay()
    torch.cuda.synchronize()
    eager = fn()
    torch.cuda.synchronize()
    assert torch.equal(static_out, eager)


@gpu
@needs_cuda
def test_gpu_cuda_graph_replay(cuda_experts):
    moe = TritonMoE(cuda_experts)
    for t in (1, 4):
        x = torch.randn((t, H), device="cuda").to(torch.bfloat16)
        ids, w = random_routing(t, TOPK, E, "cuda")
        x2 = torch.randn((t, H), device="cuda").to(torch.bfloat16)
        ids2, w2 = random_routing(t, TOPK, E, "cuda")
        _graph_check(lambda x=x, ids=ids, w=w: moe.forward(x, ids, w), [x, ids, w], [x2, ids2, w2])
    q = torch.randn((4096, 2560), device="cuda").to(torch.float8_e4m3fn)
    s = torch.rand((32, 20), device="cuda") * 1e-2
    x = torch.randn((2, 2560), device="cuda").to(torch.bfloat16)
    _graph_check(lambda: fp8_block_linear(x, q, s), [x], [torch.randn_like(x)])
    r = torch.rand((4096,), device="cuda") * 1e-2
    _graph_check(lambda: fp8_rowwise_linear(x, q, r), [x], [torch.randn_like(x)])
    try:
        from solo.kernels.humming_moe import HummingMoE

        hm = HummingMoE(cuda_experts)
    except RuntimeError:
        return
    x = torch.randn((4, H), device="cuda").to(torch.bfloat16)
    ids, w = random_routing(4, TOPK, E, "cuda")
    ids2, w2 = random_routing(4, TOPK, E, "cuda")
    hm(x, ids, w)  # JIT compile outside the capture
    _graph_check(lambda: hm.forward(x, ids, w), [ids, w], [ids2, w2])


@gpu
@needs_cuda
@pytest.mark.parametrize("t", [1, 4])
def test_gpu_fp8_rowwise_lm_head(t):
    n, k = 157184, 2560
    w = torch.randn((n, k), device="cuda") * 0.02
    q, s = quantize_fp8_rowwise(w)
    del w
    x = torch.randn((t, k), device="cuda").to(torch.bfloat16)
    out = torch.full((t, n), float("nan"), dtype=torch.bfloat16, device="cuda")
    fp8_rowwise_linear(x, q, s, out=out)
    torch.cuda.synchronize()
    assert not torch.isnan(out).any()
    ref = torch.cat(
        [x.float() @ dequantize_fp8_rowwise(q[j : j + 16384], s[j : j + 16384]).T for j in range(0, n, 16384)], dim=1
    )
    assert rel_err(out, ref) <= 1e-2
    logits = fp8_rowwise_linear(x, q, s, out_dtype=torch.float32)  # what the FP8 head's logits() stores
    assert logits.dtype == torch.float32 and rel_err(logits, ref) <= 1e-4
    assert torch.equal(logits.to(torch.bfloat16), out)  # the same sums, rounded once


@gpu
@needs_cuda
@pytest.mark.parametrize("n,k", [(4096, 2560), (2560, 4096), (6144, 2560), (576, 2560), (2560, 768), (1000, 1000)])
@pytest.mark.parametrize("t", [1, 4, 17])
def test_gpu_fp8_block_linear(n, k, t):
    w = torch.randn((n, k), device="cuda") * 0.02
    q, s = quantize_fp8_block(w)
    x = torch.randn((t, k), device="cuda").to(torch.bfloat16)
    out = torch.full((t, n), float("nan"), dtype=torch.bfloat16, device="cuda")
    fp8_block_linear(x, q, s, out=out)
    torch.cuda.synchronize()
    assert not torch.isnan(out).any()
    assert rel_err(out, x.float() @ dequantize_fp8_block(q, s).T) <= 1e-2
    out32 = fp8_block_linear(x, q, s, out_dtype=torch.float32)
    assert rel_err(out32, x.float() @ dequantize_fp8_block(q, s).T) <= 1e-4
    assert torch.equal(out32, fp8_block_linear(x, q, s, out_dtype=torch.float32))  # split-K is deterministic


@gpu
@needs_cuda
def test_gpu_warmup_reports_compile_and_cache(cuda_experts):
    moe = TritonMoE(cuda_experts)
    rec = moe.warmup(top_k=TOPK, max_tokens=4)
    assert rec["seconds"] >= 0
    triton_fp8.warmup_fp8_linear("block", 4096, 2560)
    report = triton_fp8.kernel_cache_report()
    assert len(report["warmups"]) >= 2
    assert report["cache_dir"] and os.path.isdir(report["cache_dir"])
    # a second warm-up of the same shapes compiles nothing new
    rec2 = moe.warmup(top_k=TOPK, max_tokens=4)
    assert rec2["new_cache_entries"] == 0

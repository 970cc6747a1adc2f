"""Tests for solo.quantization.formats against independent oracles (ml_dtypes, torch dtypes)."""

import json
import math
import subprocess
import sys

import ml_dtypes
import numpy as np
import pytest
import torch

from solo.quantization import formats as F

FP4 = ml_dtypes.float4_e2m1fn
E8M0 = ml_dtypes.float8_e8m0fnu
E4M3 = ml_dtypes.float8_e4m3fn
TIES = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _f32_bits(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a, dtype=np.float32).view(np.int32)


# --------------------------------------------------------------------------- oracles


def _oracle_mxfp4(w: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """OCP MX v1.0 in numpy/ml_dtypes: (codes [..., K], scale bytes [..., K/32], dequant)."""
    blocks = w.astype(np.float64).reshape(*w.shape[:-1], -1, 32)
    amax = np.abs(blocks).max(axis=-1)
    with np.errstate(divide="ignore"):
        e = np.floor(np.log2(amax)) - 2  # emax(E2M1) = 2
    e = np.where(amax == 0, -127, np.clip(e, -127, 127)).astype(np.int64)
    scaled = (blocks / np.exp2(e.astype(np.float64))[..., None]).astype(np.float32)
    codes = scaled.astype(FP4).view(np.uint8).reshape(w.shape)
    deq = scaled.astype(FP4).astype(np.float64) * np.exp2(e.astype(np.float64))[..., None]
    return codes, (e + 127).astype(np.uint8), deq.reshape(w.shape)


def _mxfp4_bound(x: np.ndarray, scale_bytes: np.ndarray) -> np.ndarray:
    """Per-element |error| bound: half an E2M1 ULP at |x|/s, or the saturation distance above 6.

    E2M1 magnitudes 0, .5, 1, 1.5 | 2, 3 | 4, 6 have spacing .5 on [0, 2], 1 on [2, 4],
    2 on [4, 6]; round-to-nearest is off by at most half of that (times the scale s), and
    values beyond 6 clamp to 6 (error |x|/s - 6, in units of s).
    """
    s = np.exp2(scale_bytes.astype(np.float64) - 127)[..., None]
    y = np.abs(x.astype(np.float64)).reshape(*scale_bytes.shape, 32) / s
    half_ulp = np.where(y < 2, 0.25, np.where(y < 4, 0.5, 1.0))
    bound = np.where(y <= 6, half_ulp, y - 6) * s
    return bound.reshape(x.shape)


def _expand(scale: np.ndarray, block: tuple[int, int], shape: tuple[int, int]) -> np.ndarray:
    full = np.repeat(np.repeat(scale, block[0], axis=-2), block[1], axis=-1)
    return full[..., : shape[0], : shape[1]]


def _fp8_bound(w: np.ndarray, scale_full: np.ndarray) -> np.ndarray:
    """E4M3 keeps 3 mantissa bits: relative error <= 2**-4 for normals (|w/s| >= 2**-6),
    absolute error <= half the subnormal step 2**-9 (times s) below that."""
    return np.maximum(np.abs(w) * 2.0**-4, scale_full * 2.0**-10)


# --------------------------------------------------------------------------- E2M1 / E8M0


def test_e2m1_table_matches_ml_dtypes() -> None:
    ref = np.arange(16, dtype=np.uint8).view(FP4).astype(np.float32)
    ours = F.e2m1_decode(torch.arange(16, dtype=torch.uint8)).numpy()
    np.testing.assert_array_equal(_f32_bits(ours), _f32_bits(ref))  # bitwise: -0 at code 8
    np.testing.assert_array_equal(_f32_bits(F.E2M1_VALUES.numpy()), _f32_bits(ref))
    bf16 = F.e2m1_decode(torch.arange(16, dtype=torch.uint8), torch.bfloat16)
    assert bf16.dtype == torch.bfloat16
    np.testing.assert_array_equal(bf16.float().numpy(), ref)


def test_e8m0_decode_all_bytes() -> None:
    raw = np.arange(256, dtype=np.uint8)
    ref = raw.view(E8M0).astype(np.float32)
    ours = F.e8m0_decode(torch.from_numpy(raw)).numpy()
    assert np.isnan(ref[255]) and np.isnan(ours[255])
    np.testing.assert_array_equal(_f32_bits(ours[:255]), _f32_bits(ref[:255]))
    assert ours[0] == 2.0**-127 and ours[127] == 1.0 and ours[254] == 2.0**127
    if hasattr(torch, "float8_e8m0fnu"):
        t = torch.from_numpy(raw).view(torch.float8_e8m0fnu).float().numpy()
        np.testing.assert_array_equal(_f32_bits(ours[:255]), _f32_bits(t[:255]))
        as_dtype = F.e8m0_decode(torch.from_numpy(raw).view(torch.float8_e8m0fnu))
        np.testing.assert_array_equal(_f32_bits(as_dtype.numpy()[:255]), _f32_bits(ref[:255]))
    bf16 = F.e8m0_decode(torch.from_numpy(raw[:255]), torch.bfloat16)
    np.testing.assert_array_equal(bf16.float().numpy(), ref[:255])


def _encode_inputs(seed: int) -> np.ndarray:
    g = _gen(seed)
    parts = [
        torch.empty(4000).uniform_(-8, 8, generator=g),
        torch.randn(4000, generator=g) * torch.exp(torch.empty(4000).uniform_(-8, 6, generator=g)),
        torch.tensor([t * sgn for t in TIES for sgn in (1.0, -1.0)]),
        F.E2M1_VALUES,
        torch.tensor([6.0, 6.5, 7.0, 7.9, 100.0, 1e30, math.inf, -7.0, -1e30, -math.inf]),
        torch.tensor([0.0, -0.0, 1e-40, -1e-40, 0.2499999, 0.2500001, 4.999999, 5.000001]),
    ]
    return torch.cat(parts).numpy().astype(np.float32)


def test_e2m1_encode_matches_ml_dtypes_rne() -> None:
    x = _encode_inputs(1)
    ref = x.astype(FP4).view(np.uint8)
    ours = F.e2m1_encode(torch.from_numpy(x)).numpy()
    np.testing.assert_array_equal(ours, ref)
    # ties go to the code with mantissa bit 0
    ties = F.e2m1_encode(torch.tensor(TIES)).tolist()
    assert ties == [0, 2, 2, 4, 4, 6, 6]
    assert all(c % 2 == 0 for c in ties)


def test_e2m1_encode_bf16_input() -> None:
    x = torch.from_numpy(_encode_inputs(2)).bfloat16()
    ref = x.float().numpy().astype(FP4).view(np.uint8)
    np.testing.assert_array_equal(F.e2m1_encode(x).numpy(), ref)


# --------------------------------------------------------------------------- packing

_TORCH_FP4_PACKER = r"""
import importlib.util, json, sys, types
if importlib.util.find_spec("expecttest") is None:  # torch's test helpers import it, unused here
    stub = types.ModuleType("expecttest")
    stub.TestCase = object
    sys.modules["expecttest"] = stub
import torch
from torch.testing._internal.common_quantized import _bfloat16_to_float4_e2m1fn_x2
vals = torch.tensor(json.load(sys.stdin), dtype=torch.bfloat16)
fp4x2 = _bfloat16_to_float4_e2m1fn_x2(vals)
assert fp4x2.dtype == torch.float4_e2m1fn_x2
print(json.dumps(fp4x2.view(torch.uint8).tolist()))
"""


def test_packing_matches_torch_float4_e2m1fn_x2() -> None:
    """Build a torch.float4_e2m1fn_x2 tensor with torch's own builder (in a clean subprocess)."""
    if not hasattr(torch, "float4_e2m1fn_x2"):
        pytest.skip("this torch has no float4_e2m1fn_x2 dtype")
    g = _gen(3)
    codes = torch.randint(0, 16, (4, 64), generator=g, dtype=torch.uint8)
    codes[codes == 8] = 0  # -0 is not sign-preserving through every builder; compare values
    codes[:, ::32] = 7  # a 6 in every block of 32 pins the MXFP4 scale at 2**0 (used below)
    values = np.asarray(codes.numpy()).view(FP4).astype(np.float32)
    proc = subprocess.run(
        [sys.executable, "-c", _TORCH_FP4_PACKER],
        input=json.dumps(values.tolist()),
        capture_output=True,
        text=True,
        timeout=120,
    )
    if proc.returncode != 0:
        pytest.skip(f"cannot build a float4_e2m1fn_x2 tensor with this torch: {proc.stderr[-300:]}")
    torch_bytes = torch.tensor(json.loads(proc.stdout), dtype=torch.uint8)
    ours = F.pack_fp4(codes)
    assert torch.equal(ours, torch_bytes)
    assert torch.equal(F.unpack_fp4(torch_bytes.view(torch.float4_e2m1fn_x2)), codes)
    # and the packed output of the quantizer is the same layout
    packed, scales = F.quantize_mxfp4(torch.from_numpy(values))
    assert torch.equal(packed, torch_bytes) and torch.all(scales == 127)
    assert torch.equal(F.dequantize_mxfp4(packed, scales), torch.from_numpy(values))


def test_pack_unpack_roundtrip_and_nibble_order() -> None:
    codes = torch.randint(0, 16, (3, 5, 32), generator=_gen(4), dtype=torch.uint8)
    packed = F.pack_fp4(codes)
    assert packed.shape == (3, 5, 16) and packed.dtype == torch.uint8
    assert torch.equal(packed & 0x0F, codes[..., 0::2])
    assert torch.equal(packed >> 4, codes[..., 1::2])
    assert torch.equal(F.unpack_fp4(packed), codes)
    assert F.pack_fp4(torch.tensor([1, 2], dtype=torch.uint8)).item() == 0x21
    with pytest.raises(ValueError, match="even"):
        F.pack_fp4(torch.zeros(3, 5, dtype=torch.uint8))


# --------------------------------------------------------------------------- MXFP4


def _mx_test_tensor(scale: float, seed: int) -> torch.Tensor:
    g = _gen(seed)
    w = torch.randn(16, 256, generator=g) * scale
    w[0, 32:64] = 0.0  # an all-zero block
    w[1, 0:32] = torch.randn(32, generator=g) * 1e-40  # float32 subnormals (scale clamps to 2**-127)
    w[1, 32:64] = torch.randn(32, generator=g) * 3e-39  # clamped scale, some nonzero codes
    w[2, 64:96] *= torch.exp(torch.empty(32).uniform_(-12, 0, generator=g))  # wide dynamic range
    w[3, 96] = 1e3 * scale  # an outlier flushing its block-mates to 0
    w[4, :32] = torch.tensor([t for t in TIES for _ in range(5)][:32]) * 2.0**-5  # scaled ties
    w[4, 31] = 6.0 * 2.0**-5  # pins this block's scale at 2**-5: exact ties after division
    return w


@pytest.mark.parametrize("scale", [1e-6, 1e-2, 1.0, 1e3])
def test_quantize_mxfp4_matches_ocp_oracle(scale: float) -> None:
    w = _mx_test_tensor(scale, seed=int(-math.log10(scale)) + 10)
    packed, scales = F.quantize_mxfp4(w)
    assert packed.shape == (16, 128) and packed.dtype == torch.uint8
    assert scales.shape == (16, 8) and scales.dtype == torch.uint8
    ref_codes, ref_scales, ref_deq = _oracle_mxfp4(w.numpy())
    np.testing.assert_array_equal(scales.numpy(), ref_scales)
    np.testing.assert_array_equal(F.unpack_fp4(packed).numpy(), ref_codes)
    deq = F.dequantize_mxfp4(packed, scales)
    assert deq.dtype == torch.float32 and deq.shape == w.shape
    np.testing.assert_array_equal(deq.numpy().astype(np.float64), ref_deq)

    x = w.numpy().astype(np.float64)
    err = np.abs(deq.numpy().astype(np.float64) - x)
    assert np.all(err <= _mxfp4_bound(w.numpy(), scales.numpy()))
    # the data actually exercised saturation, zeros, subnormals and the clamped scale
    y = np.abs(x).reshape(16, 8, 32) / np.exp2(scales.numpy().astype(np.float64) - 127)[..., None]
    assert (y > 6).any()
    assert scales[0, 1] == 0 and scales[1, 0] == 0 and scales[1, 1] == 0
    assert torch.all(deq[0, 32:64] == 0) and torch.all(deq[1, 0:32] == 0)
    assert torch.count_nonzero(deq[1, 32:64]) > 0
    assert torch.all(deq[w == 0] == 0)
    assert 255 not in scales.unique().tolist()
    # unclamped blocks: the largest element lands in [4, 8) after scaling (OCP X = 2**(E - emax))
    unclamped = scales.numpy() > 0
    assert np.all((y.max(-1)[unclamped] >= 4) & (y.max(-1)[unclamped] < 8))


def test_mxfp4_ties_round_to_even() -> None:
    w = torch.zeros(1, 32)
    w[0, :7] = torch.tensor(TIES)
    w[0, 7:14] = -torch.tensor(TIES)
    w[0, 31] = 6.0  # scale 2**0
    packed, scales = F.quantize_mxfp4(w)
    assert scales.item() == 127
    deq = F.dequantize_mxfp4(packed, scales)[0]
    expected = torch.tensor([0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0])
    assert torch.equal(deq[:7], expected) and torch.equal(deq[7:14], -expected)


def test_mxfp4_batched_bf16_and_output_dtype() -> None:
    w = (torch.randn(2, 3, 96, generator=_gen(5)) * 0.05).bfloat16()
    packed, scales = F.quantize_mxfp4(w)
    assert packed.shape == (2, 3, 48) and scales.shape == (2, 3, 3)
    ref_codes, ref_scales, ref_deq = _oracle_mxfp4(w.float().numpy())
    np.testing.assert_array_equal(F.unpack_fp4(packed).numpy(), ref_codes)
    np.testing.assert_array_equal(scales.numpy(), ref_scales)
    deq = F.dequantize_mxfp4(packed, scales, dtype=torch.bfloat16)
    assert deq.dtype == torch.bfloat16
    np.testing.assert_array_equal(deq.float().numpy(), ref_deq.astype(np.float32))


def test_mxfp4_zero_and_nonfinite_blocks() -> None:
    w = torch.zeros(2, 64)
    w[1, :32] = torch.randn(32, generator=_gen(6))
    w[1, 5] = math.nan
    packed, scales = F.quantize_mxfp4(w)
    assert scales.tolist() == [[0, 0], [255, 0]]
    deq = F.dequantize_mxfp4(packed, scales)
    assert torch.equal(deq[0], torch.zeros(64)) and torch.equal(deq[1, 32:], torch.zeros(32))
    assert torch.isnan(deq[1, :32]).all()


def test_mxfp4_bad_k_raises() -> None:
    with pytest.raises(ValueError, match="multiple of 32"):
        F.quantize_mxfp4(torch.randn(4, 48, generator=_gen(7)))
    with pytest.raises(ValueError, match="do not fit"):
        F.dequantize_mxfp4(torch.zeros(4, 16, dtype=torch.uint8), torch.zeros(4, 2, dtype=torch.uint8))
    with pytest.raises(ValueError, match="K % 32"):
        F.dequantize_mxfp4(torch.zeros(4, 8, dtype=torch.uint8), torch.zeros(4, 1, dtype=torch.uint8))


# --------------------------------------------------------------------------- FP8 block


def _fp8_block_input(seed: int, shape: tuple[int, ...]) -> torch.Tensor:
    g = _gen(seed)
    w = torch.randn(*shape, generator=g)
    rows = torch.exp(torch.empty(shape[-2], 1).uniform_(-6, 6, generator=g))  # blocks differ a lot
    return w * rows


@pytest.mark.parametrize("scale_fmt", ["ue8m0", None])
def test_fp8_block_partial_edges(scale_fmt: str | None) -> None:
    w = _fp8_block_input(8, (200, 300))
    w[128:, 256:] = 0.0  # the bottom-right partial block is all zeros
    w_fp8, scale_inv = F.quantize_fp8_block(w, scale_fmt=scale_fmt)
    assert w_fp8.dtype == torch.float8_e4m3fn and w_fp8.shape == (200, 300)
    assert scale_inv.dtype == torch.float32 and scale_inv.shape == (2, 3)
    s = scale_inv.numpy().astype(np.float64)
    assert s[1, 2] == 1.0

    wn = w.numpy().astype(np.float64)
    padded = np.zeros((256, 384))
    padded[:200, :300] = np.abs(wn)
    amax = padded.reshape(2, 128, 3, 128).max(axis=(1, 3))
    nz = amax > 0
    if scale_fmt == "ue8m0":
        log2s = np.log2(s)
        np.testing.assert_array_equal(log2s, np.round(log2s))  # powers of two
        np.testing.assert_array_equal(s[nz], np.exp2(np.ceil(np.log2(amax[nz] / 448.0))))
        assert np.all(amax[nz] / s[nz] <= 448) and np.all(amax[nz] / s[nz] > 224)
    else:
        np.testing.assert_array_equal(scale_inv.numpy()[nz], (amax[nz] / 448.0).astype(np.float32))

    full = _expand(s, (128, 128), (200, 300))
    ref = (wn / full).astype(np.float32).astype(E4M3)  # ml_dtypes: RNE cast
    ours = w_fp8.float().numpy()
    np.testing.assert_array_equal(ours, ref.astype(np.float32))
    assert np.abs(ours).max() <= 448
    deq = F.dequantize_fp8_block(w_fp8, scale_inv)
    assert deq.dtype == torch.float32
    np.testing.assert_array_equal(deq.numpy(), (ref.astype(np.float64) * full).astype(np.float32))
    assert np.all(np.abs(deq.numpy() - wn) <= _fp8_bound(wn, full))
    assert torch.all(deq[128:, 256:] == 0)


def test_fp8_block_batched_custom_block_and_bf16() -> None:
    w = _fp8_block_input(9, (2, 130, 260)).bfloat16()
    w_fp8, scale_inv = F.quantize_fp8_block(w, block=(64, 128))
    assert w_fp8.shape == (2, 130, 260) and scale_inv.shape == (2, 3, 3)
    full = _expand(scale_inv.numpy().astype(np.float64), (64, 128), (130, 260))
    wn = w.float().numpy().astype(np.float64)
    ref = (wn / full).astype(np.float32).astype(E4M3).astype(np.float32)
    np.testing.assert_array_equal(w_fp8.float().numpy(), ref)
    deq = F.dequantize_fp8_block(w_fp8, scale_inv, block=(64, 128), dtype=torch.bfloat16)
    assert deq.dtype == torch.bfloat16
    assert np.all(np.abs(deq.float().numpy() - wn) <= _fp8_bound(wn, full) + np.abs(wn) * 2.0**-8)


def test_fp8_block_torch_cast_agrees() -> None:
    w = _fp8_block_input(10, (128, 256))
    w_fp8, scale_inv = F.quantize_fp8_block(w)
    full = torch.from_numpy(_expand(scale_inv.numpy(), (128, 128), (128, 256)))
    assert torch.equal(w_fp8.view(torch.uint8), (w / full).to(torch.float8_e4m3fn).view(torch.uint8))
    with pytest.raises(ValueError, match="scale_fmt"):
        F.quantize_fp8_block(w, scale_fmt="e4m3")


def test_fp8_block_ue8m0_boundaries() -> None:
    """amax exactly 448 * 2**k keeps scale 2**k (no saturation, no wasted bit); just above doubles it."""
    amax = torch.tensor([448.0, 449.0, 224.0, 56.0, 57.0, 448.0 * 2.0**-130, 1e-45, 3e38])
    w = torch.randn(8, 16, generator=_gen(12)).clamp(-1, 1) * amax[:, None] * 0.5
    w[:, 3] = amax
    _, scale_inv = F.quantize_fp8_block(w, block=(1, 16))
    expected = [1.0, 2.0, 0.5, 2.0**-3, 2.0**-2, 2.0**-127, 2.0**-127, 2.0**120]
    assert scale_inv[:, 0].tolist() == expected


# --------------------------------------------------------------------------- FP8 rowwise


def test_fp8_rowwise() -> None:
    w = _fp8_block_input(11, (37, 300))
    w[5] = 0.0
    w_fp8, scale = F.quantize_fp8_rowwise(w)
    assert w_fp8.dtype == torch.float8_e4m3fn and w_fp8.shape == (37, 300)
    assert scale.dtype == torch.float32 and scale.shape == (37,)
    wn = w.numpy().astype(np.float64)
    amax = np.abs(wn).max(axis=1)
    expected = np.where(amax == 0, 1.0, amax / 448.0).astype(np.float32)
    np.testing.assert_array_equal(scale.numpy(), expected)
    s = scale.numpy().astype(np.float64)[:, None]
    ref = (wn / s).astype(np.float32).astype(E4M3).astype(np.float32)
    np.testing.assert_array_equal(w_fp8.float().numpy(), ref)
    assert np.all(np.abs(w_fp8.float().numpy()).max(axis=1)[amax > 0] == 448)
    deq = F.dequantize_fp8_rowwise(w_fp8, scale)
    assert np.all(np.abs(deq.numpy() - wn) <= _fp8_bound(wn, np.broadcast_to(s, wn.shape)))
    assert torch.all(deq[5] == 0)
    assert F.dequantize_fp8_rowwise(w_fp8, scale, torch.bfloat16).dtype == torch.bfloat16
    with pytest.raises(ValueError, match="row scales"):
        F.dequantize_fp8_rowwise(w_fp8, scale[:-1])


def test_fp8_head_logits_are_its_fp32_sums() -> None:
    """The FP8 head's logits are its fp32 sums times the row scales, stored as fp32 (not rounded to the
    activations' bf16 and widened by a second kernel); its bf16 output is those logits rounded."""
    from solo.quantization.lm_head import DenseHead, build, head_logits

    w = _fp8_block_input(21, (300, 64))
    x = torch.randn((3, 64), generator=_gen(22)).to(torch.bfloat16)
    head = build(torch.nn.Linear(64, 300, bias=False).requires_grad_(False), "fp8")
    head.weight.data, head.scale.data = F.quantize_fp8_rowwise(w)
    logits = head_logits(head, x)
    assert logits.dtype == torch.float32 and logits.shape == (3, 300)
    # oracle: ml_dtypes' E4M3 decoding; the products and sums of bf16 x and the E4M3 values are exact in
    # float64, and the CPU reference rounds the dot product to x's dtype (bf16) before the row scale
    codes = head.weight.data.view(torch.uint8).numpy().view(E4M3).astype(np.float64)
    dots = (x.float().numpy().astype(np.float64) @ codes.T).astype(np.float32)
    dots = torch.from_numpy(dots).to(torch.bfloat16).float().numpy()
    expected = dots * head.scale.data.numpy()[None, :]
    np.testing.assert_array_equal(logits.numpy(), expected)
    assert not torch.equal(logits, logits.to(torch.bfloat16).float())  # fp32 values, not widened bf16
    assert torch.equal(head(x), logits.to(torch.bfloat16))
    seen = []  # the logits go through the module's forward: its hooks see them
    head.register_forward_hook(lambda _m, _i, out: seen.append(out))
    assert torch.equal(head_logits(head, x), logits) and seen[0] is not None and seen[0].dtype == torch.float32
    dense = DenseHead(w.to(torch.bfloat16), "bf16")
    assert torch.equal(head_logits(dense, x), dense(x).float())


# --------------------------------------------------------------------------- validation


def test_check_mxfp4_shapes_messages() -> None:
    name = "model.layers.3.mlp.experts.7.up_proj.weight_scale_inv"
    packed = torch.zeros(32, 32, dtype=torch.uint8)
    F.check_mxfp4_shapes(name, packed, torch.zeros(32, 2, dtype=torch.uint8))
    with pytest.raises(ValueError) as exc:
        F.check_mxfp4_shapes(name, packed, torch.zeros(32, 4, dtype=torch.float32))
    assert str(exc.value) == (
        f"{name}: expected uint8 scales of shape [32, 2] for an MXFP4 weight of shape [32, 64] "
        "(packed [32, 32]), found float32 [32, 4]. The checkpoint's scales do not match its weights; "
        "re-export it with `solo quantize`."
    )
    with pytest.raises(ValueError, match=r"found uint8 \[32, 3\]"):
        F.check_mxfp4_shapes(name, packed, torch.zeros(32, 3, dtype=torch.uint8))
    with pytest.raises(ValueError, match=r"experts\.7.*found bfloat16 \[32, 64\]"):
        F.check_mxfp4_shapes(name, torch.zeros(32, 64, dtype=torch.bfloat16), torch.zeros(32, 2))
    with pytest.raises(ValueError, match=r"multiple of 32, found uint8 \[32, 24\]"):
        F.check_mxfp4_shapes(name, torch.zeros(32, 24, dtype=torch.uint8), torch.zeros(32, 1))


def test_check_fp8_block_shapes_messages() -> None:
    name = "model.layers.0.self_attn.q_proj.weight_scale_inv"
    weight = torch.zeros(200, 300).to(torch.float8_e4m3fn)
    F.check_fp8_block_shapes(name, weight, torch.ones(2, 3), (128, 128))
    with pytest.raises(ValueError) as exc:
        F.check_fp8_block_shapes(name, weight, torch.ones(2, 2), (128, 128))
    msg = str(exc.value)
    assert msg.startswith(name + ": ")
    assert "[2, 3]" in msg and "[200, 300]" in msg and "found float32 [2, 2]" in msg
    assert "solo quantize" in msg
    with pytest.raises(ValueError, match=r"found bfloat16 \[2, 3\]"):
        F.check_fp8_block_shapes(name, weight, torch.ones(2, 3, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match=r"q_proj.*float8_e4m3fn weight.*found bfloat16 \[200, 300\]"):
        F.check_fp8_block_shapes(name, torch.zeros(200, 300, dtype=torch.bfloat16), torch.ones(2, 3))
    with pytest.raises(ValueError, match="do not match"):
        F.dequantize_fp8_block(weight, torch.ones(1, 3))


# --------------------------------------------------------------------------- CUDA parity


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_matches_cpu_bitwise() -> None:
    w = _mx_test_tensor(1e-2, seed=13)
    packed, scales = F.quantize_mxfp4(w)
    packed_c, scales_c = F.quantize_mxfp4(w.cuda())
    assert torch.equal(packed_c.cpu(), packed) and torch.equal(scales_c.cpu(), scales)
    assert torch.equal(F.dequantize_mxfp4(packed_c, scales_c).cpu(), F.dequantize_mxfp4(packed, scales))
    e8 = torch.arange(255, dtype=torch.uint8)
    assert torch.equal(F.e8m0_decode(e8.cuda()).cpu().view(torch.int32), F.e8m0_decode(e8).view(torch.int32))
    x = torch.from_numpy(_encode_inputs(14))
    assert torch.equal(F.e2m1_encode(x.cuda()).cpu(), F.e2m1_encode(x))
    wf = _fp8_block_input(15, (200, 300))
    for scale_fmt in ("ue8m0", None):
        q, s = F.quantize_fp8_block(wf, scale_fmt=scale_fmt)
        q_c, s_c = F.quantize_fp8_block(wf.cuda(), scale_fmt=scale_fmt)
        assert torch.equal(q_c.cpu().view(torch.uint8), q.view(torch.uint8)) and torch.equal(s_c.cpu(), s)
        assert torch.equal(F.dequantize_fp8_block(q_c, s_c).cpu(), F.dequantize_fp8_block(q, s))
    q, s = F.quantize_fp8_rowwise(wf)
    q_c, s_c = F.quantize_fp8_rowwise(wf.cuda())
    assert torch.equal(q_c.cpu().view(torch.uint8), q.view(torch.uint8)) and torch.equal(s_c.cpu(), s)

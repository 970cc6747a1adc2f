"""Reference encoders/decoders for the weight formats of the fp4 checkpoint.

One place per format (see SPEC.md section 2):

* MXFP4 (OCP Microscaling v1.0): E2M1 elements, two per byte (element ``2j`` in the low
  nibble of byte ``j``, as in ``torch.float4_e2m1fn_x2``), one E8M0 scale per 32 elements
  along the last dimension.
* FP8 E4M3 with one scale per 128x128 block (``weight_scale_inv``, DeepSeek style):
  ``w = w_fp8 * scale_inv`` broadcast over each block.
* FP8 E4M3 with one fp32 scale per output row (the online FP8 LM head).

Everything here is vectorised torch code that runs unchanged on CPU and CUDA. These are
reference/offline paths; fused kernels live elsewhere.
"""

import math

import torch

__all__ = [
    "E2M1_VALUES",
    "FP8_E4M3_MAX",
    "MXFP4_BLOCK",
    "check_fp8_block_shapes",
    "check_mxfp4_shapes",
    "dequantize_fp8_block",
    "dequantize_fp8_rowwise",
    "dequantize_mxfp4",
    "e2m1_decode",
    "e2m1_encode",
    "e8m0_decode",
    "pack_fp4",
    "quantize_fp8_block",
    "quantize_fp8_rowwise",
    "quantize_mxfp4",
    "unpack_fp4",
]

MXFP4_BLOCK = 32
"""Elements sharing one E8M0 scale (along the last dimension)."""

E2M1_EMAX = 2
"""Exponent of the largest normal E2M1 value (6 = 1.5 * 2**2)."""

E8M0_BIAS = 127
E8M0_NAN = 255

FP8_E4M3_MAX = 448.0
"""Largest finite float8_e4m3fn value."""

E2M1_VALUES = torch.tensor(
    [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0],
    dtype=torch.float32,
)
"""The 16 E2M1 code values: bit 3 sign, bits 2..1 exponent (bias 1), bit 0 mantissa."""

# Decision thresholds on |x| for codes 1..7. Ties go to the even code (mantissa bit 0):
# an odd code needs |x| strictly above its lower midpoint, an even code needs |x| >= it.
_E2M1_THRESHOLDS = (
    (0.25, False),
    (0.75, True),
    (1.25, False),
    (1.75, True),
    (2.5, False),
    (3.5, True),
    (5.0, False),
)

_REEXPORT_HINT = "The checkpoint's scales do not match its weights; re-export it with `solo quantize`."


# --------------------------------------------------------------------------- helpers


def _pow2(exponent: torch.Tensor) -> torch.Tensor:
    """Exact float32 2**e for int tensors with e in [-149, 127], built from the bit pattern."""
    e = exponent.to(torch.int32)
    normal = (e + 127).clamp(min=1) << 23
    subnormal = torch.ones_like(e) << (e + 149).clamp(0, 22)
    return torch.where(e >= -126, normal, subnormal).view(torch.float32)


def _fmt_shape(shape: tuple[int, ...] | torch.Size) -> str:
    return "[" + ", ".join(str(int(d)) for d in shape) + "]"


def _fmt_dtype(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _as_bytes(t: torch.Tensor, what: str, allowed: tuple[torch.dtype, ...]) -> torch.Tensor:
    """View a byte-sized tensor (uint8 or an equivalent 1-byte dtype) as uint8."""
    if t.dtype not in allowed:
        names = " or ".join(_fmt_dtype(d) for d in allowed)
        raise ValueError(f"{what} must be {names}, got {_fmt_dtype(t.dtype)} {_fmt_shape(t.shape)}")
    return t if t.dtype == torch.uint8 else t.view(torch.uint8)


def _packed_dtypes() -> tuple[torch.dtype, ...]:
    fp4x2 = getattr(torch, "float4_e2m1fn_x2", None)
    return (torch.uint8,) if fp4x2 is None else (torch.uint8, fp4x2)


def _scale_dtypes() -> tuple[torch.dtype, ...]:
    e8m0 = getattr(torch, "float8_e8m0fnu", None)
    return (torch.uint8,) if e8m0 is None else (torch.uint8, e8m0)


# --------------------------------------------------------------------------- E2M1 / E8M0


def e2m1_encode(x: torch.Tensor) -> torch.Tensor:
    """Round to the nearest E2M1 value (ties to even), saturating at +-6; returns uint8 codes.

    The sign bit follows ``signbit(x)``, so -0.0 and small negatives give code 8 (-0).
    NaN has no E2M1 encoding and becomes +-0.
    """
    mag = x.abs()
    codes = torch.zeros(x.shape, dtype=torch.uint8, device=x.device)
    for threshold, inclusive in _E2M1_THRESHOLDS:  # 7 vectorised comparisons, not per element
        codes += (mag >= threshold) if inclusive else (mag > threshold)
    return codes | (torch.signbit(x).to(torch.uint8) << 3)


def e2m1_decode(codes: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Map E2M1 codes (low 4 bits of each uint8) to their values."""
    table = E2M1_VALUES.to(device=codes.device, dtype=dtype)
    return table[(codes & 0x0F).long()]


def e8m0_decode(scales: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Decode E8M0 bytes: 2**(s - 127); 0 -> 2**-127 (a float32 subnormal), 255 -> NaN."""
    s = _as_bytes(scales, "E8M0 scales", _scale_dtypes()).to(torch.int32)
    value = _pow2(s - E8M0_BIAS)
    value = torch.where(s == E8M0_NAN, torch.full_like(value, math.nan), value)
    return value.to(dtype)


# --------------------------------------------------------------------------- packing


def pack_fp4(codes: torch.Tensor) -> torch.Tensor:
    """Pack 4-bit codes [..., K] into bytes [..., K//2]: element 2j low nibble, 2j+1 high."""
    if codes.dtype != torch.uint8:
        raise ValueError(f"pack_fp4 expects uint8 codes, got {_fmt_dtype(codes.dtype)}")
    if codes.ndim == 0 or codes.shape[-1] % 2:
        raise ValueError(f"pack_fp4 needs an even last dimension, got shape {_fmt_shape(codes.shape)}")
    return (codes[..., 0::2] & 0x0F) | ((codes[..., 1::2] & 0x0F) << 4)


def unpack_fp4(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`pack_fp4`: bytes [..., K//2] -> uint8 codes [..., K]."""
    p = _as_bytes(packed, "packed FP4", _packed_dtypes())
    if p.ndim == 0:
        raise ValueError("unpack_fp4 needs at least one dimension")
    return torch.stack((p & 0x0F, p >> 4), dim=-1).reshape(*p.shape[:-1], p.shape[-1] * 2)


# --------------------------------------------------------------------------- MXFP4


def _mxfp4_scale_bytes(amax: torch.Tensor) -> torch.Tensor:
    """E8M0 byte per block: floor(log2(amax)) - emax(E2M1), clamped to [-127, 127], biased.

    All-zero blocks get byte 0 (they decode to exact zeros); non-finite blocks get 255 (NaN).
    """
    _, exp = torch.frexp(amax)  # amax = m * 2**exp with m in [0.5, 1) -> floor(log2) = exp - 1
    shared = (exp.to(torch.int32) - 1 - E2M1_EMAX).clamp(-E8M0_BIAS, E8M0_BIAS) + E8M0_BIAS
    shared = torch.where(amax == 0, torch.zeros_like(shared), shared)
    shared = torch.where(torch.isfinite(amax), shared, torch.full_like(shared, E8M0_NAN))
    return shared.to(torch.uint8)


def quantize_mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize w [..., K] to MXFP4: packed uint8 [..., K//2] and E8M0 scales uint8 [..., K//32].

    Per OCP MX v1.0: each block of 32 consecutive elements along the last dimension shares
    the scale 2**(floor(log2(amax)) - 2); elements are divided by it and rounded to the
    nearest E2M1 value (ties to even), saturating at +-6. Computation is in float32.
    """
    if w.ndim == 0 or w.shape[-1] % MXFP4_BLOCK:
        raise ValueError(
            f"MXFP4 needs the last dimension to be a multiple of {MXFP4_BLOCK}, got shape {_fmt_shape(w.shape)}"
        )
    if not w.is_floating_point():
        raise ValueError(f"quantize_mxfp4 expects a floating-point tensor, got {_fmt_dtype(w.dtype)}")
    k = w.shape[-1]
    blocks = w.to(torch.float32).reshape(*w.shape[:-1], k // MXFP4_BLOCK, MXFP4_BLOCK)
    scales = _mxfp4_scale_bytes(blocks.abs().amax(dim=-1))
    # Multiply by 2**(127 - s) (always a normal float32) rather than divide by a subnormal.
    inv = _pow2(E8M0_BIAS - scales.to(torch.int32).clamp(max=254))
    inv = torch.where(scales == E8M0_NAN, torch.full_like(inv, math.nan), inv)
    codes = e2m1_encode(blocks * inv.unsqueeze(-1)).reshape(w.shape)
    return pack_fp4(codes), scales


def _e2m1_pair_table(device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """[256, 2] table: byte -> (value of low nibble, value of high nibble)."""
    byte = torch.arange(256, dtype=torch.uint8, device=device)
    return e2m1_decode(torch.stack((byte & 0x0F, byte >> 4), dim=-1), dtype)


def dequantize_mxfp4(packed: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Decode MXFP4: packed [..., K//2] with E8M0 scales [..., K//32] -> values [..., K]."""
    p = _as_bytes(packed, "packed MXFP4 weight", _packed_dtypes())
    s = _as_bytes(scales, "MXFP4 scales", _scale_dtypes())
    if p.ndim == 0 or (2 * p.shape[-1]) % MXFP4_BLOCK:
        raise ValueError(f"packed MXFP4 weight must be [..., K/2] with K % 32 == 0, got {_fmt_shape(p.shape)}")
    k = 2 * p.shape[-1]
    if s.shape != (*p.shape[:-1], k // MXFP4_BLOCK):
        raise ValueError(
            f"MXFP4 scales {_fmt_shape(s.shape)} do not fit packed weight {_fmt_shape(p.shape)} "
            f"(expected {_fmt_shape((*p.shape[:-1], k // MXFP4_BLOCK))})"
        )
    values = _e2m1_pair_table(p.device, torch.float32)[p.long()]  # [..., K//2, 2]
    values = values.reshape(*p.shape[:-1], k // MXFP4_BLOCK, MXFP4_BLOCK)
    values = values * e8m0_decode(s, torch.float32).unsqueeze(-1)
    return values.reshape(*p.shape[:-1], k).to(dtype)


# --------------------------------------------------------------------------- FP8 E4M3


def _fp8_cast(scaled: torch.Tensor) -> torch.Tensor:
    return scaled.clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn)


def _check_block(block: tuple[int, int]) -> tuple[int, int]:
    if len(block) != 2 or min(block) < 1:
        raise ValueError(f"block must be two positive ints, got {block!r}")
    return int(block[0]), int(block[1])


def _fp8_scale(amax: torch.Tensor, scale_fmt: str | None) -> torch.Tensor:
    """scale_inv for a given amax: ue8m0 -> 2**ceil(log2(amax/448)), None -> amax/448."""
    if scale_fmt == "ue8m0":
        # Smallest e with 448 * 2**e >= amax, exactly: amax = m * 2**p, 448 = 0.875 * 2**9.
        mant, exp = torch.frexp(amax)
        e = exp.to(torch.int32) - 9 + (mant > 0.875).to(torch.int32)
        scale = _pow2(e.clamp(-E8M0_BIAS, E8M0_BIAS))
    elif scale_fmt is None:
        # Divide by a tensor: CUDA turns division by a Python scalar into a multiply by its
        # reciprocal, which is not correctly rounded and would differ from the CPU result.
        scale = (amax / torch.full_like(amax, FP8_E4M3_MAX)).clamp(min=torch.finfo(torch.float32).tiny)
    else:
        raise ValueError(f"unknown scale_fmt {scale_fmt!r} (expected 'ue8m0' or None)")
    return torch.where(amax == 0, torch.ones_like(scale), scale)


def quantize_fp8_block(
    w: torch.Tensor, block: tuple[int, int] = (128, 128), scale_fmt: str | None = "ue8m0"
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize w [..., N, K] to FP8 E4M3 with one scale per block (partial edge blocks allowed).

    Returns (w_fp8 float8_e4m3fn [..., N, K], scale_inv float32 [..., ceil(N/bn), ceil(K/bk)])
    with w ~= w_fp8 * scale_inv. ``scale_fmt="ue8m0"`` rounds the scale up to a power of two
    (nothing saturates); ``None`` uses amax/448. All-zero blocks get scale_inv 1.
    """
    bn, bk = _check_block(block)
    if w.ndim < 2:
        raise ValueError(f"quantize_fp8_block expects [..., N, K], got shape {_fmt_shape(w.shape)}")
    n, k = w.shape[-2:]
    nb, kb = -(-n // bn), -(-k // bk)
    x = w.to(torch.float32)
    padded = torch.nn.functional.pad(x, (0, kb * bk - k, 0, nb * bn - n))
    tiles = padded.reshape(*w.shape[:-2], nb, bn, kb, bk)
    scale_inv = _fp8_scale(tiles.abs().amax(dim=(-3, -1)), scale_fmt)
    w_fp8 = _fp8_cast(x / _expand_blocks(scale_inv, (bn, bk), (n, k)))
    return w_fp8, scale_inv


def _expand_blocks(scale: torch.Tensor, block: tuple[int, int], shape: tuple[int, int]) -> torch.Tensor:
    """Broadcast per-block scales [..., nb, kb] to elements [..., N, K]."""
    bn, bk = block
    n, k = shape
    full = scale.repeat_interleave(bn, dim=-2)[..., :n, :]
    return full.repeat_interleave(bk, dim=-1)[..., :k]


def dequantize_fp8_block(
    w_fp8: torch.Tensor,
    scale_inv: torch.Tensor,
    block: tuple[int, int] = (128, 128),
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Decode a block-scaled FP8 weight: w_fp8 [..., N, K] * scale_inv broadcast per block."""
    bn, bk = _check_block(block)
    check_fp8_block_shapes("weight", w_fp8, scale_inv, (bn, bk), scale_dtypes=None)
    n, k = w_fp8.shape[-2:]
    full = _expand_blocks(scale_inv.to(torch.float32), (bn, bk), (n, k))
    return (w_fp8.to(torch.float32) * full).to(dtype)


def quantize_fp8_rowwise(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize w [..., N, K] to FP8 E4M3 with one fp32 scale per row: scale = amax_row / 448.

    Returns (w_fp8 [..., N, K], scale float32 [..., N]); zero rows get scale 1.
    """
    if w.ndim < 1:
        raise ValueError("quantize_fp8_rowwise expects at least one dimension")
    x = w.to(torch.float32)
    scale = _fp8_scale(x.abs().amax(dim=-1), None)
    return _fp8_cast(x / scale.unsqueeze(-1)), scale


def dequantize_fp8_rowwise(
    w_fp8: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """Decode a row-scaled FP8 weight: w_fp8 [..., N, K] * scale[..., N, None]."""
    if scale.shape != w_fp8.shape[:-1]:
        raise ValueError(
            f"row scales {_fmt_shape(scale.shape)} do not fit FP8 weight {_fmt_shape(w_fp8.shape)} "
            f"(expected {_fmt_shape(w_fp8.shape[:-1])})"
        )
    return (w_fp8.to(torch.float32) * scale.to(torch.float32).unsqueeze(-1)).to(dtype)


# --------------------------------------------------------------------------- validation


def check_mxfp4_shapes(name: str, packed: torch.Tensor, scales: torch.Tensor) -> None:
    """Raise ValueError (naming ``name``) unless packed/scales form a valid MXFP4 pair.

    ``packed`` must be uint8 [..., K//2] with K a multiple of 32, ``scales`` uint8 [..., K//32].
    """
    found = f"found {_fmt_dtype(scales.dtype)} {_fmt_shape(scales.shape)}"
    if packed.dtype not in _packed_dtypes() or packed.ndim < 1 or (2 * packed.shape[-1]) % MXFP4_BLOCK:
        raise ValueError(
            f"{name}: expected a uint8 packed MXFP4 weight [..., K/2] with K a multiple of "
            f"{MXFP4_BLOCK}, found {_fmt_dtype(packed.dtype)} {_fmt_shape(packed.shape)}. "
            "The checkpoint's weights are not MXFP4; re-export it with `solo quantize`."
        )
    k = 2 * packed.shape[-1]
    logical = (*packed.shape[:-1], k)
    expected = (*packed.shape[:-1], k // MXFP4_BLOCK)
    if scales.dtype not in _scale_dtypes() or tuple(scales.shape) != expected:
        raise ValueError(
            f"{name}: expected uint8 scales of shape {_fmt_shape(expected)} for an MXFP4 weight of "
            f"shape {_fmt_shape(logical)} (packed {_fmt_shape(packed.shape)}), {found}. {_REEXPORT_HINT}"
        )


def check_fp8_block_shapes(
    name: str,
    weight: torch.Tensor,
    scale_inv: torch.Tensor,
    block: tuple[int, int] = (128, 128),
    *,
    scale_dtypes: tuple[torch.dtype, ...] | None = (torch.float32,),
) -> None:
    """Raise ValueError (naming ``name``) unless weight/scale_inv form a block-scaled FP8 pair.

    ``weight`` must be float8_e4m3fn [..., N, K]; ``scale_inv`` [..., ceil(N/bn), ceil(K/bk)]
    of one of ``scale_dtypes`` (None: any floating dtype).
    """
    bn, bk = _check_block(block)
    if weight.dtype != torch.float8_e4m3fn or weight.ndim < 2:
        raise ValueError(
            f"{name}: expected a float8_e4m3fn weight [..., N, K], found {_fmt_dtype(weight.dtype)} "
            f"{_fmt_shape(weight.shape)}. The checkpoint's weights are not block-scaled FP8; "
            "re-export it with `solo quantize`."
        )
    n, k = weight.shape[-2:]
    expected = (*weight.shape[:-2], -(-n // bn), -(-k // bk))
    dtype_ok = scale_inv.is_floating_point() if scale_dtypes is None else scale_inv.dtype in scale_dtypes
    if not dtype_ok or tuple(scale_inv.shape) != expected:
        want = "floating-point" if scale_dtypes is None else " or ".join(map(_fmt_dtype, scale_dtypes))
        raise ValueError(
            f"{name}: expected {want} scales of shape {_fmt_shape(expected)} for an FP8 weight of shape "
            f"{_fmt_shape(weight.shape)} with {bn}x{bk} blocks, found {_fmt_dtype(scale_inv.dtype)} "
            f"{_fmt_shape(scale_inv.shape)}. {_REEXPORT_HINT}"
        )

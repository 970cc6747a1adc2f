"""RMSNorm outputs compared as the reference rounds them, up to the last bits of 1 / rms.

A kernel that normalises as `solo.model.layers.RMSNorm` does (fp32 1 / rms, x * (1 / rms) rounded to the
activation dtype, times the weight, rounded again) but adds its sum of squares in another order can end
one or a few fp32 ulps away in 1 / rms. For bf16 inputs that can move many values at once: x has 8
significant bits, so where 1 / rms sits close to a number of few significant bits, many products x / rms
sit on a rounding tie together, and one ulp decides all of them (up to 33 of 2,560 values in 3,000 draws
on the CPU; the same on the GPU between torch's own norm and the CPU's,
docs/results/h100_norm_rounding_probe.log). Allowing "at most two values a step apart" therefore fails
now and then on a correct kernel, and passes a wrong one that moves two values. The check here is exact
instead: the output must equal the reference's rounding at some 1 / rms within a few ulps of the
reference's own, row by row.
"""

from __future__ import annotations

import torch

RMS_ULPS = 32  # how far (fp32 ulps) a reordered sum of squares may move 1 / rms: a few at 2,560 values


def reference_rstd(x: torch.Tensor, eps: float) -> torch.Tensor:
    """The reference's fp32 1 / rms of each row of x [T, n], as [T, 1]."""
    return torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + eps)


def steps_apart(got: torch.Tensor, want: torch.Tensor) -> tuple[int, float]:
    """How many values of `got` differ from `want`, and the largest difference in bf16 steps of `want`'s values."""
    step = want.float().abs().clamp_min(1e-30) * 2.0**-7
    diff = (got.float() - want.float()).abs()
    return int((diff > 0).sum()), float((diff / step).max())


def rmsnorm_rounded(x: torch.Tensor, weight: torch.Tensor, rstd: torch.Tensor) -> torch.Tensor:
    """RMSNorm's output for x [T, n] at the given 1 / rms [T, 1], rounded as the reference rounds it."""
    return weight * (x.float() * rstd).to(x.dtype)


def rms_offset(
    got: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, eps: float, ulps: int = RMS_ULPS
) -> list[int | None]:
    """For each row of x [T, n]: the offset (in fp32 ulps, nearest first) of a 1 / rms at which the reference's
    rounding gives that row of `got` exactly, or None where no offset within `ulps` does."""
    rstd = reference_rstd(x, eps)
    up, down = rstd.clone(), rstd.clone()
    candidates = {0: rstd}
    for j in range(1, ulps + 1):
        up = torch.nextafter(up, torch.full_like(up, float("inf")))
        down = torch.nextafter(down, torch.zeros_like(down))
        candidates[j], candidates[-j] = up, down
    order = sorted(candidates, key=lambda j: (abs(j), j))
    offsets: list[int | None] = []
    for row in range(x.shape[0]):
        found = None
        for j in order:
            want = rmsnorm_rounded(x[row : row + 1], weight, candidates[j][row : row + 1])
            if torch.equal(got[row : row + 1].to(want.dtype), want):
                found = j
                break
        offsets.append(found)
    return offsets


def assert_rmsnorm_rounding(
    got: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, eps: float, ulps: int = RMS_ULPS
) -> None:
    """`got` [T, n] (on the CPU) is RMSNorm(x) with `weight`, rounded as the reference rounds it, at a 1 / rms
    within `ulps` fp32 ulps of the reference's for every row."""
    got = got.reshape(x.shape)
    offsets = rms_offset(got, x, weight, eps, ulps)
    if all(j is not None for j in offsets):
        return
    count, largest = steps_apart(got, rmsnorm_rounded(x, weight, reference_rstd(x, eps)))
    rows = [r for r, j in enumerate(offsets) if j is None]
    raise AssertionError(
        f"RMSNorm rows {rows} match the reference's rounding at no 1 / rms within {ulps} ulps: "
        f"{count} values differ from it, the largest by {largest:.2f} bf16 steps"
    )

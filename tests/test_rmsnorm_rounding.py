"""solo.testing.rounding: the exact RMSNorm check the GPU tests use, on the CPU against the reference module."""

from __future__ import annotations

import pytest
import torch

from solo.model.layers import RMSNorm
from solo.testing.rounding import RMS_ULPS, assert_rmsnorm_rounding, reference_rstd, rms_offset, rmsnorm_rounded

H = 2560


def draw(tokens: int = 1) -> tuple[torch.Tensor, RMSNorm]:
    x = (3 * torch.randn(tokens, H)).to(torch.bfloat16)
    norm = RMSNorm(H, 1e-6)
    norm.weight.data = (1 + 0.1 * torch.randn(H)).to(torch.bfloat16)
    return x, norm


def test_the_reference_itself_is_at_offset_zero():
    x, norm = draw(3)
    assert rmsnorm_rounded(x, norm.weight.data, reference_rstd(x, 1e-6)).equal(norm(x))
    assert rms_offset(norm(x), x, norm.weight.data, 1e-6) == [0, 0, 0]
    assert_rmsnorm_rounding(norm(x), x, norm.weight.data, 1e-6)


def test_a_1_over_rms_some_ulps_away_passes_even_where_many_values_move():
    """Draws until one ulp of 1 / rms moves more than two values (about 1 draw in 300 at these shapes): the old
    "at most two values differ" rule fails there, this check finds the offset."""
    for _ in range(3000):
        x, norm = draw()
        rstd = reference_rstd(x, 1e-6)
        moved = torch.nextafter(torch.nextafter(rstd, rstd * 2), rstd * 2)  # two ulps up
        got = rmsnorm_rounded(x, norm.weight.data, moved)
        if int((got != norm(x)).sum()) > 2:
            break
    else:
        pytest.fail("no draw moved more than two values")
    assert rms_offset(got, x, norm.weight.data, 1e-6) in ([1], [2])  # (the nearest offset that gives these values)
    assert_rmsnorm_rounding(got, x, norm.weight.data, 1e-6)


def test_a_wrong_value_fails_and_the_message_says_how_far():
    """Two bf16 steps on one value: a few ulps of 1 / rms (a few parts in 10^7) move a value by one rounding at most."""
    x, norm = draw(2)
    got = norm(x).clone()
    got.view(torch.int16)[1, int(torch.randint(H, ()))] += 2
    message = rf"rows \[1\] match .* no 1 / rms within {RMS_ULPS} ulps: 1 values differ"
    with pytest.raises(AssertionError, match=message):
        assert_rmsnorm_rounding(got, x, norm.weight.data, 1e-6)


def test_a_1_over_rms_far_off_fails():
    x, norm = draw()
    got = rmsnorm_rounded(x, norm.weight.data, reference_rstd(x, 1e-6) * (1 + 1e-3))
    with pytest.raises(AssertionError, match="values differ"):
        assert_rmsnorm_rounding(got, x, norm.weight.data, 1e-6)

"""The decode bench's profile summary: each kernel's share of the critical path (CPU, synthetic events).

Under programmatic dependent launch a kernel starts while its predecessor runs and waits on the GPU,
so own durations overlap; the critical-path shares must still split the replay's span exactly."""

from __future__ import annotations

import random

import pytest

from solo.bench.decode import critical_path, summarize_kernels


def test_plain_launches_add_their_durations_and_gaps() -> None:
    kernels = [("gemv_decode", 0.0, 10.0), ("_kda_decode", 12.0, 15.0), ("router_decode", 15.5, 20.0)]
    assert critical_path(kernels) == pytest.approx([10.0, 5.0, 5.0])  # gaps count as the next kernel's


def test_overlapping_kernels_add_only_what_passes_the_frontier() -> None:
    # B starts during A (PDL) and ends after it; C starts and ends inside B: it adds nothing
    kernels = [("gemv_decode", 0.0, 10.0), ("moe_decode", 2.0, 14.0), ("gemv_decode", 3.0, 13.0)]
    assert critical_path(kernels) == pytest.approx([10.0, 4.0, 0.0])


def test_shares_sum_to_the_span_on_random_timelines() -> None:
    rng = random.Random()
    names = ["gemv_decode", "_kda_decode", "router_decode", "moe_decode", "_mla_attend", "rmsnorm"]
    for _ in range(20):
        kernels, t = [], rng.uniform(0, 5)
        for _ in range(rng.randint(1, 60)):
            start = t + rng.uniform(-3.0, 2.0)
            kernels.append((rng.choice(names), start, start + rng.uniform(0.5, 20.0)))
            t = start + rng.uniform(0.0, 8.0)
        kernels.sort(key=lambda k: k[1])
        added = critical_path(kernels)
        assert all(a >= 0 for a in added)
        span = max(k[2] for k in kernels) - kernels[0][1]
        assert sum(added) == pytest.approx(span)
        summary = summarize_kernels(kernels)
        assert summary["kernels"] == len(kernels)
        components = summary["by_component"].values()
        rounding = 0.05 * len(components) + 1e-9  # each component's share is rounded to 0.1 us
        assert sum(c["critical_us"] for c in components) == pytest.approx(span, abs=rounding)
        assert sum(c["kernels"] for c in components) == len(kernels)
        assert [row[2] for row in summary["timeline"]] == pytest.approx([round(a, 2) for a in added])


def test_components_are_named_from_kernel_names() -> None:
    summary = summarize_kernels([("moe_decode", 0.0, 12.0), ("router_decode", 1.0, 9.0), ("gemv_decode", 9.0, 20.0)])
    assert set(summary["by_component"]) == {"experts", "router", "projections"}
    assert summary["by_component"]["projections"]["critical_us"] == pytest.approx(8.0)
    assert summary["span_us"] == pytest.approx(20.0)

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
    # the fused KDA front apart from KDA; the sampling kernels of solo.kernels.topk and .greedy as sampling
    names = [("kda_front", 0.0, 3.0), ("fused_kda_recurrent", 3.0, 4.0), ("_top_k_kernel", 4.0, 5.0)]
    summary = summarize_kernels([*names, ("_greedy_kernel", 5.0, 6.0)])
    assert set(summary["by_component"]) == {"kda front", "kda", "sampling"}
    assert summary["by_component"]["sampling"]["kernels"] == 2


def test_the_report_lists_each_graphs_profile_by_critical_share() -> None:
    """The markdown report gives the decode step, the verification and the NEXTN round by component,
    largest critical share first; a configuration without a round (no NEXTN layer) has no round line,
    and a profile no configuration has (here the sampled round) no section."""
    from solo.bench.decode import markdown

    rng = random.Random()
    scale = rng.uniform(1.0, 3.0)

    def profile(names):
        kernels, t = [], 0.0
        for name in names:
            kernels.append((name, t, t + scale * rng.uniform(1.0, 9.0)))
            t = kernels[-1][2]
        return summarize_kernels(kernels)

    entry = {"decode_ms": 2.4, "roofline_ms": 1.0, "roofline_fraction": 0.42, "verify_ms": 4.9}
    with_round = dict(entry, profile=profile(["gemv_decode", "moe_decode"]))
    with_round["profile_verify"] = profile(["gemv_decode", "router_decode", "_gemv_gate_up_act"])
    with_round["profile_round"] = profile(["gemv_decode", "router_decode", "argmax_kernel", "_kda_decode"])
    without = dict(entry, profile=profile(["gemv_decode"]), profile_verify=profile(["gemv_decode"]))
    results = [
        {"config": "a", "decode_step": "fused", "contexts": {"4096": with_round}},
        {"config": "b", "decode_step": "fused", "contexts": {"4096": without}},
    ]
    text = markdown(results)
    sections = text.split("by component")
    assert len(sections) == 4  # the table, then decode, verification, round
    assert "Verification" in sections[1] and "NEXTN round (greedy)" in sections[2]
    assert "sampled" not in sections[3]
    round_lines = [line for line in sections[3].splitlines() if line.startswith("- ")]
    assert len(round_lines) == 1 and round_lines[0].startswith("- a @ 4096: 4 kernels; ")
    shares = with_round["profile_round"]["by_component"]
    order = sorted(shares, key=lambda k: -shares[k]["critical_us"])
    listed = [part.split(" ")[0] for part in round_lines[0].split("kernels; ")[1].split(", ")]
    assert listed == order


def test_component_bandwidth_divides_each_components_bytes_by_its_critical_share() -> None:
    """Bytes over critical-path time per component, against the copy bandwidth; the routers' bytes go to
    the experts when no router kernel ran (the router inside the MoE kernel), else to the router; the KDA
    layers' input projections to the projections, or to the KDA front where it ran as one launch."""
    from solo.bench.decode import component_bandwidth

    rng = random.Random()
    traffic = {
        k: rng.randint(10**6, 10**9)
        for k in (
            "dense_weights",
            "kda_inputs",
            "lm_head",
            "experts",
            "routers",
            "kda_states",
            "mla_cache",
            "embedding",
        )
    }
    copy_gbs = rng.uniform(3000.0, 4500.0)
    us = {k: rng.uniform(10.0, 2000.0) for k in ("projections", "experts", "kda", "mla", "router", "norms")}
    inside = {k: {"critical_us": v} for k, v in us.items() if k != "router"}
    got = component_bandwidth(traffic, inside, copy_gbs)
    assert set(got) == {"projections", "experts", "kda", "mla"}  # norms: no bytes counted for them
    projections = traffic["dense_weights"] + traffic["lm_head"] + traffic["kda_inputs"]
    assert got["projections"]["bytes"] == projections
    assert got["kda"]["bytes"] == traffic["kda_states"]
    assert got["projections"]["gbs"] == pytest.approx(projections / us["projections"] / 1e3, abs=0.05)
    assert got["experts"]["bytes"] == traffic["experts"] + traffic["routers"]
    assert got["mla"]["of_copy"] == pytest.approx(traffic["mla_cache"] / us["mla"] / 1e3 / copy_gbs, abs=1e-4)
    apart = component_bandwidth(traffic, {k: {"critical_us": v} for k, v in us.items()}, copy_gbs)
    assert apart["experts"]["bytes"] == traffic["experts"]
    assert apart["router"]["bytes"] == traffic["routers"]
    assert "kda" not in component_bandwidth(traffic, {"kda": {"critical_us": 0.0}}, copy_gbs)
    front = {**inside, "kda front": inside.pop("kda")}
    fused = component_bandwidth(traffic, front, copy_gbs)
    assert set(fused) == {"projections", "experts", "kda front", "mla"}
    assert fused["kda front"]["bytes"] == traffic["kda_inputs"] + traffic["kda_states"]
    assert fused["projections"]["bytes"] == traffic["dense_weights"] + traffic["lm_head"]
    assert fused["kda front"]["gbs"] == pytest.approx(
        fused["kda front"]["bytes"] / front["kda front"]["critical_us"] / 1e3, abs=0.05
    )


def test_the_report_gives_each_components_bandwidth() -> None:
    from solo.bench.decode import component_bandwidth, markdown

    traffic = {"dense_weights": 3_000_000_000, "lm_head": 400_000_000, "experts": 1_000_000_000, "routers": 100}
    shares = {"projections": {"critical_us": 1360.0}, "experts": {"critical_us": 770.0}}
    entry = {"decode_ms": 2.4, "roofline_ms": 1.1, "roofline_fraction": 0.46, "verify_ms": 4.4}
    entry["profile"] = summarize_kernels([("gemv_decode", 0.0, 5.0)])
    entry["component_bandwidth"] = component_bandwidth(traffic, shares, 4200.0)
    text = markdown([{"config": "c", "decode_step": "fused", "contexts": {"32768": entry}}])
    line = next(li for li in text.splitlines() if li.startswith("- c @ 32768: projections"))
    assert "projections 3.40 GB in 1360 us = 2500 GB/s (60%)" in line
    assert line.index("projections") < line.index("experts")  # largest critical share first


def test_the_report_gives_prefill_times_and_the_real_loop_against_the_graph() -> None:
    """Prefill seconds and prompt tokens a second per length, and the engine loop's TPOT against the decode
    step's graph, as lines of the markdown (before, only in the JSON)."""
    from solo.bench.decode import markdown

    rng = random.Random()
    seconds = {str(n): rng.uniform(0.5, 40.0) for n in (1024, 8192, 32768)}
    tpot, graph = rng.uniform(2.0, 3.0), rng.uniform(2.0, 3.0)
    loop = {"prompt_tokens": 64, "tokens": 128, "tpot_ms": tpot, "graph_step_ms": graph}
    loop["loop_over_graph"] = tpot / graph
    entry = {"decode_ms": 2.4, "roofline_ms": 1.1, "roofline_fraction": 0.46, "verify_ms": 4.4}
    entry["profile"] = summarize_kernels([("gemv_decode", 0.0, 5.0)])
    result = {"config": "c", "decode_step": "fused", "contexts": {"4096": entry}, "prefill_s": seconds, "loop": loop}
    text = markdown([result, {"config": "d", "error": "no GPU"}])
    prefill = next(li for li in text.splitlines() if li.startswith("- c: 1,024 tokens"))
    for n, s in seconds.items():
        assert f"{int(n):,} tokens {s:.2f} s ({int(n) / s:,.0f} tok/s)" in prefill
    looped = next(li for li in text.splitlines() if li.startswith("- c: 128 tokens after a 64-token prompt"))
    assert f"TPOT {tpot:.3f} ms against {graph:.3f} ms ({tpot / graph:.3f}x)" in looped
    assert "Prefill" not in markdown([dict(result, prefill_s={}, loop=None)])

"""Tests for the GSM8K protocol (solo.bench.gsm8k) and the serving metrics (solo.bench.metrics)."""

from __future__ import annotations

import random

import pytest

from solo.bench.gsm8k import (
    STOP_SEQUENCES,
    Example,
    accuracy,
    binom_two_sided_half,
    build_fewshot_prompt,
    build_prompts,
    extract_flexible,
    extract_strict,
    fewshot_indices,
    grade,
    is_correct,
    load_split,
    mcnemar,
    normalize_number,
    select_shots,
    target_from_answer,
    truncate_at_stop,
)
from solo.bench.metrics import RequestRecord, percentile, summarize


@pytest.fixture(scope="module")
def train() -> list[Example]:
    """GSM8K train split (the copy shipped in the package)."""
    return load_split("train")


@pytest.fixture(scope="module")
def test_set() -> list[Example]:
    """GSM8K test split."""
    return load_split("test")


# ---------------------------------------------------------------- loading and prompts


def test_load(train: list[Example], test_set: list[Example]) -> None:
    assert len(train) == 7473 and len(test_set) == 1319
    first = train[0]
    assert first.question.startswith("Natalia sold clips")
    assert first.answer.endswith("#### 72")
    assert first.target == "72"
    assert all(ex.target and "," not in ex.target for ex in train + test_set)


def test_target_from_answer() -> None:
    assert target_from_answer("blah\n#### 1,000") == "1000"
    assert target_from_answer("x #### -7") == "-7"
    with pytest.raises(ValueError):
        target_from_answer("no marker")


def test_prompt_format_matches_lm_eval(train: list[Example], test_set: list[Example]) -> None:
    raw_train = [{"question": ex.question, "answer": ex.answer} for ex in train]  # as stored in the file
    rnd = random.Random(1234)  # one generator, one draw of 5 per test question, in order
    for i in range(20):
        shots = rnd.sample(raw_train, 5)
        expected = "".join(f"Question: {s['question']}\nAnswer: {s['answer']}\n\n" for s in shots)
        expected += f"Question: {test_set[i].question}\nAnswer:"
        assert build_fewshot_prompt(test_set[i].question, train, index=i) == expected


def test_prompt_structure(train: list[Example], test_set: list[Example]) -> None:
    q = test_set[0].question
    prompt = build_fewshot_prompt(q, train, index=0)
    assert prompt.endswith(f"\n\nQuestion: {q}\nAnswer:")
    assert prompt.startswith("Question: ")
    shots = select_shots(q, train, index=0)
    assert len(shots) == 5
    blocks = [f"Question: {s.question}\nAnswer: {s.answer}" for s in shots]
    assert prompt == "\n\n".join([*blocks, f"Question: {q}\nAnswer:"])
    assert prompt.count("\nAnswer: ") == 5 and prompt.count("#### ") == 5
    assert STOP_SEQUENCES == ("Question:",)
    # Pinned draw: a change here means the sampler no longer reproduces Random(1234).
    assert fewshot_indices(0, len(train)) == [6374, 3610, 957, 61, 742]


def test_prompt_deterministic_and_order_free(train: list[Example], test_set: list[Example]) -> None:
    late = build_fewshot_prompt(test_set[40].question, train, index=40)
    early = build_fewshot_prompt(test_set[3].question, train, index=3)
    all_prompts = build_prompts(test_set[:41], train)
    assert all_prompts[40] == late and all_prompts[3] == early
    assert build_fewshot_prompt(test_set[3].question, train, index=3) == early
    assert build_fewshot_prompt(test_set[3].question, train, seed=99, index=3) != early
    assert len({p.split("\n\n")[0] for p in all_prompts}) > 30  # shots vary per question


def test_no_leakage_full_test_set(train: list[Example], test_set: list[Example]) -> None:
    for i, ex in enumerate(test_set):
        shots = select_shots(ex.question, train, index=i)
        assert len(shots) == 5
        assert len({s.question for s in shots}) == 5
        assert all(s.question.strip() != ex.question.strip() for s in shots)


def test_leakage_guard_replaces_shot() -> None:
    pool = [Example(f"q{i}", f"a{i}\n#### {i}", str(i)) for i in range(20)]
    positions = fewshot_indices(0, len(pool), num_shots=5, seed=7)
    leaked = pool[positions[2]].question
    shots = select_shots(f"  {leaked} ", pool, num_shots=5, seed=7, index=0)
    assert len(shots) == 5 and len({s.question for s in shots}) == 5
    assert leaked not in {s.question for s in shots}
    kept = [pool[p] for k, p in enumerate(positions) if k != 2]
    assert [s for k, s in enumerate(shots) if k != 2] == kept


def test_fewshot_index_validation() -> None:
    with pytest.raises(ValueError):
        fewshot_indices(-1, 10)
    with pytest.raises(ValueError):
        fewshot_indices(0, 3, num_shots=5)


# ---------------------------------------------------------------- extraction and scoring


@pytest.mark.parametrize(
    ("text", "strict", "flexible"),
    [
        ("so 5+7=12\n#### 1,234.", "1,234.", "1,234."),
        ("It costs $5", None, "$5"),
        ("#### $5", None, "$5"),
        ("The change is -3 degrees.\n#### -3", "-3", "-3"),
        ("I do not know...", None, None),
        ("", None, None),
        ("####72", None, "72"),
        ("#### 12 and then #### 13", "12", "13"),
        ("3 apples and 4 pears make 7.", None, "7."),
        ("half is 0.5", None, "0.5"),
    ],
)
def test_extraction(text: str, strict: str | None, flexible: str | None) -> None:
    assert extract_strict(text) == strict
    assert extract_flexible(text) == flexible


def test_normalize_and_compare() -> None:
    assert normalize_number("1,234.") == "1234"
    assert normalize_number(" $5 ") == "5"
    assert normalize_number("-3.") == "-3"
    assert normalize_number("0.5") == "0.5"
    assert is_correct("1,234.", "1234")
    assert is_correct("$5", "5")
    assert is_correct("-3", "-3")
    assert not is_correct("3", "-3")
    assert not is_correct(None, "5")
    assert not is_correct("5.0", "5")  # exact string match after normalisation, as lm-eval


def test_stop_and_grade() -> None:
    completion = " 2+2=<<2+2=4>>4\n#### 4\n\nQuestion: What is 3+3?\nAnswer: #### 6"
    assert truncate_at_stop(completion) == " 2+2=<<2+2=4>>4\n#### 4\n\n"
    g = grade(completion, "4")
    assert g.strict and g.flexible and g.strict_pred == "4"
    g = grade(" The answer is 10 dollars.", "10")
    assert not g.strict and g.flexible


def test_accuracy() -> None:
    assert accuracy([True, False, True, True]) == 0.75
    assert accuracy([]) == 0.0


# ---------------------------------------------------------------- McNemar


def test_mcnemar_known_values() -> None:
    assert mcnemar([], []) == (0, 0, 1.0)
    assert mcnemar([True, False], [True, False]) == (0, 0, 1.0)
    assert mcnemar([True], [False]) == (1, 0, 1.0)
    b, c, p = mcnemar([True] * 5 + [False] * 3, [False] * 5 + [False] * 3)
    assert (b, c) == (5, 0) and p == pytest.approx(2 / 32)
    a = [True] * 10 + [False] * 2 + [True] * 30
    bb = [False] * 10 + [True] * 2 + [True] * 30
    b, c, p = mcnemar(a, bb)
    assert (b, c) == (10, 2) and p == pytest.approx(2 * (1 + 12 + 66) / 4096)
    assert mcnemar([True, False] * 3, [False, True] * 3)[2] == 1.0
    with pytest.raises(ValueError):
        mcnemar([True], [True, False])


def test_mcnemar_large_counts() -> None:
    p = binom_two_sided_half(600, 1300)
    assert 0.0 < p < 0.01
    assert binom_two_sided_half(650, 1300) == 1.0


def test_mcnemar_against_scipy() -> None:
    stats = pytest.importorskip("scipy.stats")
    for n in [1, 2, 3, 7, 10, 25, 40, 101]:
        for k in range(n + 1):
            expected = stats.binomtest(k, n, 0.5, alternative="two-sided").pvalue
            assert binom_two_sided_half(k, n) == pytest.approx(expected, rel=1e-9, abs=1e-15)


# ---------------------------------------------------------------- metrics


def test_percentile_linear() -> None:
    vals = [4.0, 1.0, 3.0, 2.0]
    assert percentile(vals, 50) == 2.5
    assert percentile(vals, 0) == 1.0 and percentile(vals, 100) == 4.0
    assert percentile(vals, 95) == pytest.approx(1 + 3 * 0.95)
    assert percentile([], 50) == 0.0
    np = pytest.importorskip("numpy")
    rng = random.Random(0)
    data = [rng.random() for _ in range(37)]
    for p in (50, 95, 99, 12.5):
        assert percentile(data, p) == pytest.approx(float(np.percentile(data, p)))


def _records() -> list[RequestRecord]:
    return [
        RequestRecord(100, 11, ttft_s=0.2, latency_s=1.2, itl_s=[0.1] * 10, finish_reason="stop"),
        RequestRecord(50, 5, ttft_s=0.1, latency_s=0.5, itl_s=[0.1, 0.1, 0.2], finish_reason="length"),
        RequestRecord(30, 1, ttft_s=0.3, latency_s=0.3, itl_s=[], finish_reason="stop"),
        RequestRecord(70, 0, ttft_s=0.0, latency_s=2.0, finish_reason="error", error="boom"),
    ]


def test_request_record_tpot() -> None:
    recs = _records()
    assert recs[0].tpot_s == pytest.approx((1.2 - 0.2) / 10)
    assert recs[1].tpot_s == pytest.approx(0.4 / 4)
    assert recs[2].tpot_s is None  # one output token: no TPOT
    assert recs[0].accept_length is None


def test_summarize_hand_made() -> None:
    s = summarize(_records(), wall_time_s=2.0)
    assert (s["completed"], s["failed"], s["truncated"]) == (3, 1, 1)
    assert s["total_input_tokens"] == 180 and s["total_output_tokens"] == 17
    assert s["output_throughput"] == pytest.approx(17 / 2.0)
    assert s["request_throughput"] == pytest.approx(1.5)
    assert s["total_token_throughput"] == pytest.approx(197 / 2.0)
    assert s["mean_ttft_ms"] == pytest.approx(200.0)
    assert s["median_ttft_ms"] == pytest.approx(200.0)
    assert s["p99_ttft_ms"] == pytest.approx(200 + 100 * 0.98)
    # TPOT over the two requests with more than one token: 100 ms and 100 ms.
    assert s["mean_tpot_ms"] == pytest.approx(100.0)
    assert s["decode_throughput"] == pytest.approx(10.0)
    assert s["mean_itl_ms"] == pytest.approx(1000 * 1.4 / 13)
    assert s["p95_itl_ms"] == pytest.approx(200.0 - 100 * (1 - (12 * 0.95 - 11)))
    e2el = [1200.0, 500.0, 300.0]
    assert s["mean_e2el_ms"] == pytest.approx(sum(e2el) / 3)
    assert s["median_e2el_ms"] == pytest.approx(500.0)
    assert s["p95_e2el_ms"] == pytest.approx(500 + 700 * 0.9)
    assert s["std_e2el_ms"] == pytest.approx((sum((x - 2000 / 3) ** 2 for x in e2el) / 3) ** 0.5)
    assert s["accept_length"] is None and s["per_position_acceptance"] == []


def test_summarize_only_single_token_outputs() -> None:
    s = summarize([RequestRecord(10, 1, 0.05, 0.05)], wall_time_s=1.0)
    assert s["mean_tpot_ms"] == 0.0 and s["decode_throughput"] == 0.0
    assert s["mean_e2el_ms"] == pytest.approx(50.0)
    empty = summarize([], wall_time_s=0.0)
    assert empty["completed"] == 0 and empty["output_throughput"] == 0.0


def test_summarize_speculative() -> None:
    recs = [
        RequestRecord(10, 40, 0.1, 1.0, drafted_tokens=30, accepted_tokens=20, verify_rounds=10,
                      accepted_per_position=[9, 7, 4]),
        RequestRecord(10, 20, 0.1, 0.5, drafted_tokens=15, accepted_tokens=5, verify_rounds=5,
                      accepted_per_position=[4, 1]),
    ]  # fmt: skip
    assert recs[0].accept_length == pytest.approx(3.0)
    s = summarize(recs, wall_time_s=1.5)
    assert s["accept_length"] == pytest.approx(1 + 25 / 15)
    assert s["acceptance_rate"] == pytest.approx(25 / 45)
    assert s["per_position_acceptance"] == pytest.approx([13 / 15, 8 / 15, 4 / 15])
    assert s["spec_verify_rounds"] == 15

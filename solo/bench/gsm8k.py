"""The GSM8K evaluation protocol of SPEC section 4 (lm-evaluation-harness ``gsm8k``, 5-shot).

Pure Python; no model is needed. What it does, exactly:

* Prompt. Each shot is ``"Question: {q}\\nAnswer: {a}"`` (the question text, the answer text with its
  calculator annotations and ``#### N`` line, as stored); shots are joined by ``"\\n\\n"`` and the
  prompt ends with ``"\\n\\nQuestion: {q}\\nAnswer:"``. The model's completion starts after
  ``"Answer:"`` (lm-eval's target delimiter is one space). Generation stops at ``"Question:"``.
* Shots. One ``random.Random(seed)`` (seed 1234) is created once per (seed, num_shots, train size);
  for test question ``index`` = 0, 1, 2, ... in test-file order it calls
  ``rnd.sample(range(len(train)), num_shots)`` once per question, in order, and the ``index``-th
  draw gives that question's shots, in draw order. ``random.sample`` picks the same positions
  whether it is handed the list of documents or a ``range`` of the same length, so this matches
  lm-eval's default sampler, which samples the train documents with a generator seeded once with
  1234 and used for the test documents in order (train and test are different splits, so it draws
  exactly ``num_shots``). The draws are a function of ``index`` alone, so prompts can be built in
  any order or in parallel.
* Leakage guard. A shot whose question equals the test question (after stripping whitespace) is
  replaced by the next train example, cyclically, that is neither a duplicate of that question nor
  already among the shots. GSM8K's train and test share no question, so this never fires on the
  real data; it only keeps the guarantee for other files.
* Scoring. ``extract_strict`` takes the first match of ``#### (\\-?[0-9\\.\\,]+)``;
  ``extract_flexible`` takes the last match of lm-eval's ``(-?[$0-9.,]{2,})|(-?[0-9]+)`` and
  returns None when that match holds no digit (such a match can never equal a numeric target, so
  the score is the same as lm-eval's). Both sides are normalised by ``normalize_number`` and then
  compared as strings (exact match), as lm-eval does.
* A/B. ``mcnemar`` is the exact two-sided McNemar test on the paired per-question results.
"""

from __future__ import annotations

import math
import random
import re
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path

from solo.assets import gsm8k_file, read_jsonl

FEWSHOT_SEED = 1234
NUM_SHOTS = 5
SHOT_SEPARATOR = "\n\n"
STOP_SEQUENCES: tuple[str, ...] = ("Question:",)
"""Stop strings for generation (lm-eval's gsm8k ``until``; the eos token is handled separately)."""

ANSWER_MARKER = "####"
STRICT_PATTERN = re.compile(r"#### (\-?[0-9\.\,]+)")
FLEXIBLE_PATTERN = re.compile(r"(-?[$0-9.,]{2,})|(-?[0-9]+)")


@dataclass(frozen=True)
class Example:
    """One GSM8K item: the question, the full worked answer, and the normalised target number."""

    question: str
    answer: str
    target: str


def target_from_answer(answer: str) -> str:
    """The normalised number after the last ``####`` of a GSM8K answer."""
    if ANSWER_MARKER not in answer:
        raise ValueError(f"answer has no {ANSWER_MARKER!r} line: {answer[-80:]!r}")
    return normalize_number(answer.rsplit(ANSWER_MARKER, 1)[1])


def load_gsm8k(path: Path | str) -> list[Example]:
    """Read a GSM8K jsonl file (lines of ``{"question", "answer"}``; ``.gz`` compressed or not), in
    file order."""
    return [Example(r["question"], r["answer"], target_from_answer(r["answer"])) for r in read_jsonl(path)]


def load_split(split: str, data_dir: Path | str | None = None) -> list[Example]:
    """GSM8K ``split`` ("train" or "test"): ``data_dir/{split}.jsonl`` when a folder is given, else the
    copy shipped inside the package (solo/assets/gsm8k)."""
    if data_dir is None:
        return load_gsm8k(gsm8k_file(split))
    path = Path(data_dir) / f"{split}.jsonl"
    if not path.is_file():
        raise ValueError(
            f"{path} not found: pass --data DIR, a folder holding GSM8K's train.jsonl and test.jsonl "
            "(or leave --data out: solo ships GSM8K)"
        )
    return load_gsm8k(path)


def format_question(question: str) -> str:
    """The prompt tail for one question: ``"Question: {q}\\nAnswer:"``."""
    return f"Question: {question}\nAnswer:"


def format_shot(example: Example) -> str:
    """One worked example: ``"Question: {q}\\nAnswer: {a}"``."""
    return f"{format_question(example.question)} {example.answer}"


class _DrawCache:
    """Per-(seed, num_shots, train size) stream of ``rnd.sample`` draws, extended on demand."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._streams: dict[tuple[int, int, int], tuple[random.Random, list[list[int]]]] = {}

    def draw(self, seed: int, num_shots: int, n_train: int, index: int) -> list[int]:
        """The ``index``-th draw of ``num_shots`` train positions."""
        key = (seed, num_shots, n_train)
        with self._lock:
            if key not in self._streams:
                self._streams[key] = (random.Random(seed), [])
            rnd, draws = self._streams[key]
            while len(draws) <= index:
                draws.append(rnd.sample(range(n_train), num_shots))
            return list(draws[index])


_DRAWS = _DrawCache()


def fewshot_indices(index: int, n_train: int, num_shots: int = NUM_SHOTS, seed: int = FEWSHOT_SEED) -> list[int]:
    """Train positions of the shots for test question ``index`` (before the leakage guard)."""
    if index < 0:
        raise ValueError(f"index must be >= 0, got {index}")
    if not 0 <= num_shots <= n_train:
        raise ValueError(f"cannot draw {num_shots} shots from {n_train} train examples")
    return _DRAWS.draw(seed, num_shots, n_train, index)


def select_shots(
    question: str,
    train_examples: Sequence[Example],
    num_shots: int = NUM_SHOTS,
    seed: int = FEWSHOT_SEED,
    *,
    index: int,
) -> list[Example]:
    """The shots for test question ``index`` (see the module docstring), never the question itself."""
    n = len(train_examples)
    positions = fewshot_indices(index, n, num_shots, seed)
    key = question.strip()

    def leaks(pos: int) -> bool:
        return train_examples[pos].question.strip() == key

    chosen: list[int] = []
    for pos in positions:
        if leaks(pos):
            for step in range(1, n):
                cand = (pos + step) % n
                if not leaks(cand) and cand not in chosen and cand not in positions:
                    pos = cand
                    break
            else:
                raise ValueError("not enough train examples distinct from the test question")
        chosen.append(pos)
    return [train_examples[pos] for pos in chosen]


def build_fewshot_prompt(
    question: str,
    train_examples: Sequence[Example],
    num_shots: int = NUM_SHOTS,
    seed: int = FEWSHOT_SEED,
    *,
    index: int,
) -> str:
    """The lm-eval 5-shot prompt for test question number ``index`` (0-based, test-file order)."""
    shots = select_shots(question, train_examples, num_shots, seed, index=index)
    parts = [format_shot(s) for s in shots] + [format_question(question)]
    return SHOT_SEPARATOR.join(parts)


def build_prompts(
    test_examples: Sequence[Example],
    train_examples: Sequence[Example],
    num_shots: int = NUM_SHOTS,
    seed: int = FEWSHOT_SEED,
) -> list[str]:
    """Prompts for every test example, question ``i`` using draw ``i``."""
    return [
        build_fewshot_prompt(ex.question, train_examples, num_shots, seed, index=i)
        for i, ex in enumerate(test_examples)
    ]


def truncate_at_stop(text: str, stops: Sequence[str] = STOP_SEQUENCES) -> str:
    """Cut ``text`` at the earliest stop sequence (the stop itself is removed)."""
    cut = len(text)
    for stop in stops:
        pos = text.find(stop)
        if pos != -1:
            cut = min(cut, pos)
    return text[:cut]


def normalize_number(s: str) -> str:
    """Strip whitespace, remove every ``,`` and ``$``, then one trailing ``.`` (lm-eval's rules)."""
    s = s.strip().replace(",", "").replace("$", "")
    return s[:-1] if s.endswith(".") else s


def extract_strict(text: str) -> str | None:
    """The number after the first ``#### `` (raw, not normalised), or None."""
    m = STRICT_PATTERN.search(text)
    return m.group(1) if m else None


def extract_flexible(text: str) -> str | None:
    """The last number-like match in ``text`` (raw), or None when it holds no digit."""
    matches = FLEXIBLE_PATTERN.findall(text)
    if not matches:
        return None
    first, second = matches[-1]
    found = first or second
    return found if any(ch.isdigit() for ch in found) else None


def is_correct(pred: str | None, target: str) -> bool:
    """Exact match of the normalised prediction and target; None is wrong."""
    return pred is not None and normalize_number(pred) == normalize_number(target)


@dataclass(frozen=True)
class Grade:
    """Strict and flexible scores of one completion."""

    strict_pred: str | None
    flexible_pred: str | None
    strict: bool
    flexible: bool


def grade(completion: str, target: str) -> Grade:
    """Score one completion (truncated at the stop sequences first) against ``target``."""
    text = truncate_at_stop(completion)
    strict_pred, flexible_pred = extract_strict(text), extract_flexible(text)
    return Grade(strict_pred, flexible_pred, is_correct(strict_pred, target), is_correct(flexible_pred, target))


def binom_two_sided_half(k: int, n: int) -> float:
    """Exact two-sided p-value of ``k`` successes in ``n`` fair-coin trials."""
    if n == 0:
        return 1.0
    low = min(k, n - k)
    tail = sum(math.comb(n, i) for i in range(low + 1))
    return float(min(Fraction(1), Fraction(2 * tail, 2**n)))


def mcnemar(correct_a: Sequence[bool], correct_b: Sequence[bool]) -> tuple[int, int, float]:
    """Exact two-sided McNemar test on paired results.

    Returns ``(b, c, p)``: b = questions only A got right, c = only B got right, p = the exact
    binomial two-sided p-value of b in b + c trials at 1/2 (1.0 when b == c == 0).
    """
    if len(correct_a) != len(correct_b):
        raise ValueError(f"paired results differ in length: {len(correct_a)} vs {len(correct_b)}")
    b = sum(1 for x, y in zip(correct_a, correct_b, strict=True) if x and not y)
    c = sum(1 for x, y in zip(correct_a, correct_b, strict=True) if y and not x)
    return b, c, binom_two_sided_half(b, b + c)


def accuracy(correct: Sequence[bool]) -> float:
    """Fraction correct (0.0 for no questions)."""
    return sum(map(bool, correct)) / len(correct) if correct else 0.0

"""Tests for solo.training.tokenizer: determinism, fixed special ids, round trips, digits."""

from __future__ import annotations

import gzip
import itertools
import json
import random
import time
from pathlib import Path

import pytest
from tokenizers import Tokenizer, models

from solo.assets import gsm8k_file
from solo.training.tokenizer import (
    RESERVED_TOKENS,
    ROLE_TOKENS,
    SPECIAL_TOKENS,
    SpecialTokens,
    main,
    save_tokenizer,
    train_tokenizer,
    train_tokenizer_from_texts,
)

GSM8K_TRAIN = gsm8k_file("train")  # the packaged copy (gzip)


@pytest.fixture(scope="module")
def subset(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The first 300 lines of GSM8K train."""
    path = tmp_path_factory.mktemp("gsm8k") / "train300.jsonl"
    with gzip.open(GSM8K_TRAIN, "rt", encoding="utf-8") as f:
        lines = [next(f) for _ in range(300)]
    path.write_text("".join(lines), encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def tok(subset: Path) -> Tokenizer:
    """A tokenizer trained on the subset."""
    return train_tokenizer(subset, vocab_size=2048)


def test_trains_fast_and_deterministic(subset: Path, tmp_path: Path) -> None:
    start = time.perf_counter()
    a = train_tokenizer(subset, vocab_size=1024)
    assert time.perf_counter() - start < 10.0
    b = train_tokenizer(subset, vocab_size=1024)
    assert a.to_str() == b.to_str()
    save_tokenizer(a, tmp_path / "a.json")
    assert main(["--data", str(subset), "--vocab-size", "1024", "--out", str(tmp_path / "b.json")]) == 0
    assert (tmp_path / "a.json").read_bytes() == (tmp_path / "b.json").read_bytes()
    assert Tokenizer.from_file(str(tmp_path / "b.json")).to_str() == a.to_str()


def test_vocab_size(tok: Tokenizer) -> None:
    assert tok.get_vocab_size() <= 2048
    assert tok.get_vocab_size() > 1000
    with pytest.raises(ValueError):
        train_tokenizer_from_texts(["abc"], vocab_size=100)


def test_special_token_ids(tok: Tokenizer) -> None:
    for i, token in enumerate(RESERVED_TOKENS):
        assert tok.token_to_id(token) == i
        assert tok.id_to_token(i) == token
    st = SpecialTokens.from_tokenizer(tok)
    assert (st.pad_id, st.role_open_id, st.role_close_id, st.eos_id) == (0, 1, 2, 3)
    assert (st.think_open_id, st.think_close_id) == (4, 5)
    assert (st.human_id, st.assistant_id, st.system_id) == (6, 7, 8)
    assert st.stop_ids == (3,)
    added = tok.get_added_tokens_decoder()
    assert all(added[i].special for i in range(len(SPECIAL_TOKENS)))
    assert not any(added[len(SPECIAL_TOKENS) + i].special for i in range(len(ROLE_TOKENS)))


def test_special_tokens_missing_raises() -> None:
    with pytest.raises(KeyError):
        SpecialTokens.from_tokenizer(Tokenizer(models.BPE()))
    # Role names are optional: a tokenizer without them still yields the special ids.
    tiny = train_tokenizer_from_texts(["hello world"] * 3, vocab_size=300)
    assert SpecialTokens.from_tokenizer(tiny).eos_id == 3


def test_chat_template_tokens(tok: Tokenizer) -> None:
    text = "<role>HUMAN</role>What is 2+2?<|role_end|><role>ASSISTANT</role>\n<think></think>4"
    ids = tok.encode(text).ids
    assert ids[:3] == [1, 6, 2]
    assert ids[ids.index(3) + 1 : ids.index(3) + 4] == [1, 7, 2]
    assert 4 in ids and 5 in ids
    assert tok.decode(ids, skip_special_tokens=False) == text
    # Role names are ordinary added tokens: kept when special tokens are skipped.
    assert tok.decode(ids, skip_special_tokens=True) == "HUMANWhat is 2+2?ASSISTANT\n4"
    # single_word: no match inside a longer word.
    assert 6 not in tok.encode("HUMANITY").ids


def _random_text(rng: random.Random, length: int) -> str:
    """Random unicode text mixing ASCII, accents, CJK, emoji, controls (no surrogates)."""
    ranges = [
        (0x0, 0x7F),
        (0x80, 0x7FF),
        (0x4E00, 0x9FFF),
        (0x1F300, 0x1FAFF),
        (0xE000, 0xFFFD),
        (0x10000, 0x10FFFF),
    ]
    out = []
    for _ in range(length):
        lo, hi = rng.choice(ranges)
        cp = rng.randint(lo, hi)
        if 0xD800 <= cp <= 0xDFFF:
            cp = 0x20
        out.append(chr(cp))
    return "".join(out)


def test_round_trip_random_unicode(tok: Tokenizer) -> None:
    rng = random.Random(0)
    for _ in range(200):
        s = _random_text(rng, rng.randint(0, 64))
        assert tok.decode(tok.encode(s).ids, skip_special_tokens=False) == s
    for s in ["", " ", "  leading and trailing  ", "\n\n\t", "<think>x</think><|endoftext|>", "HUMAN HUMANS"]:
        assert tok.decode(tok.encode(s).ids, skip_special_tokens=False) == s


def test_round_trip_gsm8k(tok: Tokenizer) -> None:
    with gzip.open(GSM8K_TRAIN, "rt", encoding="utf-8") as f:
        records = [json.loads(line) for line in itertools.islice(f, 1000)]
    for r in records:
        s = f"Question: {r['question']}\nAnswer: {r['answer']}"
        assert tok.decode(tok.encode(s).ids) == s


def test_numbers_split_into_digits(tok: Tokenizer) -> None:
    digit_ids = [tok.token_to_id(str(d)) for d in range(10)]
    assert all(i is not None for i in digit_ids)
    assert tok.encode("1,234").tokens == ["1", ",", "2", "3", "4"]
    enc = tok.encode("#### 72")
    assert enc.tokens[-2:] == ["7", "2"]
    assert tok.decode(enc.ids) == "#### 72"
    assert "####" in enc.tokens
    # Every digit maps to the same id whatever surrounds it.
    for text in ["x9y", " 9", "99", "$9.", "-9"]:
        assert tok.token_to_id("9") in tok.encode(text).ids


def test_training_text_compresses(tok: Tokenizer) -> None:
    s = "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May."
    assert len(tok.encode(s).ids) < len(s.encode("utf-8")) / 2

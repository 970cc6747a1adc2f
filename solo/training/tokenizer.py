"""Train a small byte-level BPE tokenizer on GSM8K, with the Ling chat special tokens.

The tokenizer is meant for tiny random or distilled test models: it is not the Ling-3.0 tokenizer
(vocabulary 157184), but it carries the same chat-format tokens (SPEC section 1) so that prompt
building, stop handling and the serving path can be exercised end to end with small vocabularies.

Layout of the vocabulary (fixed, independent of the training data):

====  =================  ==========================================================
id    token              role
====  =================  ==========================================================
0     ``<|endoftext|>``  padding (special)
1     ``<role>``         opens a role header (special)
2     ``</role>``        closes a role header (special)
3     ``<|role_end|>``   end of a turn; the eos (special)
4     ``<think>``        opens a reasoning block (special)
5     ``</think>``       closes a reasoning block (special)
6     ``HUMAN``          role name (ordinary added token, ``single_word``)
7     ``ASSISTANT``      role name (ordinary added token, ``single_word``)
8     ``SYSTEM``         role name (ordinary added token, ``single_word``)
9+    bytes, merges      the 256 byte-level symbols, then learned merges
====  =================  ==========================================================

Decisions:

* The role names are *ordinary* added tokens, not special ones: they are plain words of the chat
  text, so ``decode(ids, skip_special_tokens=True)`` keeps them (a user who writes "HUMAN" gets it
  back), while they still map to one fixed id in the chat header. ``single_word`` keeps them from
  matching inside longer words ("HUMANITY" is ordinary BPE text).
* Digits are always split into single-digit tokens (``Digits(individual_digits=True)`` before the
  byte-level split), so every number is spelled digit by digit with the same ten ids: "1,234" is
  ``1 , 2 3 4`` and "#### 72" is ``#### Ġ 7 2``.
* No normalizer: together with the byte-level pre-tokenizer and decoder any text round-trips,
  ``decode(encode(s).ids, skip_special_tokens=False) == s`` (special-token text included).
* Determinism: the corpus is read in file order and the trainer is given fixed settings, so the
  same input file gives a byte-identical ``tokenizer.json``.

CLI: ``python -m solo.training.tokenizer --data train.jsonl --vocab-size 2048 --out tokenizer.json``.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

from solo.assets import gsm8k_file, read_jsonl
from solo.tokenizer import SPECIAL_TOKENS  # the one list of Ling special tokens, ids 0..5 in this order

PAD_TOKEN, ROLE_OPEN_TOKEN, ROLE_CLOSE_TOKEN, EOS_TOKEN, THINK_OPEN_TOKEN, THINK_CLOSE_TOKEN = SPECIAL_TOKENS

ROLE_TOKENS: tuple[str, ...] = ("HUMAN", "ASSISTANT", "SYSTEM")
"""Role names, ordinary added tokens with ids 6..8 in this order."""

RESERVED_TOKENS: tuple[str, ...] = SPECIAL_TOKENS + ROLE_TOKENS
"""All fixed tokens; token ``RESERVED_TOKENS[i]`` has id ``i``."""

MIN_VOCAB_SIZE = len(RESERVED_TOKENS) + 256


@dataclass(frozen=True)
class SpecialTokens:
    """Ids of the chat-format tokens, read from a tokenizer by their text (never hard-coded).

    Works for this module's tokenizers and for any tokenizer that has the special tokens (such as
    Ling's own); role names that are not single tokens there come back as ``None``.
    """

    pad_id: int
    role_open_id: int
    role_close_id: int
    eos_id: int
    think_open_id: int
    think_close_id: int
    human_id: int | None
    assistant_id: int | None
    system_id: int | None

    @classmethod
    def from_tokenizer(cls, tok: Tokenizer) -> SpecialTokens:
        """Look the tokens up in ``tok``; raises ``KeyError`` if a special token is missing."""

        def required(token: str) -> int:
            token_id = tok.token_to_id(token)
            if token_id is None:
                raise KeyError(f"tokenizer has no token {token!r}")
            return token_id

        return cls(
            pad_id=required(PAD_TOKEN),
            role_open_id=required(ROLE_OPEN_TOKEN),
            role_close_id=required(ROLE_CLOSE_TOKEN),
            eos_id=required(EOS_TOKEN),
            think_open_id=required(THINK_OPEN_TOKEN),
            think_close_id=required(THINK_CLOSE_TOKEN),
            human_id=tok.token_to_id("HUMAN"),
            assistant_id=tok.token_to_id("ASSISTANT"),
            system_id=tok.token_to_id("SYSTEM"),
        )

    @property
    def stop_ids(self) -> tuple[int, ...]:
        """Token ids that end generation (the eos)."""
        return (self.eos_id,)


def iter_gsm8k_texts(train_jsonl: Path, max_examples: int | None = None) -> Iterator[str]:
    """Yield the training texts of each GSM8K line in file order.

    Per example: the question, the answer, and the prompt form ``"Question: {q}\\nAnswer: {a}"``.
    """
    for count, record in enumerate(read_jsonl(train_jsonl)):
        if max_examples is not None and count >= max_examples:
            break
        question, answer = record["question"], record["answer"]
        yield question
        yield answer
        yield f"Question: {question}\nAnswer: {answer}"


def new_tokenizer() -> Tokenizer:
    """An untrained byte-level BPE tokenizer with this module's pre-tokenizer and decoder."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    return tok


def _make_roles_ordinary(tok: Tokenizer) -> Tokenizer:
    """Rebuild ``tok`` with the role names as non-special, single-word added tokens.

    The trainer registers every reserved token as special; editing the serialized form keeps
    their ids and flips only the flags.
    """
    data = json.loads(tok.to_str())
    for entry in data["added_tokens"]:
        if entry["content"] in ROLE_TOKENS:
            entry["special"] = False
            entry["single_word"] = True
    return Tokenizer.from_str(json.dumps(data))


def train_tokenizer_from_texts(texts: Iterator[str] | Sequence[str], vocab_size: int = 2048) -> Tokenizer:
    """Train the tokenizer on ``texts`` (in order); see the module docstring for the layout."""
    if vocab_size < MIN_VOCAB_SIZE:
        raise ValueError(f"vocab_size must be at least {MIN_VOCAB_SIZE}, got {vocab_size}")
    tok = new_tokenizer()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        show_progress=False,
        special_tokens=[AddedToken(t, special=True, normalized=False) for t in RESERVED_TOKENS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(texts, trainer=trainer)
    tok = _make_roles_ordinary(tok)
    for i, token in enumerate(RESERVED_TOKENS):
        if tok.token_to_id(token) != i:
            raise RuntimeError(f"reserved token {token!r} got id {tok.token_to_id(token)}, expected {i}")
    return tok


def train_tokenizer(train_jsonl: Path, vocab_size: int = 2048, max_examples: int | None = None) -> Tokenizer:
    """Train a byte-level BPE tokenizer on the GSM8K questions and answers in ``train_jsonl``."""
    return train_tokenizer_from_texts(iter_gsm8k_texts(train_jsonl, max_examples), vocab_size)


def save_tokenizer(tok: Tokenizer, path: Path) -> None:
    """Write ``tok`` as ``tokenizer.json`` (pretty-printed, deterministic bytes)."""
    Path(path).write_text(tok.to_str(pretty=True) + "\n", encoding="utf-8")


def main(argv: Sequence[str] | None = None) -> int:
    """CLI entry point: train on ``--data`` and write ``--out``."""
    parser = argparse.ArgumentParser(prog="python -m solo.training.tokenizer", description=__doc__.split("\n")[0])
    parser.add_argument(
        "--data", type=Path, default=gsm8k_file("train"), help="GSM8K train.jsonl[.gz] (default: the packaged copy)"
    )
    parser.add_argument("--vocab-size", type=int, default=2048)
    parser.add_argument("--max-examples", type=int, default=None, help="use only the first N lines")
    parser.add_argument("--out", type=Path, default=Path("tokenizer.json"))
    args = parser.parse_args(argv)
    tok = train_tokenizer(args.data, args.vocab_size, args.max_examples)
    save_tokenizer(tok, args.out)
    print(f"wrote {args.out} (vocab {tok.get_vocab_size()})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

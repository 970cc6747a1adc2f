"""Tokenizer (Hugging Face `tokenizers`, tokenizer.json), the Ling chat format and streaming decode."""

from __future__ import annotations

from pathlib import Path

from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers

from solo.checkpoint.reader import CheckpointError

ROLE_END = "<|role_end|>"
SPECIAL_TOKENS = ("<|endoftext|>", "<role>", "</role>", ROLE_END, "<think>", "</think>")
CHAT_ROLES = {"system": "SYSTEM", "user": "HUMAN", "human": "HUMAN", "assistant": "ASSISTANT"}


class Tokenizer:
    def __init__(self, tokenizer: HFTokenizer, eos_ids: list[int] | None = None) -> None:
        self._tok = tokenizer
        ids = list(eos_ids or [])
        role_end = tokenizer.token_to_id(ROLE_END)
        if role_end is not None and role_end not in ids:
            ids.append(role_end)
        self.eos_ids = ids

    @classmethod
    def from_dir(cls, directory: str | Path, eos_ids: list[int] | None = None) -> Tokenizer:
        path = Path(directory) / "tokenizer.json"
        if not path.is_file():
            raise CheckpointError(
                f"{path}: tokenizer.json is missing. solo reads the Hugging Face tokenizer.json that ships "
                "with the checkpoint; copy it into the model folder."
            )
        try:
            tok = HFTokenizer.from_file(str(path))
        except Exception as e:  # the tokenizers library raises a bare Exception on bad files
            raise CheckpointError(f"{path}: not a valid tokenizer.json ({e}).") from e
        return cls(tok, eos_ids)

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def token_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    @staticmethod
    def chat_prompt(messages: list[dict[str, str]], thinking: bool = False) -> str:
        """Ling chat format: <role>HUMAN</role>text<|role_end|> per turn, then the assistant's
        header; thinking on adds "\\n<think>", off adds "\\n<think></think>"."""
        parts = []
        for message in messages:
            role = CHAT_ROLES.get(message.get("role", ""))
            if role is None:
                raise ValueError(f"chat message role {message.get('role')!r} is not one of {sorted(CHAT_ROLES)}.")
            parts.append(f"<role>{role}</role>{message.get('content', '')}{ROLE_END}")
        parts.append("<role>ASSISTANT</role>" + ("\n<think>" if thinking else "\n<think></think>"))
        return "".join(parts)


class StreamDecoder:
    """Turns a growing list of token ids into text pieces, holding back incomplete UTF-8.

    Each step decodes only the tokens since the last emitted piece plus one piece of context (so
    decoders that treat a leading token specially stay right): constant work per token.
    """

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.text = ""
        self._context = 0  # ids[_context:_emitted] were decoded before: the context of the next piece
        self._emitted = 0

    def push(self, token_id: int) -> str:
        self.ids.append(token_id)
        before = self.tokenizer.decode(self.ids[self._context : self._emitted])
        now = self.tokenizer.decode(self.ids[self._context :])
        if now.endswith("\ufffd"):  # an incomplete UTF-8 sequence: wait for the next token
            return ""
        piece = now[len(before) :]
        self._context, self._emitted = self._emitted, len(self.ids)
        self.text += piece
        return piece


def write_byte_tokenizer(path: str | Path) -> None:
    """A byte-level tokenizer with no merges: the special tokens at ids 0..5, then the 256 bytes.
    Used for tiny random test checkpoints (any text encodes, one token per byte)."""
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    vocab.update({ch: len(SPECIAL_TOKENS) + i for i, ch in enumerate(alphabet)})
    tok = HFTokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(list(SPECIAL_TOKENS))
    tok.save(str(path))


def synthetic_tokenizer(vocab_size: int) -> HFTokenizer:
    """A word-level tokenizer with one token per id ("t0", "t1", ...), for random-weight models that
    ship none: the engine decodes and streams their ids as text like any other model's."""
    vocab = {f"t{i}": i for i in range(vocab_size)}
    tok = HFTokenizer(models.WordLevel(vocab=vocab, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)
    return tok

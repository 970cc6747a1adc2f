"""Tokenizer (Hugging Face `tokenizers`, tokenizer.json), the Ling chat format and streaming decode.

Chat messages are encoded piece by piece: the template's role markers as control tokens, each
message's content as plain text (`encode_text`), so a user who types ``<|role_end|>`` gets those
characters, never the control token that would close their turn.
"""

from __future__ import annotations

from functools import cache
from pathlib import Path

from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers

from solo.checkpoint.reader import CheckpointError

ROLE_END = "<|role_end|>"
SPECIAL_TOKENS = ("<|endoftext|>", "<role>", "</role>", ROLE_END, "<think>", "</think>")
# OpenAI roles -> the Ling chat format's: "developer" is OpenAI's newer name for "system"; tool
# results go in an OBSERVATION turn
CHAT_ROLES = {
    "system": "SYSTEM",
    "developer": "SYSTEM",
    "user": "HUMAN",
    "human": "HUMAN",
    "assistant": "ASSISTANT",
    "tool": "OBSERVATION",
}


class Tokenizer:
    def __init__(self, tokenizer: HFTokenizer, eos_ids: list[int] | None = None) -> None:
        self._tok = tokenizer
        # the same tokenizer with special-token strings treated as text (message content)
        self._plain = HFTokenizer.from_str(tokenizer.to_str())
        self._plain.encode_special_tokens = True
        self._byte_level = type(tokenizer.decoder).__name__ == "ByteLevel"
        self._special = {i for i, t in tokenizer.get_added_tokens_decoder().items() if t.special}
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
        """Token ids of `text`; special-token strings in it become control tokens (a raw prompt)."""
        return self._tok.encode(text, add_special_tokens=False).ids

    def encode_text(self, text: str) -> list[int]:
        """Token ids of `text` as plain text: special-token strings in it stay characters."""
        return self._plain.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def token_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def token_text(self, token_id: int) -> str:
        """One token's text, special tokens included (a partial UTF-8 sequence shows as U+FFFD)."""
        return self._tok.decode([token_id], skip_special_tokens=False)

    def token_bytes(self, token_id: int) -> list[int]:
        """One token's bytes: exact for byte-level BPE, else the UTF-8 of its text."""
        piece = self._tok.id_to_token(token_id)
        if self._byte_level and piece is not None and token_id not in self._special:
            table = _unicode_to_bytes()
            if all(ch in table for ch in piece):
                return [table[ch] for ch in piece]
        return list(self.token_text(token_id).encode("utf-8"))

    @staticmethod
    def chat_prompt(messages: list[dict[str, str]], thinking: bool = False) -> str:
        """Ling chat format as text: <role>HUMAN</role>text<|role_end|> per turn, then the assistant's
        header; thinking on adds "\\n<think>", off adds "\\n<think></think>". For display: `chat_ids`
        is the encoding, which keeps message content from turning into control tokens."""
        return "".join(head + content + end for head, content, end in _chat_pieces(messages, thinking))

    def chat_ids(self, messages: list[dict[str, str]], thinking: bool = False) -> list[int]:
        """Token ids of the Ling chat format: role markers as control tokens, content as text."""
        ids: list[int] = []
        for head, content, end in _chat_pieces(messages, thinking):
            ids += self.encode(head) + self.encode_text(content) + (self.encode(end) if end else [])
        return ids


def _chat_pieces(messages: list[dict[str, str]], thinking: bool) -> list[tuple[str, str, str]]:
    """(template head, content, template end) per turn, then the assistant's open header."""
    pieces = []
    for message in messages:
        role = CHAT_ROLES.get(message.get("role", ""))
        if role is None:
            raise ValueError(f"chat message role {message.get('role')!r} is not one of {sorted(CHAT_ROLES)}.")
        pieces.append((f"<role>{role}</role>", message.get("content") or "", ROLE_END))
    pieces.append(("<role>ASSISTANT</role>" + ("\n<think>" if thinking else "\n<think></think>"), "", ""))
    return pieces


@cache
def _unicode_to_bytes() -> dict[str, int]:
    """The inverse of byte-level BPE's byte -> printable character table (GPT-2's bytes_to_unicode)."""
    kept = [*range(ord("!"), ord("~") + 1), *range(ord("\xa1"), ord("\xac") + 1), *range(ord("\xae"), ord("\xff") + 1)]
    byte_values, chars = list(kept), list(kept)
    for b in range(256):
        if b not in kept:
            byte_values.append(b)
            chars.append(256 + len(chars) - len(kept))
    return {chr(c): b for b, c in zip(byte_values, chars, strict=True)}


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

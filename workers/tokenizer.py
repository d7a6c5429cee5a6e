"""Tokenizer over a Hugging Face ``tokenizer.json`` (the ``tokenizers`` library, no transformers).

Streaming text needs care: a token can end in the middle of a UTF-8 character, and byte-level
BPE decodes differently in context, so ``IncrementalDecoder`` re-decodes a short window and only
emits text once it no longer ends in a replacement character.
"""
from __future__ import annotations

from pathlib import Path
from typing import Sequence

from tokenizers import Tokenizer as _HFTokenizer

from .loader import load_generation_eos_ids

THINK_START = "<think>"
THINK_END = "</think>"


class Tokenizer:
    def __init__(self, hf: _HFTokenizer, eos_token_ids: Sequence[int] = ()):
        self._tok = hf
        self.eos_token_ids: tuple[int, ...] = tuple(eos_token_ids)
        self.think_start_id: int | None = hf.token_to_id(THINK_START)
        self.think_end_id: int | None = hf.token_to_id(THINK_END)

    @classmethod
    def from_pretrained(cls, path: str | Path) -> "Tokenizer":
        path = Path(path)
        file = path / "tokenizer.json"
        if not file.is_file():
            raise FileNotFoundError(f"model directory {str(path)!r} has no tokenizer.json")
        return cls(_HFTokenizer.from_file(str(file)), load_generation_eos_ids(path))

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = False) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def incremental_decoder(self, *, skip_special_tokens: bool = False) -> "IncrementalDecoder":
        return IncrementalDecoder(self, skip_special_tokens=skip_special_tokens)


class IncrementalDecoder:
    """Turns a growing token list into text deltas.

    ::

        ids:   ... p p p p p | r r r | n n      (p: emitted, used as context; r: emitted;
                             ^prefix  ^read       n: new, not yet emitted)
        delta = decode(ids[prefix:]) minus decode(ids[prefix:read])

    Text is held back while it ends in U+FFFD (an incomplete UTF-8 sequence).
    """

    _CONTEXT = 5  # tokens of left context kept for decoding (spacing depends on neighbours)

    def __init__(self, tokenizer: Tokenizer, *, skip_special_tokens: bool = False):
        self._tok = tokenizer
        self._skip = skip_special_tokens
        self.token_ids: list[int] = []
        self.text = ""
        self._prefix = 0
        self._read = 0

    def add(self, new_token_ids: Sequence[int]) -> str:
        """Appends tokens; returns the text they complete (possibly empty)."""
        self.token_ids.extend(new_token_ids)
        delta = self._unread()
        if not delta or delta.endswith("\ufffd"):
            return ""
        self.text += delta
        self._read = len(self.token_ids)
        self._prefix = max(self._prefix, self._read - self._CONTEXT)
        return delta

    def full_text(self) -> str:
        """The text of every token added: what ``add`` emitted plus what it holds back (an
        incomplete UTF-8 sequence at the end reads U+FFFD, as a decode of the whole list does),
        decoding only the short window past the last emitted token."""
        if self._read == len(self.token_ids):
            return self.text
        return self.text + self._unread()

    def _unread(self) -> str:
        """The text of the tokens past the last emitted one: decode(ids[prefix:]) minus
        decode(ids[prefix:read]) (empty when the new tokens add no characters)."""
        prefix_text = self._tok.decode(self.token_ids[self._prefix : self._read], skip_special_tokens=self._skip)
        full = self._tok.decode(self.token_ids[self._prefix :], skip_special_tokens=self._skip)
        return full[len(prefix_text) :]


def find_stop(text: str, stops: Sequence[str], new_chars: int) -> int | None:
    """Index where the earliest stop string in ``text`` begins, looking only where the last
    ``new_chars`` characters could complete one; ``None`` when no stop string occurs."""
    best = None
    for s in stops:
        if not s:
            continue
        i = text.find(s, max(0, len(text) - new_chars - len(s) + 1))
        if i >= 0 and (best is None or i < best):
            best = i
    return best

"""Megatron's NullTokenizer, for mock or already-tokenized data: a text is its token ids as integers
separated by spaces (`"5 17 3"`), ids run 0..vocab_size-1, and eod is vocab_size itself, so the
vocabulary holds vocab_size + 1 ids. It has no bos; eos is eod.
"""
from __future__ import annotations

from typing import Optional, Sequence

from llamapipe.data.tokenizers.base import Tokenizer


class NullTokenizer(Tokenizer):
    def __init__(self, vocab_size: int) -> None:
        if vocab_size < 1:
            raise ValueError(f"--vocab-size {vocab_size} must be at least 1 for --tokenizer-type NullTokenizer")
        self._eod_id = int(vocab_size)

    @property
    def vocab_size(self) -> int:
        return self._eod_id + 1

    @property
    def bos_id(self) -> Optional[int]:
        return None

    @property
    def eos_id(self) -> int:
        return self._eod_id

    def _encode_many(self, texts: list[str], num_threads: int) -> list[list[int]]:
        return [self._ids(text) for text in texts]

    def _ids(self, text: str) -> list[int]:
        try:
            ids = [int(x) for x in text.split()]
        except ValueError:
            raise ValueError(f"NullTokenizer reads token ids written as integers separated by spaces, "
                             f"not {text[:40]!r}") from None
        if ids and not 0 <= min(ids) <= max(ids) <= self._eod_id:
            bad = next(i for i in ids if not 0 <= i <= self._eod_id)
            raise ValueError(f"token id {bad} is outside NullTokenizer's ids 0..{self._eod_id} "
                             f"(--vocab-size {self._eod_id}, plus eod)")
        return ids

    def decode(self, ids: Sequence[int]) -> str:
        return " ".join(str(int(i)) for i in ids)

    def id_to_piece(self, i: int) -> str:
        return str(int(i))

"""SentencePiece tokenizer (`--tokenizer-model`) with LLaMA's special ids, plus the vocabulary-coverage check.

LLaMA's models define bos/eos/unk but no pad (sentencepiece reports pad_id -1): `pad_id` is then None.
The model pads its vocabulary (Megatron: multiple of make_vocab_size_divisible_by x TP); `check_vocab`
verifies that padding still covers every token id the tokenizer can produce.
"""
from __future__ import annotations

import os
from typing import Optional, Sequence, Union

import sentencepiece as spm


class SentencePieceTokenizer:
    """Thin wrapper over `sentencepiece.SentencePieceProcessor`; ids are plain Python ints."""

    def __init__(self, model_path: str) -> None:
        if not os.path.isfile(model_path):
            raise ValueError(f"tokenizer model {model_path} does not exist")
        self.model_path = model_path
        self._sp = spm.SentencePieceProcessor(model_file=model_path)

    @property
    def vocab_size(self) -> int:
        return self._sp.get_piece_size()

    @property
    def bos_id(self) -> Optional[int]:
        return _optional(self._sp.bos_id())

    @property
    def eos_id(self) -> Optional[int]:
        return _optional(self._sp.eos_id())

    @property
    def pad_id(self) -> Optional[int]:
        return _optional(self._sp.pad_id())

    @property
    def eod(self) -> int:
        """End-of-document token appended by `preprocess_data.py --append-eod` (LLaMA: eos)."""
        assert self.eos_id is not None, "tokenizer has no eos piece to mark document ends"
        return self.eos_id

    def encode(self, text: Union[str, Sequence[str]], bos: bool = False, eos: bool = False,
               num_threads: int = 1) -> Union[list[int], list[list[int]]]:
        """One text -> ids; a list of texts -> list of ids (sentencepiece's fast batch path)."""
        if isinstance(text, str):
            return self._sp.encode(text, add_bos=bos, add_eos=eos)
        return self._sp.encode(list(text), add_bos=bos, add_eos=eos, num_threads=num_threads)

    def decode(self, ids: Sequence[int]) -> str:
        return self._sp.decode([int(i) for i in ids])

    def id_to_piece(self, i: int) -> str:
        return self._sp.id_to_piece(int(i))


def _optional(i: int) -> Optional[int]:
    return None if i < 0 else i


def build_tokenizer(model_path: str) -> SentencePieceTokenizer:
    return SentencePieceTokenizer(model_path)


def check_vocab(tokenizer_vocab: int, padded_vocab: int) -> None:
    """Raise when the model's (padded) vocabulary is smaller than the tokenizer's."""
    if padded_vocab < tokenizer_vocab:
        raise ValueError(f"the model's padded vocabulary ({padded_vocab}) is smaller than the tokenizer's "
                         f"vocabulary ({tokenizer_vocab}); raise --vocab-size to at least {tokenizer_vocab}")

"""SentencePiece tokenizer (`--tokenizer-model tokenizer.model`, LLaMA 1/2) with LLaMA's special ids.

LLaMA's models define bos/eos/unk but no pad (sentencepiece reports pad_id -1): `pad_id` is then None.
"""
from __future__ import annotations

import os
from typing import Optional, Sequence

import sentencepiece as spm

from llamapipe.data.tokenizers.base import Tokenizer
from llamapipe.safe_files import kind_of


class SentencePieceTokenizer(Tokenizer):
    """Thin wrapper over `sentencepiece.SentencePieceProcessor`."""

    def __init__(self, model_path: str) -> None:
        if not os.path.isfile(model_path):
            what = (f"is {kind_of(model_path)}, not a regular file" if os.path.lexists(model_path)
                    else "does not exist")
            raise ValueError(f"--tokenizer-model {model_path} {what}")
        self.model_path = model_path
        try:
            self._sp = spm.SentencePieceProcessor(model_file=model_path)
        except RuntimeError:   # sentencepiece's only report of a file it cannot parse
            raise ValueError(f"--tokenizer-model {model_path} is not a sentencepiece model (for an HF "
                             "tokenizer.json use --tokenizer-type HuggingFaceTokenizer)") from None

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
    def unk_id(self) -> Optional[int]:
        return _optional(self._sp.unk_id())

    def _encode_many(self, texts: list[str], num_threads: int) -> list[list[int]]:
        return self._sp.encode(texts, num_threads=num_threads)

    def decode(self, ids: Sequence[int]) -> str:
        return self._sp.decode([int(i) for i in ids])

    def id_to_piece(self, i: int) -> str:
        return self._sp.id_to_piece(int(i))


def _optional(i: int) -> Optional[int]:
    return None if i < 0 else i

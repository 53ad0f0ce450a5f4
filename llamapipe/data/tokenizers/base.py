"""The interface every tokenizer here shares: what preprocessing, the sampler and vocabulary padding rely on.

Ids are plain Python ints in 0..vocab_size-1. `eod` is the id `--append-eod` writes after each document and
the sampler treats as a document boundary; it is the end-of-text (eos) token for every kind.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Optional, Sequence, Union


class Tokenizer(ABC):
    """Subclasses give the vocabulary size, the special ids and batch encoding; bos/eos handling is shared."""

    model_path: Optional[str] = None

    @property
    @abstractmethod
    def vocab_size(self) -> int:
        """Every id the tokenizer produces is below this (the model pads its embedding beyond it)."""

    @property
    @abstractmethod
    def bos_id(self) -> Optional[int]:
        ...

    @property
    @abstractmethod
    def eos_id(self) -> Optional[int]:
        ...

    @property
    def pad_id(self) -> Optional[int]:
        return None

    @property
    def eod(self) -> int:
        """End-of-document token appended by `--append-eod` (LLaMA: eos)."""
        if self.eos_id is None:
            raise ValueError(f"tokenizer {self.model_path} has no end-of-text token to mark document ends; "
                             "name one as eos_token in its tokenizer_config.json")
        return self.eos_id

    def encode(self, text: Union[str, Sequence[str]], bos: bool = False, eos: bool = False,
               num_threads: int = 1) -> Union[list[int], list[list[int]]]:
        """One text -> ids; a list of texts -> list of ids (the tokenizer's batch path)."""
        single = isinstance(text, str)
        ids = self._encode_many([text] if single else list(text), num_threads)
        if bos or eos:
            head = [self._required(self.bos_id, "beginning-of-text")] if bos else []
            tail = [self._required(self.eos_id, "end-of-text")] if eos else []
            ids = [head + seq + tail for seq in ids]
        return ids[0] if single else ids

    @abstractmethod
    def _encode_many(self, texts: list[str], num_threads: int) -> list[list[int]]:
        """Ids of each text without special tokens."""

    @abstractmethod
    def decode(self, ids: Sequence[int]) -> str:
        ...

    @abstractmethod
    def id_to_piece(self, i: int) -> str:
        ...

    def _required(self, token_id: Optional[int], what: str) -> int:
        if token_id is None:
            raise ValueError(f"tokenizer {self.model_path} has no {what} token")
        return token_id

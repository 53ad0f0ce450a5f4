"""Tokenizers by Megatron's `--tokenizer-type` name, and the vocabulary-coverage check.

- SentencePieceTokenizer / Llama2Tokenizer / GPTSentencePieceTokenizer: a sentencepiece `.model` (LLaMA 1/2).
- HuggingFaceTokenizer: a local HF `tokenizer.json`, or a directory holding it (LLaMA 3).
- NullTokenizer: text that is already token ids; needs `vocab_size`.

All share `tokenizers.base.Tokenizer`. The model pads its vocabulary (Megatron: a multiple of
make_vocab_size_divisible_by x TP); `check_vocab` verifies that padding still covers every token id.
"""
from __future__ import annotations

import os
from typing import Optional

from llamapipe.data.tokenizers.base import Tokenizer
from llamapipe.data.tokenizers.huggingface_tokenizer import HuggingFaceTokenizer
from llamapipe.data.tokenizers.null_tokenizer import NullTokenizer
from llamapipe.data.tokenizers.sentencepiece_tokenizer import SentencePieceTokenizer

SENTENCEPIECE_TYPES = ("SentencePieceTokenizer", "Llama2Tokenizer", "GPTSentencePieceTokenizer")
TOKENIZER_TYPES = SENTENCEPIECE_TYPES + ("HuggingFaceTokenizer", "NullTokenizer")

__all__ = ["Tokenizer", "SentencePieceTokenizer", "HuggingFaceTokenizer", "NullTokenizer", "TOKENIZER_TYPES",
           "SENTENCEPIECE_TYPES", "build_tokenizer", "infer_tokenizer_type", "check_vocab"]


def infer_tokenizer_type(model_path: str) -> str:
    """The kind a --tokenizer-model path names: a directory or a `.json` file is an HF tokenizer; any other
    file is read as sentencepiece, as before --tokenizer-type existed."""
    if os.path.isdir(model_path) or model_path.endswith(".json"):
        return "HuggingFaceTokenizer"
    return "SentencePieceTokenizer"


def build_tokenizer(model_path: Optional[str], tokenizer_type: Optional[str] = None, *,
                    vocab_size: Optional[int] = None) -> Tokenizer:
    """The tokenizer for --tokenizer-model / --tokenizer-type (inferred from the path when None) / --vocab-size
    (NullTokenizer only)."""
    if tokenizer_type is None:
        if model_path is None:
            raise ValueError("give --tokenizer-model (a sentencepiece .model, or an HF tokenizer.json or its "
                             "directory) or --tokenizer-type NullTokenizer with --vocab-size")
        tokenizer_type = infer_tokenizer_type(model_path)
    if tokenizer_type not in TOKENIZER_TYPES:
        raise ValueError(f"--tokenizer-type {tokenizer_type} is not one of {', '.join(TOKENIZER_TYPES)}")
    if tokenizer_type == "NullTokenizer":
        if vocab_size is None:
            raise ValueError("--tokenizer-type NullTokenizer needs --vocab-size (token ids are 0..vocab-size-1 "
                             "and eod is vocab-size)")
        return NullTokenizer(vocab_size)
    if model_path is None:
        raise ValueError(f"--tokenizer-type {tokenizer_type} needs --tokenizer-model")
    if tokenizer_type == "HuggingFaceTokenizer":
        return HuggingFaceTokenizer(model_path)
    return SentencePieceTokenizer(model_path)


def check_vocab(tokenizer_vocab: int, padded_vocab: int) -> None:
    """Raise when the model's (padded) vocabulary is smaller than the tokenizer's."""
    if padded_vocab < tokenizer_vocab:
        raise ValueError(f"the model's padded vocabulary ({padded_vocab}) is smaller than the tokenizer's "
                         f"vocabulary ({tokenizer_vocab}); raise --vocab-size to at least {tokenizer_vocab}")

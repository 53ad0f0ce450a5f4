"""Tokenizers by Megatron's `--tokenizer-type` name, and the vocabulary-coverage check.

- SentencePieceTokenizer / Llama2Tokenizer / GPTSentencePieceTokenizer: a sentencepiece `.model` (LLaMA 1/2).
- HuggingFaceTokenizer: a local HF `tokenizer.json`, or a directory holding it (LLaMA 3).
- NullTokenizer: text that is already token ids; needs `vocab_size`.

All share `tokenizers.base.Tokenizer`. `model_vocab_size` is the one rule for the model's vocabulary (the
tokenizer's size, or --vocab-size when it says more); the model pads it for its tensors (Megatron: a multiple
of make_vocab_size_divisible_by x TP, `LlamaConfig.padded_vocab_size`).
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
           "SENTENCEPIECE_TYPES", "build_tokenizer", "infer_tokenizer_type", "model_vocab_size",
           "check_special_ids"]


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


def model_vocab_size(tokenizer: Optional[Tokenizer], vocab_size_flag: Optional[int], default: int) -> int:
    """The model's true (unpadded) vocabulary: the tokenizer's size, or --vocab-size when it says more (room
    for ids added later); without a tokenizer, --vocab-size or `default` (the preset's). NullTokenizer's size
    is --vocab-size + 1 (its eod), as in Megatron."""
    if tokenizer is None:
        return vocab_size_flag if vocab_size_flag is not None else default
    vocab = max(tokenizer.vocab_size, vocab_size_flag or 0)
    check_special_ids(tokenizer, vocab)
    return vocab


def check_special_ids(tokenizer: Tokenizer, vocab_size: int) -> None:
    """Raise when a special id the data or generation uses (eod, bos, pad) has no row in the model."""
    specials = {"eod": tokenizer.eos_id, "bos": tokenizer.bos_id, "pad": tokenizer.pad_id}
    for name, token_id in specials.items():
        if token_id is not None and not 0 <= token_id < vocab_size:
            raise ValueError(f"the tokenizer's {name} id {token_id} is outside the model's vocabulary of "
                             f"{vocab_size} (ids 0..{vocab_size - 1}); raise --vocab-size to at least {token_id + 1}")

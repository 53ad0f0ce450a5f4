"""The data config from the flags: one data source, existing files, Megatron's --split, evaluation data.

Megatron takes exactly one source: --mock-data, --data-path (documents split by --split), or per-split
--train-data-path / --valid-data-path / --test-data-path (each dataset used whole). --split is read as
Megatron reads it: the numbers in the string (so '99,1,0' with its quotes from a bash array works),
missing trailing weights are 0 ("99,1" is "99,1,0").
"""
from __future__ import annotations

import argparse
import dataclasses
import math
import os
import re
from typing import Optional, Sequence

from llamapipe.core.config import ArgumentError, DataConfig
from llamapipe.data.tokenizers.base import Tokenizer
from llamapipe.safe_files import kind_of

DEFAULT_SPLIT = "969,30,1"      # Megatron's legacy default when --data-path comes without --split
_PER_SPLIT = ("train_data_path", "valid_data_path", "test_data_path")


def normalize_split(split: str) -> str:
    """Megatron's parse_and_normalize_split without the normalisation: "'99, 1'" -> "99,1,0"."""
    weights = re.findall(r"[.0-9]+", split)
    try:
        values = [float(w) for w in weights]
    except ValueError:
        values = []
    if not 1 <= len(values) <= 3 or sum(values) <= 0:
        raise ArgumentError(f"--split {split} must be up to three non-negative weights for train, valid and test, "
                            "e.g. 969,30,1 or 99,1")
    return ",".join(weights + ["0"] * (3 - len(weights)))


def _data_prefixes(flag: str, data_path: Sequence[str]) -> list[str]:
    """`A B` -> [A, B]; `0.3 A 0.7 B` -> [A, B] (weights checked for form here)."""
    try:
        float(data_path[0])
    except ValueError:
        return list(data_path)
    if len(data_path) % 2:
        raise ArgumentError(f"{flag} with weights needs weight/prefix pairs, got {len(data_path)} values")
    for weight in data_path[0::2]:
        try:
            if not 0 < float(weight) < math.inf:     # NaN and inf parse as floats but weigh nothing
                raise ValueError
        except ValueError:
            raise ArgumentError(f"{flag} weight {weight} must be a positive number") from None
    return list(data_path[1::2])


def _check_files(flag: str, data_path: Sequence[str]) -> None:
    if not data_path:
        raise ArgumentError(f"{flag} needs at least one dataset prefix")
    for prefix in _data_prefixes(flag, data_path):
        if prefix.endswith((".bin", ".idx")):
            raise ArgumentError(f"{flag} {prefix}: give the prefix without .bin/.idx, e.g. {flag} {prefix[:-4]}")
        for ext in (".bin", ".idx"):
            if not os.path.isfile(prefix + ext):
                raise ArgumentError(f"{flag} {prefix}: file {prefix + ext} does not exist")


def _sources(args: argparse.Namespace) -> list[str]:
    sources = ["--mock-data"] if args.mock_data else []
    sources += ["--data-path"] if args.data_path else []
    per_split = [f"--{n.replace('_', '-')}" for n in _PER_SPLIT if getattr(args, n) is not None]
    sources += [" / ".join(per_split)] if per_split else []
    if not sources:
        raise ArgumentError("give --data-path PREFIX (from llamapipe preprocess), --train-data-path PREFIX, "
                            "or --mock-data")
    if len(sources) > 1:
        raise ArgumentError(f"{' and '.join(sources)} are two data sources; give one (as in Megatron-LM)")
    return per_split


def _check_tokenizer(args: argparse.Namespace) -> None:
    if args.tokenizer_model is not None and not os.path.exists(args.tokenizer_model):
        raise ArgumentError(f"--tokenizer-model {args.tokenizer_model} does not exist")
    if args.tokenizer_model is not None and not (os.path.isfile(args.tokenizer_model)
                                                 or os.path.isdir(args.tokenizer_model)):
        raise ArgumentError(f"--tokenizer-model {args.tokenizer_model} is {kind_of(args.tokenizer_model)}, not a "
                            "regular file (a tokenizer model) or a directory (an HF tokenizer)")
    if args.tokenizer_type == "NullTokenizer":
        if args.vocab_size is None:
            raise ArgumentError("--tokenizer-type NullTokenizer needs --vocab-size (its token ids are below it)")
    elif not args.mock_data and args.tokenizer_model is None:
        raise ArgumentError("preprocessed data needs --tokenizer-model (the tokenizer used to preprocess it), "
                            "or --tokenizer-type NullTokenizer with --vocab-size")


def data_config(args: argparse.Namespace) -> DataConfig:
    per_split = _sources(args)
    _check_tokenizer(args)
    if per_split and args.split is not None:
        raise ArgumentError(f"--split {args.split} splits --data-path; with {per_split[0]} each dataset is used whole")
    split = normalize_split(args.split if args.split is not None else DEFAULT_SPLIT)
    if args.data_path:
        _check_files("--data-path", args.data_path)
    for name in _PER_SPLIT:
        if getattr(args, name) is not None:
            _check_files(f"--{name.replace('_', '-')}", getattr(args, name))
    return DataConfig(data_path=tuple(args.data_path or ()), split=split, tokenizer_model=args.tokenizer_model,
                      tokenizer_type=args.tokenizer_type, mock_data=args.mock_data,
                      data_cache_path=args.data_cache_path, num_workers=args.num_workers,
                      vocab_size=args.vocab_size, reset_position_ids=args.reset_position_ids,
                      reset_attention_mask=args.reset_attention_mask, eod_mask_loss=args.eod_mask_loss,
                      **{name: tuple(getattr(args, name) or ()) for name in _PER_SPLIT})


def with_end_of_document(data: DataConfig, tokenizer: Optional[Tokenizer], *, post_validation: bool) -> DataConfig:
    """`data` with the tokenizer's end-of-document id when --reset-position-ids, --reset-attention-mask or
    --eod-mask-loss reads it (Megatron takes it from the tokenizer too)."""
    if not data.packed_documents:
        return data
    if data.eod_mask_loss and post_validation:
        raise ArgumentError("--eod-mask-loss cannot be used with --enable-optimizer-post-validation: post-validation "
                            "divides the gradients by the global batch's token count before the step ends, which "
                            "needs every loss-mask entry to be 1")
    flags = [f"--{n.replace('_', '-')}" for n in ("reset_position_ids", "reset_attention_mask", "eod_mask_loss")
             if getattr(data, n)]
    if tokenizer is None:
        verb = "needs" if len(flags) == 1 else "need"
        raise ArgumentError(f"{' and '.join(flags)} {verb} the end-of-document token id of a tokenizer: give "
                            "--tokenizer-model, or --tokenizer-type NullTokenizer with --vocab-size")
    try:
        return dataclasses.replace(data, eod_id=tokenizer.eod)
    except ValueError as err:
        raise ArgumentError(f"{' and '.join(flags)}: {err}") from None

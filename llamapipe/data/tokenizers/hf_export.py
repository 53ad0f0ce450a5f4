"""Write a run's tokenizer into an HF model directory, so `AutoTokenizer.from_pretrained(dir)` loads it offline.

- SentencePiece `.model` -> `tokenizer.model` + a `tokenizer_config.json` naming `LlamaTokenizer` (transformers
  converts it to its fast tokenizer on load; the `sentencepiece` and `protobuf` packages must be installed).
- HF `tokenizer.json` -> copied as is, with the `tokenizer_config.json` / `special_tokens_map.json` beside it
  when there are any, else a `tokenizer_config.json` naming its special tokens.
- NullTokenizer has no text form, so nothing is written.

A family may add to tokenizer_config.json what transformers needs to build the class it names rather than one
of its own for the model type (qwen2's `auto_map`, `ModelFamily.hf_tokenizer_config`); tests/e2e/
test_hf_export_families.py loads every family's export with both tokenizer kinds through the Auto classes.

An exported sentencepiece model encodes a text to the ids this package's tokenizer gives it, with no bos
prepended, as the data was preprocessed (documents, then eod under --append-eod); this holds for models trained
with LLaMA's settings (`llamapipe train-tokenizer`), as transformers' conversion does not reproduce every
sentencepiece normaliser (e.g. collapsing repeated spaces). A tokenizer.json keeps its own post-processor (LLaMA 3's
prepends bos), as transformers applies it.
"""
from __future__ import annotations

import json
import os
import shutil
from typing import Optional

from llamapipe.safe_files import replace_atomically
from llamapipe.data.tokenizers.base import Tokenizer
from llamapipe.data.tokenizers.huggingface_tokenizer import HuggingFaceTokenizer, tokenizer_file
from llamapipe.data.tokenizers.null_tokenizer import NullTokenizer
from llamapipe.data.tokenizers.sentencepiece_tokenizer import SentencePieceTokenizer

_HF_CONFIG_FILES = ("tokenizer_config.json", "special_tokens_map.json")
OUTPUT_FILES = ("tokenizer.model", "tokenizer.json") + _HF_CONFIG_FILES    # every name this may write


def special_token_ids(tokenizer: Tokenizer) -> dict[str, Optional[int]]:
    """config.json's bos/eos/pad ids, which `generate` reads (eos stops it)."""
    return {"bos_token_id": tokenizer.bos_id, "eos_token_id": tokenizer.eos_id, "pad_token_id": tokenizer.pad_id}


def write_hf_tokenizer(tokenizer: Tokenizer, out_dir: str, model_max_length: int,
                       family_config: Optional[dict] = None) -> list[str]:
    """Write `tokenizer`'s HF files into `out_dir`; returns the file names written (none for NullTokenizer).
    `family_config`: what the model family adds to tokenizer_config.json (`ModelFamily.hf_tokenizer_config`)."""
    family_config = family_config or {}
    if isinstance(tokenizer, NullTokenizer):
        return []
    os.makedirs(out_dir, exist_ok=True)
    specials = {f"{role}_token": tokenizer.id_to_piece(token_id) for role, token_id in
                (("bos", tokenizer.bos_id), ("eos", tokenizer.eos_id), ("pad", tokenizer.pad_id))
                if token_id is not None}
    config = {"add_bos_token": False, "add_eos_token": False, "model_max_length": model_max_length, **specials}
    if isinstance(tokenizer, SentencePieceTokenizer):
        _copy(tokenizer.model_path, os.path.join(out_dir, "tokenizer.model"))
        unk = tokenizer.unk_id
        config.update(tokenizer_class="LlamaTokenizer", legacy=False,
                      **({"unk_token": tokenizer.id_to_piece(unk)} if unk is not None else {}), **family_config)
        _write_json(os.path.join(out_dir, "tokenizer_config.json"), config)
        return ["tokenizer.model", "tokenizer_config.json"]
    assert isinstance(tokenizer, HuggingFaceTokenizer), type(tokenizer)
    source = tokenizer_file(tokenizer.model_path)
    _copy(source, os.path.join(out_dir, "tokenizer.json"))
    beside = [name for name in _HF_CONFIG_FILES if os.path.isfile(os.path.join(os.path.dirname(source), name))]
    for name in beside:
        _copy(os.path.join(os.path.dirname(source), name), os.path.join(out_dir, name))
    if "tokenizer_config.json" not in beside:
        _write_json(os.path.join(out_dir, "tokenizer_config.json"),
                    {"tokenizer_class": "PreTrainedTokenizerFast", **config, **family_config})
        beside.append("tokenizer_config.json")
    elif family_config:
        path = os.path.join(out_dir, "tokenizer_config.json")
        with open(path, encoding="utf-8") as f:
            _write_json(path, {"tokenizer_class": "PreTrainedTokenizerFast", **json.load(f), **family_config})
    return ["tokenizer.json"] + beside


def _write_json(path: str, obj: dict) -> None:
    with replace_atomically(path, "w") as f:     # never through a link planted in the output directory
        json.dump(obj, f, indent=2)


def _copy(source: str, path: str) -> None:
    with open(source, "rb") as src, replace_atomically(path) as dst:
        shutil.copyfileobj(src, dst)

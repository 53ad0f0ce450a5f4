"""HuggingFaceTokenizer: a local HF fast-tokenizer file (`tokenizer.json`, e.g. LLaMA 3's 128,256-token
byte-level BPE) read with the `tokenizers` package. It never reaches the hub: download the file first.

bos/eos/pad come from `tokenizer_config.json` or `special_tokens_map.json` next to the file, as transformers
reads them (LLaMA 3: <|begin_of_text|>, <|end_of_text|>); without either, from the file's special tokens with
a well-known name. Text is encoded without the file's post-processor (LLaMA 3's prepends <|begin_of_text|>),
so every tokenizer kind writes the same layout: a document's ids, then eod under --append-eod. (Megatron's
HuggingFaceTokenizer keeps the post-processor, so its LLaMA 3 documents also start with bos.)
"""
from __future__ import annotations

import json
import os
from typing import Optional, Sequence

from tokenizers import Tokenizer as _HFTokenizer

from llamapipe.data.tokenizers.base import Tokenizer

TOKENIZER_FILE = "tokenizer.json"
_CONFIG_FILES = ("tokenizer_config.json", "special_tokens_map.json")
# Special tokens by role when no config names them: LLaMA 3, LLaMA 2 / sentencepiece conversions, GPT-2, BERT-likes.
_WELL_KNOWN = {"bos": ("<|begin_of_text|>", "<s>", "<bos>", "[BOS]"),
               "eos": ("<|end_of_text|>", "</s>", "<eos>", "<|endoftext|>", "[EOS]"),
               "pad": ("<pad>", "<|pad|>", "[PAD]")}


def tokenizer_file(path: str) -> str:
    """The tokenizer.json a --tokenizer-model path names: the file itself or the one inside a directory."""
    if os.path.isdir(path):
        inner = os.path.join(path, TOKENIZER_FILE)
        if not os.path.isfile(inner):
            raise ValueError(f"--tokenizer-model {path} is a directory without {TOKENIZER_FILE} "
                             "(HuggingFaceTokenizer reads the fast-tokenizer file)")
        return inner
    if not os.path.isfile(path):
        raise ValueError(f"--tokenizer-model {path} is not a local {TOKENIZER_FILE} or a directory holding one; "
                         "HuggingFaceTokenizer never downloads, so fetch the file first (e.g. huggingface-cli "
                         f"download {path} {TOKENIZER_FILE} tokenizer_config.json --local-dir DIR)")
    return path


class HuggingFaceTokenizer(Tokenizer):
    """Thin wrapper over `tokenizers.Tokenizer`; batches go through its multi-threaded `encode_batch`."""

    def __init__(self, model_path: str) -> None:
        self.model_path = model_path
        path = tokenizer_file(model_path)
        try:
            self._tok = _HFTokenizer.from_file(path)
        except Exception as e:   # the Rust side raises a bare Exception for any unreadable file
            raise ValueError(f"--tokenizer-model {path} is not a tokenizers JSON file: {e}") from None
        # A file may carry a model_max_length truncation or padding meant for fine-tuning; documents are whole.
        self._tok.no_truncation()
        self._tok.no_padding()
        self._vocab_size = max(self._tok.get_vocab(with_added_tokens=True).values()) + 1
        named = _configured_special_tokens(os.path.dirname(path))
        self._special = {role: self._special_id(role, named.get(role), path) for role in _WELL_KNOWN}

    def _special_id(self, role: str, token: Optional[str], path: str) -> Optional[int]:
        if token is not None:
            token_id = self._tok.token_to_id(token)
            if token_id is None:
                raise ValueError(f"the tokenizer config next to {path} names {role}_token {token!r}, "
                                 f"which {path} does not hold")
            return token_id
        specials = {t.content: i for i, t in self._tok.get_added_tokens_decoder().items() if t.special}
        return next((specials[name] for name in _WELL_KNOWN[role] if name in specials), None)

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    @property
    def bos_id(self) -> Optional[int]:
        return self._special["bos"]

    @property
    def eos_id(self) -> Optional[int]:
        return self._special["eos"]

    @property
    def pad_id(self) -> Optional[int]:
        return self._special["pad"]

    def _encode_many(self, texts: list[str], num_threads: int) -> list[list[int]]:
        return [e.ids for e in self._tok.encode_batch(texts, add_special_tokens=False)]

    def decode(self, ids: Sequence[int]) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=False)

    def id_to_piece(self, i: int) -> str:
        return self._tok.id_to_token(int(i))


def _configured_special_tokens(directory: str) -> dict[str, str]:
    """role -> token text from the first config file that names it (a string or an AddedToken dict)."""
    named: dict[str, str] = {}
    for name in _CONFIG_FILES:
        path = os.path.join(directory, name)
        if not os.path.isfile(path):
            continue
        try:
            with open(path, encoding="utf-8") as f:
                config = json.load(f)
        except json.JSONDecodeError as e:
            raise ValueError(f"tokenizer config {path} is not valid JSON ({e})") from None
        for role in _WELL_KNOWN:
            value = config.get(f"{role}_token")
            value = value.get("content") if isinstance(value, dict) else value
            if isinstance(value, str):
                named.setdefault(role, value)
    return named

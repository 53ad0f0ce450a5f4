"""The tokenizer a checkpoint was trained with, and the refusal to resume it with another (issue 40).

Token ids mean nothing without their tokenizer: a run resumed with a different tokenizer of the same size
passes every shape check and trains on garbage without a word. So metadata.json records the run's tokenizer
(`{"type", "model": absolute path, "sha256": of its file, "vocab_size": its ids}`; `convert-hf export` reads the
path), and a load compares it with this run's: another file (by its sha256) or another size is refused in one
line unless --allow-tokenizer-change says it is meant. A checkpoint saved before the hash was recorded loads
with a notice; one without a tokenizer (mock data, an HF import) and a run without one are not compared.
"""
from __future__ import annotations

import functools
import hashlib
import os
from typing import Optional

from llamapipe.core.config import DataConfig
from llamapipe.core.logger import get_logger


def tokenizer_record(data: DataConfig) -> Optional[dict]:
    """The run's tokenizer as metadata.json records it; None without one (mock data without a tokenizer)."""
    if data.tokenizer_model is None:
        if data.tokenizer_type != "NullTokenizer":
            return None
        return {"type": "NullTokenizer", "model": None, "sha256": None, "vocab_size": _size(None, "NullTokenizer",
                                                                                          data.vocab_size)}
    from llamapipe.data.tokenizer import infer_tokenizer_type
    kind = data.tokenizer_type or infer_tokenizer_type(data.tokenizer_model)
    path = os.path.abspath(data.tokenizer_model)
    file = _file_of(path, kind)
    return {"type": kind, "model": path, "sha256": _sha256(file, os.stat(file).st_mtime_ns),
            "vocab_size": _size(path, kind, data.vocab_size)}


def _file_of(path: str, kind: str) -> str:
    if kind == "HuggingFaceTokenizer":
        from llamapipe.data.tokenizers.huggingface_tokenizer import tokenizer_file
        return tokenizer_file(path)
    return path


@functools.lru_cache(maxsize=4)
def _sha256(path: str, mtime_ns: int) -> str:
    """Once per file version: every save records it."""
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


@functools.lru_cache(maxsize=4)
def _size(path: Optional[str], kind: str, vocab_size: Optional[int]) -> int:
    from llamapipe.data.tokenizer import build_tokenizer
    return build_tokenizer(path, kind, vocab_size=vocab_size).vocab_size


def check_tokenizer(recorded: Optional[dict], data: DataConfig, ckpt: str, allow_change: bool) -> None:
    """Raise a one-line ValueError when checkpoint `ckpt` was trained with another tokenizer than this run's."""
    current = tokenizer_record(data)
    if recorded is None or current is None:
        return
    if "vocab_size" not in recorded:
        get_logger().info(f"notice: checkpoint {ckpt} records its tokenizer by path only ({recorded.get('model')}), "
                          "saved before tokenizers were checked; this run's is taken to be the same")
        return
    said = {key: (recorded.get(key), current[key]) for key in ("type", "sha256", "vocab_size")}
    if all(was == now for was, now in said.values()):
        return
    message = (f"checkpoint {ckpt} was trained with tokenizer {_name(recorded)} but this run's --tokenizer-model is "
               f"{_name(current)}, so its token ids mean other text")
    if allow_change:
        get_logger().warning(f"{message}; going on (--allow-tokenizer-change)")
        return
    raise ValueError(f"{message}; give the tokenizer it was trained with, or --allow-tokenizer-change if the "
                     "change is meant")


def _name(record: dict) -> str:
    file = f"{record['model']}, sha256 {record['sha256'][:12]}" if record.get("sha256") else record.get("model")
    return f"{record['type']} ({file + ', ' if file else ''}{record['vocab_size']} ids)"

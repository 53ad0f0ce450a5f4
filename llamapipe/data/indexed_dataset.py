"""Megatron-compatible indexed token files: a streaming `.bin/.idx` writer and a validated mmap reader.

Format (Megatron-LM `MMapIndexedDataset`, little-endian):
`.idx` = magic b"MMIDIDX\\x00\\x00" | version uint64 = 1 | dtype code uint8 | sequence count uint64 |
document count uint64 | sequence lengths int32[seq count] | sequence pointers int64[seq count] (byte
offsets into `.bin`) | document indices int64[doc count] (starts with 0, then one entry per document end,
so doc count = documents + 1). `.bin` = the tokens of all sequences back to back.
We write one sequence per document; readers of files with several sequences per document work too.
"""
from __future__ import annotations

import hashlib
import json
import os
import struct
from array import array
from typing import Optional

import numpy as np

from llamapipe.safe_files import (check_target, clear_leftover, create_new, remove_dead_temporaries,
                                       replace_atomically, temporary_name)

MAGIC = b"MMIDIDX\x00\x00"
VERSION = 1
DTYPES: dict[int, type] = {1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64,
                           6: np.float64, 7: np.float32, 8: np.uint16}
_HEADER = struct.Struct("<9sQBQQ")


def dtype_code(dtype: type) -> int:
    for code, dt in DTYPES.items():
        if np.dtype(dt) == np.dtype(dtype):
            return code
    raise ValueError(f"dtype {np.dtype(dtype)} has no Megatron index code")


def best_dtype(vocab_size: int) -> type:
    """Megatron's choice: uint16 tokens when the vocabulary fits comfortably, else int32."""
    return np.uint16 if vocab_size < 65500 else np.int32


def data_file_path(prefix: str) -> str:
    return prefix + ".bin"


def index_file_path(prefix: str) -> str:
    return prefix + ".idx"


class IndexedDatasetWriter:
    """Streams tokens to a temporary file beside `<prefix>.bin`; `finalize()` writes the index and renames both
    into place (`.bin` first, `.idx` last), so an earlier `<prefix>.bin/.idx` stays whole until the new pair
    is complete, and a failed run (`abort()`) leaves neither a partial file nor a stray temporary one.
    `finish()` + `commit()` split `finalize()` for callers that write several datasets at once.
    Memory: 12 bytes per sequence."""

    def __init__(self, prefix: str, dtype: type = np.uint16) -> None:
        self.prefix = prefix
        self.dtype = np.dtype(dtype)
        dtype_code(self.dtype)
        finals = (data_file_path(prefix), index_file_path(prefix))
        for path in finals:     # a link, FIFO or directory there is refused now, not after the whole corpus
            check_target(path)
            remove_dead_temporaries(path)
        # the pid keeps two runs writing the same prefix from sharing a temporary file
        self._tmp = {path: temporary_name(path) for path in finals}
        for tmp in self._tmp.values():
            clear_leftover(tmp)
        self._bin = create_new(self._tmp[data_file_path(prefix)])
        self._lengths = array("i")
        self._doc_idx = array("q", [0])

    def add_document(self, tokens: np.ndarray) -> None:
        """One document as one sequence."""
        self.add_sequences(np.asarray(tokens), np.array([len(tokens)], dtype=np.int32))

    def add_sequences(self, flat_tokens: np.ndarray, lengths: np.ndarray) -> None:
        """Many documents at once: `flat_tokens` is their concatenation, `lengths` their sizes."""
        assert int(lengths.sum()) == len(flat_tokens), "lengths must add up to the token count"
        self._bin.write(np.ascontiguousarray(flat_tokens, dtype=self.dtype).tobytes())
        start = len(self._lengths)
        self._lengths.extend(int(n) for n in lengths)
        self._doc_idx.extend(range(start + 1, start + len(lengths) + 1))

    def finalize(self) -> None:
        self.finish()
        self.commit()

    def finish(self) -> None:
        """Write the index beside the tokens, both still under their temporary names, and fsync both."""
        self._bin.flush()
        os.fsync(self._bin.fileno())
        self._bin.close()
        lengths = np.frombuffer(self._lengths, dtype=np.int32) if self._lengths else np.zeros(0, np.int32)
        pointers = np.zeros(len(lengths), dtype=np.int64)
        np.cumsum(lengths[:-1].astype(np.int64) * self.dtype.itemsize, out=pointers[1:])
        doc_idx = np.frombuffer(self._doc_idx, dtype=np.int64)
        with create_new(self._tmp[index_file_path(self.prefix)]) as f:
            f.write(_HEADER.pack(MAGIC, VERSION, dtype_code(self.dtype), len(lengths), len(doc_idx)))
            f.write(lengths.tobytes())
            f.write(pointers.tobytes())
            f.write(doc_idx.tobytes())
            f.flush()
            os.fsync(f.fileno())

    def commit(self) -> None:
        """Rename the finished pair into place, the index last: a reader that sees the new index sees the
        new tokens too (one that opens between the renames finds sizes that disagree and says so)."""
        for path, tmp in self._tmp.items():
            check_target(path)
            os.replace(tmp, path)

    def abort(self) -> None:
        """Close and delete the temporary files; any earlier `<prefix>.bin/.idx` is untouched."""
        self._bin.close()
        for tmp in self._tmp.values():
            if os.path.exists(tmp):
                os.remove(tmp)


class IndexedDataset:
    """Read-only mmap view of `<prefix>.bin/.idx`; checks magic, version, dtype and sizes on open."""

    def __init__(self, prefix: str) -> None:
        self.prefix = prefix
        idx_path, bin_path = index_file_path(prefix), data_file_path(prefix)
        for path in (idx_path, bin_path):
            if not os.path.isfile(path):
                raise ValueError(f"indexed dataset file {path} does not exist")
        idx = np.memmap(idx_path, dtype=np.uint8, mode="r")
        if len(idx) < _HEADER.size:
            raise ValueError(f"index file {idx_path} is {len(idx)} bytes, shorter than the "
                             f"{_HEADER.size}-byte header")
        magic, version, code, n_seq, n_doc = _HEADER.unpack(idx[:_HEADER.size].tobytes())
        if magic != MAGIC:
            raise ValueError(f"index file {idx_path} has magic {magic!r}, not Megatron's {MAGIC!r}")
        if version != VERSION:
            raise ValueError(f"index file {idx_path} has version {version}, only version {VERSION} is supported")
        if code not in DTYPES:
            raise ValueError(f"index file {idx_path} has dtype code {code}, not one of {sorted(DTYPES)}")
        expected = _HEADER.size + 12 * n_seq + 8 * n_doc
        if len(idx) != expected:
            raise ValueError(f"index file {idx_path} is {len(idx)} bytes but its header of {n_seq} sequences and "
                             f"{n_doc} document indices needs {expected}")
        self.dtype = np.dtype(DTYPES[code])
        off = _HEADER.size
        self.sequence_lengths = np.frombuffer(idx, dtype=np.int32, count=n_seq, offset=off)
        self.sequence_pointers = np.frombuffer(idx, dtype=np.int64, count=n_seq, offset=off + 4 * n_seq)
        self.document_indices = np.frombuffer(idx, dtype=np.int64, count=n_doc, offset=off + 12 * n_seq)
        n_tokens = int(self.sequence_lengths.sum(dtype=np.int64))
        bin_size = os.path.getsize(bin_path)
        if bin_size != n_tokens * self.dtype.itemsize:
            raise ValueError(f"data file {bin_path} is {bin_size} bytes but its index {idx_path} describes "
                             f"{n_tokens} tokens of {self.dtype.itemsize} bytes ({n_tokens * self.dtype.itemsize})")
        self._idx = idx
        self._bin = np.memmap(bin_path, dtype=self.dtype, mode="r") if n_tokens else np.zeros(0, self.dtype)
        self.num_tokens = n_tokens

    def __len__(self) -> int:
        return len(self.sequence_lengths)

    def __getitem__(self, i: int) -> np.ndarray:
        return self.get(i)

    def get(self, i: int, offset: int = 0, length: Optional[int] = None) -> np.ndarray:
        """Tokens `offset : offset + length` of sequence `i` (a view into the mmap)."""
        start = int(self.sequence_pointers[i]) // self.dtype.itemsize + offset
        if length is None:
            length = int(self.sequence_lengths[i]) - offset
        return self._bin[start:start + length]


_SCAN_CHUNK = 1 << 24   # tokens per np.max call: 32 MiB of uint16 at a time, whatever the file's size


def max_token_id(indexed: IndexedDataset) -> int:
    """The largest token id in the `.bin` (-1 when it holds none), one chunked pass over the mmap."""
    tokens = indexed._bin
    return max((int(tokens[i:i + _SCAN_CHUNK].max()) for i in range(0, len(tokens), _SCAN_CHUNK)), default=-1)


def cached_max_token_id(indexed: IndexedDataset, cache_dir: str) -> int:
    """`max_token_id`, kept in a small JSON sidecar under `cache_dir` (Megatron's `.idx` records no maximum).
    The sidecar is keyed by the `.bin`'s absolute path, size and mtime, so a rewritten file is scanned again."""
    bin_path = os.path.abspath(data_file_path(indexed.prefix))
    stat = os.stat(bin_path)
    key = {"bin": bin_path, "size": stat.st_size, "mtime_ns": stat.st_mtime_ns}
    digest = hashlib.md5(bin_path.encode()).hexdigest()[:12]
    sidecar = os.path.join(cache_dir, f"{os.path.basename(indexed.prefix)}_{digest}_max_token_id.json")
    try:
        with open(sidecar) as f:
            saved = json.load(f)
        if {k: saved.get(k) for k in key} == key and isinstance(saved.get("max_token_id"), int):
            return saved["max_token_id"]
    except (OSError, ValueError):
        pass    # no sidecar yet, or a damaged one: scan
    value = max_token_id(indexed)
    try:
        os.makedirs(cache_dir, exist_ok=True)
        with replace_atomically(sidecar, "w") as f:
            json.dump({**key, "max_token_id": value}, f)
    except OSError:
        pass    # a read-only cache only costs the scan next time
    return value

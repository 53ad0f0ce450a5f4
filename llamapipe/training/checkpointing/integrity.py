"""Checksums of checkpoint files: every file is hashed (sha256) while it is written, read back and compared
before the checkpoint is committed, and verified again when it is loaded or by `llamapipe verify-checkpoint`.

Every file is created new (`llamapipe/safe_files.create_new`: nothing already at its name, a planted link included,
is followed or reused) with mode 0666 less the umask, as torch.save would give it. Safetensors shards are
streamed here rather than through safetensors' own writer, which lets the hash see the bytes once, on their
way to the file. A record is
`{"size": bytes, "sha256": hex digest, "rank": writing rank}`; metadata.json holds one per file.
"""
from __future__ import annotations

import hashlib
import io
import json
import os
from typing import Any, Optional

import torch

from llamapipe.safe_files import create_new, replace_atomically

HASH = "sha256"
_READ_CHUNK = 16 << 20
_DTYPES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
           torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
           torch.bool: "BOOL"}


class HashingFile:
    """A file opened for writing that hashes what goes through it; `close` fsyncs and returns the record."""

    def __init__(self, path: str, rank: int = 0):
        self.path, self.rank = path, rank
        self._fh = create_new(path)
        self._hash = hashlib.new(HASH)
        self._size = 0

    def write(self, data: Any) -> None:
        view = memoryview(data).cast("B")
        self._fh.write(view)
        self._hash.update(view)     # releases the GIL for large buffers, like the write
        self._size += view.nbytes

    def close(self) -> dict:
        self._fh.flush()
        os.fsync(self._fh.fileno())
        self._fh.close()
        return {"size": self._size, HASH: self._hash.hexdigest(), "rank": self.rank}

    def abort(self) -> None:
        self._fh.close()


def _write(path: str, rank: int, chunks) -> dict:
    out = HashingFile(path, rank)
    try:
        for chunk in chunks:
            out.write(chunk)
        return out.close()
    except BaseException:
        out.abort()
        raise


def _tensor_bytes(t: torch.Tensor) -> memoryview:
    return memoryview(t.detach().reshape(-1).view(torch.uint8).numpy())


def write_safetensors(path: str, tensors: dict[str, torch.Tensor], metadata: dict[str, str], rank: int = 0) -> dict:
    """A safetensors file (the format's header, then the raw tensors); returns its record.

    Tensors go in order of decreasing element size, so with the header padded to 8 bytes every tensor's
    data is aligned to its element size, as safetensors' own writer arranges it.
    """
    order, raw = safetensors_header(tensors, metadata)
    chunks = [len(raw).to_bytes(8, "little"), raw]
    chunks += (_tensor_bytes(tensors[key].contiguous()) for key in order)
    return _write(path, rank, chunks)


def safetensors_header(tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> tuple[list[str], bytes]:
    """(the keys in file order, the padded JSON header) of a safetensors file of `tensors`; reads only their
    shapes and dtypes, so meta tensors give a file's size without its data (the dry run's checkpoint)."""
    order = sorted(tensors, key=lambda k: (-tensors[k].element_size(), k))
    header: dict[str, Any] = {"__metadata__": metadata}
    offset = 0
    for key in order:
        t = tensors[key]
        assert t.dtype in _DTYPES, f"{key}: dtype {t.dtype} cannot be stored in safetensors"
        nbytes = t.numel() * t.element_size()
        header[key] = {"dtype": _DTYPES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    return order, raw + b" " * (-len(raw) % 8)


def write_torch(path: str, obj: Any, rank: int = 0) -> dict:
    """torch.save of plain containers, numbers and tensors (loadable with weights_only=True); returns its record."""
    buf = io.BytesIO()
    torch.save(obj, buf)
    return _write(path, rank, [buf.getbuffer()])


def write_json(path: str, obj: Any) -> None:
    with replace_atomically(path, "w") as fh:    # fsynced; whole or not at all, never through a link
        json.dump(obj, fh, indent=1, sort_keys=True)


def file_digest(path: str) -> str:
    digest = hashlib.new(HASH)
    buf = bytearray(_READ_CHUNK)
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as fh:
        while True:
            n = fh.readinto(buf)
            if not n:
                return digest.hexdigest()
            digest.update(view[:n])


def file_defect(ckpt_dir: str, fname: str, record: Any, *, checksum: bool = True) -> Optional[str]:
    """None when `fname` matches its record (size always; sha256 when `checksum`), else one phrase naming it."""
    path = os.path.join(ckpt_dir, fname)
    size = record if isinstance(record, int) else record["size"]   # format 1 recorded sizes only
    if not os.path.isfile(path):
        return f"{fname} is missing"
    if os.path.getsize(path) != size:
        return f"{fname} has {os.path.getsize(path)} bytes, metadata says {size}"
    if checksum and isinstance(record, dict) and file_digest(path) != record[HASH]:
        return f"{fname} fails its {HASH} checksum (its bytes changed after it was written)"
    return None


def assign_files(files: dict[str, Any], world_size: int, same_layout: bool) -> dict[str, int]:
    """Which rank verifies which file on load: the rank that wrote it when the layout is unchanged (it reads
    that file anyway), else the least-loaded rank by bytes, biggest files first; every file exactly once."""
    def size(rec: Any) -> int:
        return rec if isinstance(rec, int) else rec["size"]
    if same_layout and all(isinstance(r, dict) and r.get("rank", 0) < world_size for r in files.values()):
        return {f: int(r.get("rank", 0)) for f, r in files.items()}
    loads, owner = [0] * world_size, {}
    for fname in sorted(files, key=lambda f: (-size(files[f]), f)):
        rank = loads.index(min(loads))
        owner[fname], loads[rank] = rank, loads[rank] + size(files[fname])
    return owner


def verify_files(ckpt_dir: str, files: dict[str, Any], only: Optional[set[str]] = None) -> Optional[str]:
    """First defect among `files` (all, or the names in `only`), or None."""
    for fname in sorted(files):
        if only is None or fname in only:
            defect = file_defect(ckpt_dir, fname, files[fname])
            if defect is not None:
                return defect
    return None

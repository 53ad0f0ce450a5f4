"""RedPajama documents from local .jsonl / .jsonl.gz / .json / .parquet files, directories, globs or a hub name.

Records look like `{"text": ..., "meta": {...} or "<json>", "red_pajama_subset": ...}`. Local files are read
by small streaming readers here (memory does not grow with the file); a hub dataset is read through
`datasets.load_dataset(name, streaming=True)` only when the user names one. Bad records (invalid JSON or
UTF-8, missing / non-string / empty text) are skipped and counted in `ReadStats`, which names the file:line
of the first few; with `strict=True` the first bad record raises `ValueError` naming its file:line.

A compressed file (.gz, .parquet) is read through once before any of its documents is used, because a
damaged one fails only somewhere inside (a gzip CRC only at its end): a truncated, corrupt or mislabelled
file is skipped whole and named in `ReadStats.bad_files` (or, when strict, raises `ValueError` naming it).
The check costs a second decompression, small beside tokenizing.
"""
from __future__ import annotations

import glob
import gzip
import json
import os
import zlib
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Iterator, Optional, Sequence, Union

SUFFIXES = (".jsonl", ".jsonl.gz", ".json", ".json.gz", ".parquet")
MAX_EXAMPLES = 5
Record = Union[dict, str]   # a parsed record, or the reason it could not be parsed


@dataclass
class Document:
    texts: dict[str, str]          # json key -> text
    meta: dict
    subset: Optional[str]
    where: str                     # "file:line" (parquet: row number; hub: name:row)


@dataclass
class ReadStats:
    documents: int = 0
    skipped: Counter = field(default_factory=Counter)    # reason -> count
    examples: list[str] = field(default_factory=list)    # "file:line: reason" of the first few
    bad_files: list[str] = field(default_factory=list)   # "file: reason" of every unreadable file, skipped whole

    @property
    def num_skipped(self) -> int:
        return sum(self.skipped.values())

    def skip(self, where: str, reason: str) -> None:
        self.skipped[reason] += 1
        if len(self.examples) < MAX_EXAMPLES:
            self.examples.append(f"{where}: {reason}")

    def summary(self) -> str:
        files = (f"; {len(self.bad_files)} unreadable files skipped: {'; '.join(self.bad_files)}"
                 if self.bad_files else "")
        if not self.skipped:
            return f"{self.documents} documents read, no bad records{files}"
        reasons = ", ".join(f"{n} {r}" for r, n in sorted(self.skipped.items()))
        return (f"{self.documents} documents read, {self.num_skipped} bad records skipped ({reasons}); "
                f"first: {'; '.join(self.examples)}{files}")


def _looks_local(item: str) -> bool:
    """A path rather than a hub name (`org/name`): absolute, relative with dots, ~, or nested deeper."""
    return item.startswith(("/", ".", "~")) or item.count("/") >= 2


def resolve_inputs(inputs: Sequence[str]) -> list[str]:
    """Expand directories (recursive) and globs into sorted data files; other names are hub datasets."""
    out: list[str] = []
    for item in inputs:
        if os.path.isdir(item):
            found = sorted(os.path.join(d, f) for d, _, fs in os.walk(item) for f in fs if f.endswith(SUFFIXES))
            if not found:
                raise ValueError(f"input directory {item} contains no {'/'.join(SUFFIXES)} files")
            out.extend(found)
        elif any(c in item for c in "*?["):
            found = sorted(f for f in glob.glob(item, recursive=True) if f.endswith(SUFFIXES))
            if not found:
                raise ValueError(f"input pattern {item} matches no {'/'.join(SUFFIXES)} files")
            out.extend(found)
        elif (item.endswith(SUFFIXES) or _looks_local(item)) and not os.path.exists(item):
            raise ValueError(f"input {item} does not exist (hub datasets are named like org/name)")
        else:
            out.append(item)
    return out


def iter_documents(inputs: Sequence[str], json_keys: Sequence[str] = ("text",), strict: bool = False,
                   stats: Optional[ReadStats] = None, hub_split: str = "train") -> Iterator[Document]:
    """Valid documents of every input in order; bad ones are counted in `stats` (or raise when strict)."""
    stats = stats if stats is not None else ReadStats()
    for source in resolve_inputs(inputs):
        for where, record in _guarded(source, _records(source, hub_split)):
            if isinstance(record, UnreadableFile):
                if strict:
                    raise ValueError(f"unreadable input file {source}: {record.reason} "
                                     "(drop --strict to skip unreadable files)")
                stats.bad_files.append(f"{source}: {record.reason}")
                continue
            doc_or_reason = _to_document(record, json_keys, where)
            if isinstance(doc_or_reason, Document):
                stats.documents += 1
                yield doc_or_reason
            elif strict:
                raise ValueError(f"bad record at {where}: {doc_or_reason} (drop --strict to skip bad records)")
            else:
                stats.skip(where, doc_or_reason)


@dataclass
class UnreadableFile:
    reason: str


def _read_error(path: str, exc: BaseException) -> str:
    """One phrase for why a file cannot be read (gzip, zlib and pyarrow say it in their own words)."""
    if isinstance(exc, EOFError):
        return "truncated gzip file (its data ends before the end-of-stream marker)"
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    if isinstance(exc, (gzip.BadGzipFile, zlib.error)):
        return f"corrupt gzip file ({text})"
    if path.endswith(".parquet"):
        return f"corrupt parquet file ({text})"
    return f"read error ({text})"


def _read_errors() -> tuple[type, ...]:
    errors: tuple[type, ...] = (OSError, EOFError, zlib.error)
    try:
        import pyarrow
        errors += (pyarrow.ArrowException,)
    except ImportError:
        pass
    return errors


def _guarded(source: str, records: Iterator[tuple[str, Record]]) -> Iterator[tuple[str, Record]]:
    """`records`, but a local file that cannot be read ends as one `UnreadableFile`; a compressed one is read
    through first, so it yields either all its records or none."""
    if not os.path.isfile(source):
        yield from records     # a hub dataset: its own errors are the datasets library's
        return
    errors = _read_errors()
    try:
        if source.endswith((".gz", ".parquet")):
            _read_through(source)
        for item in records:
            yield item
    except errors as exc:
        yield source, UnreadableFile(_read_error(source, exc))


def _read_through(path: str) -> None:
    """Decompress (and for parquet decode) the whole file, discarding it: raises where reading would."""
    if path.endswith(".parquet"):
        import pyarrow.parquet as pq
        for _ in pq.ParquetFile(path).iter_batches(batch_size=4096):
            pass
        return
    with gzip.open(path, "rb") as f:
        while f.read(1 << 20):
            pass


def _records(source: str, hub_split: str) -> Iterator[tuple[str, Record]]:
    if source.endswith(".parquet"):
        return _parquet_records(source)
    if source.endswith(SUFFIXES):
        return _json_records(source)
    return _hub_records(source, hub_split)


def _open(path: str):
    return gzip.open(path, "rb") if path.endswith(".gz") else open(path, "rb")


def _json_records(path: str) -> Iterator[tuple[str, Record]]:
    """JSON lines; a `.json` file whose first byte is `[` is a JSON array (read whole)."""
    with _open(path) as f:
        head = f.peek(64) if hasattr(f, "peek") else b""
        if path.endswith((".json", ".json.gz")) and head.lstrip()[:1] == b"[":
            try:
                items = json.loads(f.read().decode("utf-8"))
            except (UnicodeDecodeError, json.JSONDecodeError) as e:
                yield f"{path}:1", f"invalid JSON array ({type(e).__name__})"
                return
            for i, item in enumerate(items):
                yield f"{path}:item {i + 1}", item
            return
        for lineno, raw in enumerate(f, start=1):
            if not raw.strip():
                continue
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError:
                yield f"{path}:{lineno}", "invalid UTF-8"
                continue
            try:
                yield f"{path}:{lineno}", json.loads(line)
            except json.JSONDecodeError:
                yield f"{path}:{lineno}", "invalid JSON"


def _parquet_records(path: str) -> Iterator[tuple[str, Record]]:
    import pyarrow.parquet as pq
    row = 0
    for batch in pq.ParquetFile(path).iter_batches(batch_size=1024):
        for record in batch.to_pylist():
            row += 1
            yield f"{path}:{row}", record


def _hub_records(name: str, split: str) -> Iterator[tuple[str, Record]]:
    import datasets  # only when a hub dataset is named: this may download
    for i, record in enumerate(datasets.load_dataset(name, split=split, streaming=True)):
        yield f"{name}:{i + 1}", record


def _to_document(record: Record, json_keys: Sequence[str], where: str) -> Union[Document, str]:
    if isinstance(record, str):
        return record
    if not isinstance(record, dict):
        return "not a JSON object"
    texts = {}
    for key in json_keys:
        text = record.get(key)
        if isinstance(text, bytes):
            try:
                text = text.decode("utf-8")
            except UnicodeDecodeError:
                return "invalid UTF-8"
        if text is None:
            return f"missing '{key}'"
        if not isinstance(text, str):
            return f"non-string '{key}'"
        if not text.strip():
            return f"empty '{key}'"
        try:
            text.encode("utf-8")
        except UnicodeEncodeError:
            return "invalid UTF-8"     # lone surrogates from \ud800-style escapes
        texts[key] = text
    return Document(texts=texts, meta=_meta(record.get("meta")), subset=record.get("red_pajama_subset"),
                    where=where)


def _meta(meta: Any) -> dict:
    if isinstance(meta, dict):
        return meta
    if isinstance(meta, str):
        try:
            parsed = json.loads(meta)
        except json.JSONDecodeError:
            return {"raw": meta}
        return parsed if isinstance(parsed, dict) else {"raw": meta}
    return {}

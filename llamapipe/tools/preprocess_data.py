"""Tokenize RedPajama documents into Megatron-compatible `<prefix>_<key>_document.bin/.idx` files.

The main process reads and validates records (streaming); a process pool (tokenizer built once per
worker) batch-encodes them. At most a few batches are in flight, so memory does not depend on corpus size.
The progress bar counts bytes of the input files, so it shows a total and an ETA.

    llamapipe preprocess --input corpus --output-prefix data/corpus \
        --tokenizer-model tokenizer.model --workers 2 --append-eod
    llamapipe preprocess --input corpus --output-prefix data/corpus-llama3 \
        --tokenizer-type HuggingFaceTokenizer --tokenizer-model Meta-Llama-3-8B/ --append-eod
"""
from __future__ import annotations

import itertools
import multiprocessing as mp
import os
import signal
import sys
import time
from collections import deque
from typing import Iterator, Optional, Sequence

import numpy as np
from tqdm import tqdm

from llamapipe.training.flag_parser import FlagParser
from llamapipe.core.logger import get_logger
from llamapipe.data.indexed_dataset import IndexedDatasetWriter, best_dtype
from llamapipe.data.redpajama import Document, ReadStats, iter_documents, resolve_inputs
from llamapipe.data.tokenizer import TOKENIZER_TYPES, build_tokenizer

_worker: dict = {}
_PLAIN_JSON = (".json", ".jsonl")


def output_prefix(prefix: str, key: str) -> str:
    return f"{prefix}_{key}_document"


def _init_worker(tokenizer_args: tuple, json_keys: Sequence[str], append_eod: bool, workers: int) -> None:
    signal.signal(signal.SIGTERM, signal.SIG_DFL)    # the pool's terminate() must end a worker at once
    if workers > 1:
        # The pool is the parallelism; HF's encode_batch would otherwise start a thread per core in every worker.
        os.environ["TOKENIZERS_PARALLELISM"] = "false"
    model_path, tokenizer_type, vocab_size = tokenizer_args
    tokenizer = build_tokenizer(model_path, tokenizer_type, vocab_size=vocab_size)
    _worker.update(tokenizer=tokenizer, keys=tuple(json_keys), append_eod=append_eod,
                   dtype=best_dtype(tokenizer.vocab_size))


def encode_batch(batch: list[dict[str, str]]) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """Per json key: (token counts int32, all tokens concatenated) of a batch of documents."""
    tok, out = _worker["tokenizer"], {}
    for key in _worker["keys"]:
        ids = tok.encode([texts[key] for texts in batch])
        if _worker["append_eod"]:
            for seq in ids:
                seq.append(tok.eod)
        lengths = np.fromiter(map(len, ids), dtype=np.int32, count=len(ids))
        flat = np.fromiter(itertools.chain.from_iterable(ids), dtype=_worker["dtype"], count=int(lengths.sum()))
        out[key] = (lengths, flat)
    return out


class InputProgress:
    """How far the reader is through the inputs, in bytes of the input files (the progress bar's unit).

    Exact at each file's start. Inside a plain .json/.jsonl file a document counts its text's UTF-8 size
    (its line also holds quoting and meta, so this lags a little), capped at the file's size; a compressed
    file (.gz, .parquet) holds several times its size in text, so it counts only when the reader moves on.
    A hub dataset has no size: then `total` is None and positions count documents.
    """

    def __init__(self, files: Sequence[str]) -> None:
        sized = all(os.path.isfile(f) for f in files)
        self._size = {f: os.path.getsize(f) for f in files} if sized else {}
        offsets = list(itertools.accumulate([0] + [self._size.get(f, 0) for f in files]))
        self._start = dict(zip(files, offsets))
        self.total: Optional[int] = offsets[-1] if sized else None
        self.documents, self._file, self._in_file = 0, "", 0

    def after(self, doc: Document) -> int:
        """The position just after `doc`."""
        self.documents += 1
        if self.total is None:
            return self.documents
        path = doc.where.rsplit(":", 1)[0]
        if path != self._file:
            self._file, self._in_file = path, 0
        if path.endswith(_PLAIN_JSON):
            self._in_file += sum(len(text.encode("utf-8")) for text in doc.texts.values())
        return self._start[path] + min(self._in_file, self._size[path])


def _batches(docs: Iterator[Document], size: int, where: InputProgress) -> Iterator[tuple[list[dict], int]]:
    """Batches of documents' texts, each with the input position after its last document."""
    while True:
        batch = list(itertools.islice(docs, size))
        if not batch:
            return
        position = 0
        for doc in batch:
            position = where.after(doc)
        yield [d.texts for d in batch], position


def _progress_bar(total: Optional[int], enabled: bool) -> tqdm:
    if total is None:
        return tqdm(unit="docs", disable=not enabled, mininterval=1.0, desc="tokenizing")
    return tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, disable=not enabled,
                mininterval=1.0, desc="tokenizing")


def preprocess(inputs: Sequence[str], prefix: str, model_path: Optional[str], workers: int = 1,
               json_keys: Sequence[str] = ("text",), append_eod: bool = False, strict: bool = False,
               batch_docs: int = 64, progress: bool = True, tokenizer_type: Optional[str] = None,
               vocab_size: Optional[int] = None) -> dict:
    """Tokenize inputs into one indexed dataset per json key; returns the summary numbers."""
    tokenizer = build_tokenizer(model_path, tokenizer_type, vocab_size=vocab_size)
    if append_eod and tokenizer.eos_id is None:
        raise ValueError(f"--append-eod needs an end-of-text token, and --tokenizer-model {model_path} has none")
    files = resolve_inputs(inputs)
    os.makedirs(os.path.dirname(os.path.abspath(prefix)), exist_ok=True)
    writers: dict[str, IndexedDatasetWriter] = {}
    stats, start = ReadStats(), time.perf_counter()
    try:    # every output appears only once all are complete; a failure leaves the earlier ones as they were
        for k in json_keys:
            writers[k] = IndexedDatasetWriter(output_prefix(prefix, k), best_dtype(tokenizer.vocab_size))
        docs = iter_documents(files, json_keys, strict=strict, stats=stats)
        tokens = _tokenize(docs, InputProgress(files), writers, progress, batch_docs,
                           ((model_path, tokenizer_type, vocab_size), tuple(json_keys), append_eod, workers))
        if stats.documents == 0:    # an empty corpus is never what a run meant: keep any earlier one
            raise ValueError(f"no document could be read from --input ({stats.summary()}); nothing was written "
                             f"and any earlier {output_prefix(prefix, json_keys[0])}.bin/.idx is unchanged")
        for w in writers.values():
            w.finish()
        for w in writers.values():
            w.commit()
    except BaseException:
        for w in writers.values():
            w.abort()
        raise
    elapsed = time.perf_counter() - start
    return {"documents": stats.documents, "tokens": tokens, "skipped": stats.num_skipped,
            "bad_files": len(stats.bad_files), "seconds": elapsed,
            "docs_per_s": stats.documents / elapsed, "tokens_per_s": tokens / elapsed,
            "read_summary": stats.summary(), "outputs": [output_prefix(prefix, k) for k in json_keys]}


class _InProcess:
    """One worker: the batches are encoded in this process (no fork of a process that holds threads)."""

    def __init__(self, initargs: tuple) -> None:
        handler = signal.getsignal(signal.SIGTERM)     # a worker's reset is not this process's
        _init_worker(*initargs)
        signal.signal(signal.SIGTERM, handler)

    def apply_async(self, fn, args: tuple) -> "_Done":
        return _Done(fn(*args))

    def __enter__(self) -> "_InProcess":
        return self

    def __exit__(self, *exc) -> None:
        return None


class _Done:
    def __init__(self, value) -> None:
        self.value = value

    def get(self):
        return self.value


def _pool(workers: int, initargs: tuple):
    """The encoding workers: this process for one, else a pool of spawned processes. Not forked: a fork of a
    process whose other threads hold a lock (torch's, a logging handler's) can leave the child waiting forever,
    which hung the test suite about once a run."""
    if workers == 1:
        return _InProcess(initargs)
    return mp.get_context("spawn").Pool(workers, initializer=_init_worker, initargs=initargs)


def _tokenize(docs: Iterator[Document], where: InputProgress, writers: dict[str, IndexedDatasetWriter],
              progress: bool, batch_docs: int, initargs: tuple) -> int:
    """Encode `docs` in a process pool and append them to `writers`; returns the first json key's token count."""
    json_keys, workers, tokens = initargs[1], initargs[3], 0
    pending: deque = deque()
    with _progress_bar(where.total, progress) as bar, _pool(workers, initargs) as pool:
        def drain(keep: int) -> None:
            nonlocal tokens
            while len(pending) > keep:
                task, position = pending.popleft()
                result = task.get()
                for key, (lengths, flat) in result.items():
                    writers[key].add_sequences(flat, lengths)
                tokens += len(result[json_keys[0]][1])
                bar.update(position - bar.n)
        for batch, position in _batches(docs, batch_docs, where):
            pending.append((pool.apply_async(encode_batch, (batch,)), position))
            drain(keep=4 * workers)   # bounded: a few batches in flight per worker
        drain(keep=0)
        if where.total is not None:   # the last file's tail (compressed, or quoting and meta) is read by now
            bar.update(where.total - bar.n)
    return tokens


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = FlagParser(prog="llamapipe preprocess", description=__doc__.splitlines()[0])
    p.add_argument("--input", nargs="+", required=True, help="files (.jsonl, .jsonl.gz, .json, .parquet), "
                   "directories, globs, or a hub dataset name (downloads)")
    p.add_argument("--output-prefix", required=True, help="writes PREFIX_<json key>_document.bin/.idx")
    p.add_argument("--tokenizer-type", default=None, choices=TOKENIZER_TYPES,
                   help="default: from --tokenizer-model (a directory or .json file: HuggingFaceTokenizer, "
                   "otherwise SentencePieceTokenizer)")
    p.add_argument("--tokenizer-model", default=None,
                   help="a sentencepiece .model, or a local HF tokenizer.json or the directory holding it")
    p.add_argument("--vocab-size", type=int, default=None,
                   help="NullTokenizer only: ids are 0..N-1 and eod is N (default: none)")
    p.add_argument("--workers", type=int, default=1)
    p.add_argument("--json-keys", nargs="+", default=["text"])
    p.add_argument("--append-eod", action="store_true", help="append the eod (end-of-text) token to every document")
    p.add_argument("--strict", action="store_true", help="stop at the first bad record instead of skipping it")
    p.add_argument("--batch-docs", type=int, default=64, help="documents per worker task")
    p.add_argument("--no-progress", action="store_true")
    args = p.parse_args(argv)
    if args.workers < 1 or args.batch_docs < 1:
        raise SystemExit(f"--workers {args.workers} and --batch-docs {args.batch_docs} must be at least 1")
    # SIGTERM (a scheduler's kill) unwinds like Ctrl-C, so the temporary outputs are removed
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    try:
        s = preprocess(args.input, args.output_prefix, args.tokenizer_model, args.workers, args.json_keys,
                       args.append_eod, args.strict, args.batch_docs, not args.no_progress,
                       args.tokenizer_type, args.vocab_size)
    except (ValueError, OSError) as e:     # bad input, or a link or FIFO where an output goes
        raise SystemExit(str(e)) from None
    log = get_logger()
    log.info(s["read_summary"])
    log.info(f"documents {s['documents']} | tokens {s['tokens']} | skipped records {s['skipped']} | "
             f"unreadable files {s['bad_files']} | "
             f"{s['seconds']:.2f}s | {s['docs_per_s']:.0f} docs/s | {s['tokens_per_s']:.0f} tokens/s")
    log.info("wrote " + ", ".join(f"{o}.bin/.idx" for o in s["outputs"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())

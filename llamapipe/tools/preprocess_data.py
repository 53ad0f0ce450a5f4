"""Tokenize RedPajama documents into Megatron-compatible `<prefix>_<key>_document.bin/.idx` files.

The main process reads and validates records (streaming); a process pool (tokenizer built once per
worker) batch-encodes them. At most a few batches are in flight, so memory does not depend on corpus size.

    python scripts/preprocess_data.py --input corpus --output-prefix data/corpus \
        --tokenizer-model tokenizer.model --workers 2 --append-eod
"""
from __future__ import annotations

import argparse
import itertools
import multiprocessing as mp
import os
import sys
import time
from collections import deque
from typing import Iterator, Optional, Sequence


import numpy as np
from tqdm import tqdm

from llamapipe.data.indexed_dataset import IndexedDatasetWriter, best_dtype
from llamapipe.data.redpajama import ReadStats, iter_documents
from llamapipe.data.tokenizer import build_tokenizer

_worker: dict = {}


def output_prefix(prefix: str, key: str) -> str:
    return f"{prefix}_{key}_document"


def _init_worker(model_path: str, json_keys: Sequence[str], append_eod: bool) -> None:
    tokenizer = build_tokenizer(model_path)
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


def _batches(docs: Iterator, size: int) -> Iterator[list[dict[str, str]]]:
    while True:
        batch = [d.texts for d in itertools.islice(docs, size)]
        if not batch:
            return
        yield batch


def preprocess(inputs: Sequence[str], prefix: str, model_path: str, workers: int = 1,
               json_keys: Sequence[str] = ("text",), append_eod: bool = False, strict: bool = False,
               batch_docs: int = 64, progress: bool = True) -> dict:
    """Tokenize inputs into one indexed dataset per json key; returns the summary numbers."""
    tokenizer = build_tokenizer(model_path)
    os.makedirs(os.path.dirname(os.path.abspath(prefix)), exist_ok=True)
    writers = {k: IndexedDatasetWriter(output_prefix(prefix, k), best_dtype(tokenizer.vocab_size))
               for k in json_keys}
    stats, tokens, start = ReadStats(), 0, time.perf_counter()
    docs = iter_documents(inputs, json_keys, strict=strict, stats=stats)
    bar = tqdm(unit="docs", disable=not progress, mininterval=1.0, desc="tokenizing")
    pending: deque = deque()
    with mp.Pool(workers, initializer=_init_worker, initargs=(model_path, tuple(json_keys), append_eod)) as pool:
        def drain(keep: int) -> None:
            nonlocal tokens
            while len(pending) > keep:
                result = pending.popleft().get()
                for key, (lengths, flat) in result.items():
                    writers[key].add_sequences(flat, lengths)
                tokens += len(result[json_keys[0]][1])
                bar.update(len(result[json_keys[0]][0]))
        for batch in _batches(docs, batch_docs):
            pending.append(pool.apply_async(encode_batch, (batch,)))
            drain(keep=4 * workers)   # bounded: a few batches in flight per worker
        drain(keep=0)
    bar.close()
    for w in writers.values():
        w.finalize()
    elapsed = time.perf_counter() - start
    return {"documents": stats.documents, "tokens": tokens, "skipped": stats.num_skipped, "seconds": elapsed,
            "docs_per_s": stats.documents / elapsed, "tokens_per_s": tokens / elapsed,
            "read_summary": stats.summary(), "outputs": [output_prefix(prefix, k) for k in json_keys]}


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--input", nargs="+", required=True, help="files (.jsonl, .jsonl.gz, .json, .parquet), "
                   "directories, globs, or a hub dataset name (downloads)")
    p.add_argument("--output-prefix", required=True)
    p.add_argument("--tokenizer-model", required=True)
    p.add_argument("--workers", type=int, default=1)
    p.add_argument("--json-keys", nargs="+", default=["text"])
    p.add_argument("--append-eod", action="store_true", help="append the eos token to every document")
    p.add_argument("--strict", action="store_true", help="stop at the first bad record instead of skipping it")
    p.add_argument("--batch-docs", type=int, default=64, help="documents per worker task")
    p.add_argument("--no-progress", action="store_true")
    args = p.parse_args(argv)
    if args.workers < 1 or args.batch_docs < 1:
        raise SystemExit(f"--workers {args.workers} and --batch-docs {args.batch_docs} must be at least 1")
    try:
        s = preprocess(args.input, args.output_prefix, args.tokenizer_model, args.workers, args.json_keys,
                       args.append_eod, args.strict, args.batch_docs, not args.no_progress)
    except ValueError as e:
        raise SystemExit(str(e)) from None
    print(s["read_summary"])
    print(f"documents {s['documents']} | tokens {s['tokens']} | skipped records {s['skipped']} | "
          f"{s['seconds']:.2f}s | {s['docs_per_s']:.0f} docs/s | {s['tokens_per_s']:.0f} tokens/s")
    print("wrote " + ", ".join(f"{o}.bin/.idx" for o in s["outputs"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Build a small real-text corpus in RedPajama format from text already on this machine (no network).

Sources, in sorted order: docstrings of the Python standard library's modules, classes and functions
(subset "stdlib_docstrings"), their source comments ("stdlib_comments"), and plain-text files under
/usr/share/doc ("system_docs"). One document per module or file; `meta` names the source. The output is
deterministic (same bytes on every run on the same machine): shards shard_00..NN.jsonl, the last one
gzip-compressed with a fixed header.

    llamapipe make-sample-corpus --out runs/sample_corpus --max-mb 4
"""
from __future__ import annotations

import ast
import gzip
import io
import json
import os
import sys
import sysconfig
import tokenize
from typing import Iterator

from llamapipe.training.flag_parser import FlagParser
from llamapipe.safe_files import replace_atomically


SKIP_DIRS = {"test", "tests", "idlelib", "site-packages", "dist-packages", "__pycache__", "lib2to3"}
MIN_CHARS = 200


def stdlib_files(root: str) -> list[str]:
    found = []
    for d, dirs, files in os.walk(root):
        dirs[:] = sorted(x for x in dirs if x not in SKIP_DIRS and not x.startswith("."))
        found += [os.path.join(d, f) for f in files if f.endswith(".py")]
    return sorted(found)


def module_name(root: str, path: str) -> str:
    rel = os.path.relpath(path, root)[:-3].replace(os.sep, ".")
    return rel[:-9] if rel.endswith(".__init__") else rel


def docstrings(source: str) -> str:
    tree = ast.parse(source)
    nodes = [tree] + [n for n in ast.walk(tree)
                      if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))]
    return "\n\n".join(d for d in (ast.get_docstring(n) for n in nodes) if d)


def comments(source: str) -> str:
    lines = [tok.string.lstrip("#").strip() for tok in tokenize.generate_tokens(io.StringIO(source).readline)
             if tok.type == tokenize.COMMENT]
    return "\n".join(line for line in lines if len(line) > 2 and not line.startswith("!"))


def stdlib_documents() -> Iterator[dict]:
    root = sysconfig.get_paths()["stdlib"]
    for path in stdlib_files(root):
        try:
            source = open(path, encoding="utf-8").read()
            parts = (("stdlib_docstrings", docstrings(source)), ("stdlib_comments", comments(source)))
        except (SyntaxError, UnicodeDecodeError, tokenize.TokenError, ValueError):
            continue
        for subset, text in parts:
            if len(text) >= MIN_CHARS:
                yield {"text": text, "meta": {"source": module_name(root, path), "kind": subset},
                       "red_pajama_subset": subset}


def system_doc_documents(root: str = "/usr/share/doc") -> Iterator[dict]:
    paths = sorted(os.path.join(d, f) for d, _, fs in os.walk(root) for f in fs)
    for path in paths:
        if path.endswith((".gz", ".html", ".png", ".svg", ".jpg")) or os.path.islink(path):
            continue
        try:
            text = open(path, encoding="utf-8").read()
        except (UnicodeDecodeError, OSError):
            continue
        if len(text.strip()) >= MIN_CHARS:
            yield {"text": text, "meta": {"source": os.path.relpath(path, root), "kind": "system_docs"},
                   "red_pajama_subset": "system_docs"}


def write_corpus(out: str, max_bytes: int, num_shards: int) -> tuple[int, int]:
    """Write up to max_bytes of text into num_shards shards; returns (documents, text bytes)."""
    os.makedirs(out, exist_ok=True)
    shards = [io.BytesIO() for _ in range(num_shards)]
    docs = total = 0
    sources = (stdlib_documents(), system_doc_documents())
    # alternate the two sources so a small --max-mb still mixes every subset
    for record in _interleave(*sources):
        size = len(record["text"].encode("utf-8"))
        if total + size > max_bytes:
            break
        shards[docs % num_shards].write((json.dumps(record, ensure_ascii=False) + "\n").encode("utf-8"))
        docs, total = docs + 1, total + size
    for i, shard in enumerate(shards):
        path = os.path.join(out, f"shard_{i:02d}.jsonl")
        if i == num_shards - 1:
            with replace_atomically(path + ".gz") as f, gzip.GzipFile(filename="", mode="wb", fileobj=f,
                                                                       mtime=0) as gz:
                gz.write(shard.getvalue())
        else:
            with replace_atomically(path) as f:     # never through a link (llamapipe/safe_files)
                f.write(shard.getvalue())
    return docs, total


def _interleave(a: Iterator[dict], b: Iterator[dict], ratio: int = 4) -> Iterator[dict]:
    """ratio records of a, then one of b, until both are exhausted."""
    while True:
        batch = [r for _, r in zip(range(ratio), a)] + [r for _, r in zip(range(1), b)]
        if not batch:
            return
        yield from batch


def main(argv=None) -> int:
    p = FlagParser(prog="llamapipe make-sample-corpus", description=__doc__.splitlines()[0])
    p.add_argument("--out", default=os.path.join("runs", "sample_corpus"),
                   help="output directory (default runs/sample_corpus)")
    p.add_argument("--max-mb", type=float, default=4.0, help="stop after this many MB of text")
    p.add_argument("--num-shards", type=int, default=4, help="shards; the last one is .jsonl.gz")
    args = p.parse_args(argv)
    if args.max_mb <= 0 or args.num_shards < 1:
        raise SystemExit(f"--max-mb {args.max_mb} must be positive and --num-shards {args.num_shards} at least 1")
    docs, total = write_corpus(args.out, int(args.max_mb * 1e6), args.num_shards)
    print(f"wrote {docs} documents, {total / 1e6:.2f} MB of text, into {args.num_shards} shards under {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

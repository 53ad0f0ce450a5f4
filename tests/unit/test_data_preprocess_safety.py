"""`llamapipe preprocess` never leaves half-written output: a failed re-run keeps the earlier corpus byte for byte
and leaves no temporary file; a damaged compressed input (truncated or CRC-failing .gz, a .gz that is not gzip,
a corrupt parquet) is skipped whole and named in the summary, or stops a --strict run in one line naming it."""
from __future__ import annotations

import gzip
import json
import os

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from llamapipe.data.indexed_dataset import IndexedDataset, IndexedDatasetWriter
from llamapipe.tools import preprocess_data

VOCAB = 100          # NullTokenizer: a text is its ids; eod is 100
DOCS = [[i, i + 1, (3 * i) % VOCAB] for i in range(40)]


def _lines(docs) -> bytes:
    return b"".join((json.dumps({"text": " ".join(map(str, d))}) + "\n").encode() for d in docs)


def _run(inputs, prefix, *extra) -> int:
    return preprocess_data.main(["--input", *map(str, inputs), "--output-prefix", str(prefix),
                                 "--tokenizer-type", "NullTokenizer", "--vocab-size", str(VOCAB), "--append-eod",
                                 "--workers", "1", "--batch-docs", "8", "--no-progress", *extra])


def _snapshot(directory) -> dict[str, bytes]:
    return {name: (directory / name).read_bytes() for name in sorted(os.listdir(directory))}


def _docs_of(prefix) -> list[list[int]]:
    """The documents in an indexed dataset, without their eod."""
    ds = IndexedDataset(str(prefix) + "_text_document")
    return [ds[i].tolist()[:-1] for i in range(len(ds))]


@pytest.fixture
def first_run(tmp_path):
    """A good run's outputs, in a directory of their own."""
    good = tmp_path / "good.jsonl"
    good.write_bytes(_lines(DOCS))
    out = tmp_path / "out"
    assert _run([good], out / "corpus") == 0
    assert _docs_of(out / "corpus") == DOCS
    return good, out


def test_failing_strict_rerun_leaves_the_earlier_corpus_byte_identical(tmp_path, first_run):
    good, out = first_run
    before = _snapshot(out)
    assert sorted(before) == ["corpus_text_document.bin", "corpus_text_document.idx"]
    bad = tmp_path / "bad.jsonl"
    bad.write_bytes(_lines(DOCS[:30]) + b"{not json\n")     # 30 documents reach the writer before the bad line
    with pytest.raises(SystemExit, match=f"bad record at {bad}:31: invalid JSON"):
        _run([good, bad], out / "corpus", "--strict")
    assert _snapshot(out) == before, "the earlier corpus changed, or a temporary file was left"


def test_error_inside_a_worker_leaves_the_earlier_corpus_byte_identical(tmp_path, first_run):
    good, out = first_run
    before = _snapshot(out)
    late = tmp_path / "late.jsonl"     # the tokenizer fails on the last batch, after earlier batches were written
    late.write_bytes(_lines(DOCS) + (json.dumps({"text": "not ids"}) + "\n").encode())
    with pytest.raises(SystemExit, match="NullTokenizer reads token ids"):
        _run([late], out / "corpus")
    assert _snapshot(out) == before


def test_writer_abort_removes_its_temporary_files_and_keeps_the_old_pair(tmp_path):
    w = IndexedDatasetWriter(str(tmp_path / "x"))
    w.add_document(np.arange(5))
    w.finalize()
    before = _snapshot(tmp_path)
    w = IndexedDatasetWriter(str(tmp_path / "x"))
    w.add_document(np.arange(7))
    assert len(os.listdir(tmp_path)) == 3, "the new tokens go to a temporary file, not over the old .bin"
    w.finish()
    w.abort()
    assert _snapshot(tmp_path) == before
    assert IndexedDataset(str(tmp_path / "x"))[0].tolist() == list(range(5))


def _damaged(tmp_path) -> dict[str, tuple]:
    """name -> (path, what the summary must say about it)."""
    packed = gzip.compress(_lines(DOCS[:10]))
    crc = bytearray(packed)
    crc[-8] ^= 0xFF                     # the trailer's CRC32: the data inflates fine, the check fails at the end
    pq.write_table(pa.Table.from_pylist([{"text": "1 2 3"}] * 50), tmp_path / "ok.parquet")
    pq_bytes = (tmp_path / "ok.parquet").read_bytes()
    files = {"truncated.jsonl.gz": (packed[:len(packed) // 2], "truncated gzip file"),
             "crc.jsonl.gz": (bytes(crc), "corrupt gzip file (CRC check failed"),
             "plain.jsonl.gz": (_lines(DOCS[:10]), "corrupt gzip file (Not a gzipped file"),
             "cut.parquet": (pq_bytes[:len(pq_bytes) // 2], "corrupt parquet file")}
    out = {}
    for name, (data, says) in files.items():
        (tmp_path / name).write_bytes(data)
        out[name] = (tmp_path / name, says)
    return out


def test_damaged_compressed_inputs_are_skipped_whole_and_named(tmp_path, llamapipe_log):
    damaged = _damaged(tmp_path)
    good = tmp_path / "good.jsonl"
    good.write_bytes(_lines(DOCS))
    out = tmp_path / "out"
    assert _run([good, *(p for p, _ in damaged.values())], out / "corpus") == 0
    assert _docs_of(out / "corpus") == DOCS, "only the good file's documents, none from a damaged file"
    summary = next(m for m in llamapipe_log if "unreadable files skipped" in m)
    assert "4 unreadable files skipped" in summary, summary
    for path, says in damaged.values():
        assert f"{path}: {says}" in summary, (path, summary)
    assert any("unreadable files 4" in m for m in llamapipe_log)


@pytest.mark.parametrize("name", ["truncated.jsonl.gz", "crc.jsonl.gz", "plain.jsonl.gz", "cut.parquet"])
def test_strict_stops_at_a_damaged_compressed_input_in_one_line(tmp_path, first_run, name):
    good, out = first_run
    before = _snapshot(out)
    path, says = _damaged(tmp_path)[name]
    with pytest.raises(SystemExit) as info:
        _run([good, path], out / "corpus", "--strict")
    message = str(info.value)
    assert message.startswith(f"unreadable input file {path}: {says}") and "\n" not in message, message
    assert _snapshot(out) == before


def test_a_rerun_whose_only_input_is_unreadable_keeps_the_earlier_corpus(tmp_path, first_run):
    """Issue 40: before, "0 documents read ... 1 unreadable files skipped", exit 0 and an empty corpus in place."""
    _, out = first_run
    before = _snapshot(out)
    path, says = _damaged(tmp_path)["truncated.jsonl.gz"]
    with pytest.raises(SystemExit) as info:
        _run([path], out / "corpus")
    message = str(info.value)
    assert message.startswith("no document could be read from --input (0 documents read") and "\n" not in message
    assert f"{path}: {says}" in message and "is unchanged" in message, message
    assert _snapshot(out) == before


def _dead_pid() -> int:
    import subprocess
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


def test_a_killed_runs_temporary_files_are_removed_by_the_next_run(tmp_path, first_run):
    """A preprocess killed (SIGKILL) before its rename leaves `<output>.bin.tmp<pid>`, corpus-sized; the next run
    removes it. A temporary file of a writer that still runs (here: this test's process) is left alone."""
    good, out = first_run
    bin_path = out / "corpus_text_document.bin"
    dead = out / f"corpus_text_document.bin.tmp{_dead_pid()}"
    dead.write_bytes(b"\0" * 4096)
    running = out / f"corpus_text_document.idx.tmp{os.getppid()}"
    running.write_bytes(b"partial")
    assert _run([good], out / "corpus") == 0
    assert not dead.exists() and running.exists()
    assert sorted(os.listdir(out)) == sorted([bin_path.name, "corpus_text_document.idx", running.name])
    assert _docs_of(out / "corpus") == DOCS


@pytest.mark.parametrize("kind", ["symlink", "fifo", "directory"])
def test_a_link_fifo_or_directory_at_an_output_is_refused_and_its_target_untouched(tmp_path, kind):
    """Issue 40: a link planted at an output name made the writer overwrite the link's target."""
    good = tmp_path / "good.jsonl"
    good.write_bytes(_lines(DOCS))
    out = tmp_path / "out"
    out.mkdir()
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    planted = out / "corpus_text_document.idx"
    {"symlink": lambda: planted.symlink_to(victim), "fifo": lambda: os.mkfifo(planted),
     "directory": planted.mkdir}[kind]()
    with pytest.raises(SystemExit) as info:
        _run([good], out / "corpus")
    what = {"symlink": "a symbolic link", "fifo": "a FIFO (named pipe)", "directory": "a directory"}[kind]
    assert str(info.value) == f"{planted} is {what}; llamapipe writes only regular files, never through a link " \
                              "(remove it or choose another path)"
    assert victim.read_text() == "precious"
    assert sorted(os.listdir(out)) == [planted.name], "nothing written, no temporary file left"

"""Megatron .bin/.idx format: exact bytes against a hand-built index, round trip, clear errors on corruption."""
import struct

import numpy as np
import pytest

from llamapipe.data.indexed_dataset import IndexedDataset, IndexedDatasetWriter, best_dtype

DOCS = [[5, 6, 7], [1], [300, 2, 9, 9]]


def _write(prefix, docs=DOCS, dtype=np.uint16):
    w = IndexedDatasetWriter(str(prefix), dtype)
    for d in docs:
        w.add_document(np.array(d))
    w.finalize()
    return str(prefix)


def _hand_index(docs, code, itemsize):
    """The index bytes written straight from the format description (independent of the writer)."""
    lengths = [len(d) for d in docs]
    pointers = [sum(lengths[:i]) * itemsize for i in range(len(docs))]
    doc_idx = list(range(len(docs) + 1))
    return (b"MMIDIDX\x00\x00" + struct.pack("<Q", 1) + struct.pack("<B", code)
            + struct.pack("<Q", len(docs)) + struct.pack("<Q", len(doc_idx))
            + struct.pack(f"<{len(docs)}i", *lengths) + struct.pack(f"<{len(docs)}q", *pointers)
            + struct.pack(f"<{len(doc_idx)}q", *doc_idx))


@pytest.mark.parametrize("dtype,code", [(np.uint16, 8), (np.int32, 4)])
def test_writer_bytes_match_hand_built_index(tmp_path, dtype, code):
    prefix = _write(tmp_path / "d", dtype=dtype)
    itemsize = np.dtype(dtype).itemsize
    assert open(prefix + ".idx", "rb").read() == _hand_index(DOCS, code, itemsize)
    fmt = "<" + ("H" if itemsize == 2 else "i") * 8
    assert open(prefix + ".bin", "rb").read() == struct.pack(fmt, *[t for d in DOCS for t in d])


def test_batched_add_equals_per_document(tmp_path):
    a = _write(tmp_path / "a")
    w = IndexedDatasetWriter(str(tmp_path / "b"))
    w.add_sequences(np.array([t for d in DOCS for t in d]), np.array([len(d) for d in DOCS]))
    w.finalize()
    for ext in (".bin", ".idx"):
        assert open(a + ext, "rb").read() == open(str(tmp_path / "b") + ext, "rb").read()


def test_reader_round_trip(tmp_path):
    ds = IndexedDataset(_write(tmp_path / "d"))
    assert len(ds) == 3 and ds.num_tokens == 8 and ds.dtype == np.uint16
    assert [ds[i].tolist() for i in range(3)] == DOCS
    assert ds.get(2, offset=1, length=2).tolist() == [2, 9]
    assert ds.document_indices.tolist() == [0, 1, 2, 3]


def test_best_dtype_follows_megatron():
    assert best_dtype(32000) == np.uint16 and best_dtype(65499) == np.uint16
    assert best_dtype(65500) == np.int32 and best_dtype(128256) == np.int32


def _corrupt(path, offset, data):
    raw = bytearray(open(path, "rb").read())
    raw[offset:offset + len(data)] = data
    open(path, "wb").write(bytes(raw))


@pytest.mark.parametrize("how,message", [
    ("magic", "has magic"), ("version", "has version 2"), ("dtype", "dtype code 9"),
    ("truncate_idx", "bytes but its header"), ("truncate_bin", "describes 8 tokens"),
    ("short_idx", "shorter than the")])
def test_corruption_is_reported_with_file_name(tmp_path, how, message):
    prefix = _write(tmp_path / "d")
    idx, bin_ = prefix + ".idx", prefix + ".bin"
    if how == "magic":
        _corrupt(idx, 0, b"XXIDIDX")
    elif how == "version":
        _corrupt(idx, 9, struct.pack("<Q", 2))
    elif how == "dtype":
        _corrupt(idx, 17, b"\x09")
    elif how == "truncate_idx":
        open(idx, "r+b").truncate(40)
    elif how == "truncate_bin":
        open(bin_, "r+b").truncate(10)
    else:
        open(idx, "r+b").truncate(5)
    with pytest.raises(ValueError, match=message) as err:
        IndexedDataset(prefix)
    assert (bin_ if how == "truncate_bin" else idx) in str(err.value)


def test_missing_file_named(tmp_path):
    with pytest.raises(ValueError, match="nope.idx does not exist"):
        IndexedDataset(str(tmp_path / "nope"))

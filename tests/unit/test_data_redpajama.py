"""RedPajama readers: bad records skipped and counted (or rejected with file:line), every format reads alike."""
import gzip
import json
import os

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from llamapipe.data.redpajama import ReadStats, iter_documents, resolve_inputs
from llamapipe.data.tokenizer import build_tokenizer, model_vocab_size

GOOD = [{"text": f"document number {i} with some words", "meta": {"id": i}, "red_pajama_subset": "book"}
        for i in range(5)]


def _jsonl(path, records):
    with open(path, "wb") as f:
        for r in records:
            f.write(r if isinstance(r, bytes) else (json.dumps(r) + "\n").encode())
    return str(path)


def test_bad_records_are_skipped_and_counted(tmp_path):
    lines = [GOOD[0], b"{not json\n", {"meta": {}}, GOOD[1], {"text": 7}, {"text": "   "},
             b'{"text": "caf\xe9 latin-1"}\n', b'{"text": "lone \\ud800 surrogate"}\n', b"[1, 2]\n", GOOD[2]]
    path = _jsonl(tmp_path / "bad.jsonl", lines)
    stats = ReadStats()
    docs = list(iter_documents([path], stats=stats))
    assert [d.texts["text"] for d in docs] == [g["text"] for g in GOOD[:3]]
    assert [d.where for d in docs] == [f"{path}:1", f"{path}:4", f"{path}:10"]
    assert stats.documents == 3 and stats.num_skipped == 7
    assert stats.skipped == {"invalid JSON": 1, "missing 'text'": 1, "non-string 'text'": 1, "empty 'text'": 1,
                             "invalid UTF-8": 2, "not a JSON object": 1}
    assert stats.examples[0] == f"{path}:2: invalid JSON" and len(stats.examples) == 5
    assert "7 bad records skipped" in stats.summary() and f"{path}:3: missing 'text'" in stats.summary()


def test_strict_rejects_first_bad_record_with_file_line(tmp_path):
    path = _jsonl(tmp_path / "bad.jsonl", [GOOD[0], GOOD[1], {"text": ""}])
    with pytest.raises(ValueError, match=f"bad record at {path}:3: empty 'text'"):
        list(iter_documents([path], strict=True))


def test_gz_parquet_json_array_read_the_same_documents(tmp_path):
    records = GOOD[:3] + [{"text": "meta as a string", "meta": json.dumps({"src": "x"}),
                           "red_pajama_subset": "arxiv"}]
    plain = _jsonl(tmp_path / "a.jsonl", records)
    with gzip.open(tmp_path / "b.jsonl.gz", "wb") as f:
        f.write(open(plain, "rb").read())
    as_strings = [{**r, "meta": r["meta"] if isinstance(r["meta"], str) else json.dumps(r["meta"])} for r in records]
    pq.write_table(pa.Table.from_pylist(as_strings), tmp_path / "c.parquet")   # parquet meta is a JSON string
    (tmp_path / "d.json").write_text(json.dumps(records))

    def read(name):
        return [(d.texts["text"], d.meta, d.subset) for d in iter_documents([str(tmp_path / name)])]
    expected = read("a.jsonl")
    assert expected[3] == ("meta as a string", {"src": "x"}, "arxiv")
    for name in ("b.jsonl.gz", "c.parquet", "d.json"):
        assert read(name) == expected, name


def test_json_keys_directories_and_globs(tmp_path):
    os.makedirs(tmp_path / "sub")
    _jsonl(tmp_path / "sub" / "x.jsonl", [{"text": "t1", "title": "a"}, {"text": "t2"}])
    _jsonl(tmp_path / "y.jsonl", [{"text": "t3", "title": "c"}])
    stats = ReadStats()
    docs = list(iter_documents([str(tmp_path)], json_keys=("text", "title"), stats=stats))
    assert [d.texts for d in docs] == [{"text": "t1", "title": "a"}, {"text": "t3", "title": "c"}]
    assert stats.skipped == {"missing 'title'": 1}
    assert resolve_inputs([str(tmp_path / "**" / "*.jsonl")]) == [str(tmp_path / "sub" / "x.jsonl"),
                                                                   str(tmp_path / "y.jsonl")]
    with pytest.raises(ValueError, match="input .*missing.jsonl does not exist"):
        resolve_inputs([str(tmp_path / "missing.jsonl")])
    with pytest.raises(ValueError, match="matches no"):
        resolve_inputs([str(tmp_path / "*.parquet")])


def test_tokenizer_ids_and_vocab_check(tmp_path):
    import sentencepiece as spm
    text = tmp_path / "t.txt"
    text.write_text("\n".join(f"line {i} of the tokenizer test corpus, some words repeat" for i in range(200)))
    spm.SentencePieceTrainer.train(input=str(text), model_prefix=str(tmp_path / "m"), vocab_size=300,
                                   model_type="bpe", byte_fallback=True, pad_id=-1, minloglevel=2)
    tok = build_tokenizer(str(tmp_path / "m.model"))
    assert (tok.vocab_size, tok.bos_id, tok.eos_id, tok.pad_id, tok.eod) == (300, 1, 2, None, 2)
    ids = tok.encode("some words repeat ✓")
    assert tok.decode(ids) == "some words repeat ✓"
    assert tok.encode(["a b", "some words"]) == [tok.encode("a b"), tok.encode("some words")]
    assert (model_vocab_size(tok, None, 1024), model_vocab_size(tok, 256, 1024), model_vocab_size(tok, 384, 1024)) \
        == (300, 300, 384)      # the tokenizer's size, or --vocab-size when it says more; never the preset's
    with pytest.raises(ValueError, match="does not exist"):
        build_tokenizer(str(tmp_path / "none.model"))

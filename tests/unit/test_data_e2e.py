"""End to end: make_sample_corpus -> train_tokenizer -> preprocess_data (2 workers) -> build_data_iterators,
whose batches decode back to corpus text."""
import json
import os

import pytest

from llamapipe.core.config import DataConfig, TrainingConfig
from llamapipe.data.indexed_dataset import IndexedDataset
from llamapipe.data.redpajama import iter_documents
from llamapipe.data.sampler import build_data_iterators
from llamapipe.data.tokenizer import build_tokenizer
from llamapipe.tools import make_sample_corpus, preprocess_data, train_tokenizer



@pytest.fixture(scope="module")
def pipeline(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("e2e")
    corpus, prefix = str(tmp / "corpus"), str(tmp / "data" / "corpus")
    assert make_sample_corpus.main(["--out", corpus, "--max-mb", "0.4"]) == 0
    assert train_tokenizer.main(["--input", corpus, "--vocab-size", "512",
                                            "--model-prefix", str(tmp / "tok")]) == 0
    assert preprocess_data.main(["--input", corpus, "--output-prefix", prefix, "--tokenizer-model",
                                            str(tmp / "tok.model"), "--workers", "2", "--append-eod",
                                            "--no-progress"]) == 0
    return corpus, prefix + "_text_document", build_tokenizer(str(tmp / "tok.model"))


def test_corpus_format_and_determinism(pipeline, tmp_path):
    corpus, _, _ = pipeline
    names = sorted(os.listdir(corpus))
    assert names == ["shard_00.jsonl", "shard_01.jsonl", "shard_02.jsonl", "shard_03.jsonl.gz"]
    docs = list(iter_documents([corpus]))
    assert {d.subset for d in docs} >= {"stdlib_docstrings", "stdlib_comments"}
    assert all(d.meta["source"] for d in docs)
    make_sample_corpus.main(["--out", str(tmp_path), "--max-mb", "0.4"])
    for name in names:
        assert open(os.path.join(corpus, name), "rb").read() == open(tmp_path / name, "rb").read(), name


def test_documents_round_trip_through_the_index(pipeline):
    corpus, prefix, tok = pipeline
    docs = [d.texts["text"] for d in iter_documents([corpus])]
    ds = IndexedDataset(prefix)
    assert len(ds) == len(docs) and ds.dtype.name == "uint16"
    for i in range(0, len(docs), 7):
        ids = ds[i].tolist()
        assert ids[-1] == tok.eod and tok.decode(ids[:-1]) == docs[i]


def test_batches_decode_to_corpus_text(pipeline, tmp_path):
    corpus, prefix, tok = pipeline
    text = "\n".join(d.texts["text"] for d in iter_documents([corpus]))
    data = DataConfig(data_path=(prefix,), split="98,2,0", tokenizer_model=None,
                      data_cache_path=str(tmp_path / "cache"))
    training = TrainingConfig(micro_batch_size=2, global_batch_size=4, seq_length=64, train_iters=3, eval_iters=1)
    train, valid, test = build_data_iterators(data, training, dp_rank=0, dp_size=1, vocab_size=512)
    assert valid is not None and test is None
    checked = 0
    for mb in list(train) + [next(valid)]:
        for row in mb["tokens"].tolist():
            pieces, current = [], []
            for t in row:   # documents are separated by eod inside a window
                if t == tok.eod:
                    pieces.append(current)
                    current = []
                else:
                    current.append(t)
            for piece in pieces + [current]:
                decoded = tok.decode(piece[1:-1]).strip()   # drop edge tokens that may be cut byte pieces
                if len(decoded) > 10 and "\ufffd" not in decoded:
                    assert decoded in text
                    checked += 1
    assert checked >= 8


def test_strict_preprocessing_names_the_bad_line(pipeline, tmp_path):
    _, _, tok = pipeline
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"text": "fine"}) + "\n" + "{oops\n")
    with pytest.raises(SystemExit, match=f"bad record at {bad}:2: invalid JSON"):
        preprocess_data.main(["--input", str(bad), "--output-prefix", str(tmp_path / "o"),
                                         "--tokenizer-model", tok.model_path, "--strict", "--no-progress"])

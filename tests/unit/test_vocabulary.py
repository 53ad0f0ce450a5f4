"""The model's vocabulary from one rule (issues 32, 33), the tokenizer's special ids inside it, the data's cached
largest token id, and the tokenizer written for HF."""
import json
import os

import numpy as np
import pytest

from llamapipe.core.config import ArgumentError
from llamapipe.data import indexed_dataset
from llamapipe.data.gpt_dataset import check_token_ids
from llamapipe.data.indexed_dataset import IndexedDataset, IndexedDatasetWriter, cached_max_token_id
from llamapipe.data.tokenizer import NullTokenizer, build_tokenizer, check_special_ids, model_vocab_size
from llamapipe.training.arguments.parser import build_parser, config_from_args

TEXT = "\n".join(f"line {i} of a tokenizer corpus: def f(x): return x * {i} # words repeat" for i in range(300))


@pytest.fixture(scope="module")
def sp_model(tmp_path_factory):
    """LLaMA's sentencepiece settings (llamapipe train-tokenizer), 300 pieces."""
    from llamapipe.tools import train_tokenizer
    tmp = tmp_path_factory.mktemp("sp")
    (tmp / "t.txt").write_text(TEXT)
    assert train_tokenizer.main(["--input", str(tmp / "t.txt"), "--vocab-size", "300",
                                 "--model-prefix", str(tmp / "m")]) == 0
    return str(tmp / "m.model")


def _config(argv, world=1):
    return config_from_args(build_parser().parse_args(argv), world)


@pytest.mark.parametrize("extra, tp, vocab, padded", [
    ([], 1, 300, 384),                                   # the tokenizer's size, not the tiny preset's 1024
    (["--vocab-size", "200"], 2, 300, 512),              # --vocab-size smaller than the tokenizer: the tokenizer
    (["--vocab-size", "1000"], 2, 1000, 1024),           # --vocab-size says more: room for ids added later
])
def test_model_vocabulary_is_the_tokenizers_or_a_larger_vocab_size(sp_model, extra, tp, vocab, padded, llamapipe_log):
    config = _config(["--model", "tiny", "--mock-data", "--tokenizer-model", sp_model,
                      "--tensor-model-parallel-size", str(tp)] + extra, world=tp)
    assert config.model.vocab_size == vocab and config.model.padded_vocab_size(tp) == padded
    assert any(f"vocabulary size {vocab} from" in m and f"padded to {padded} rows" in m for m in llamapipe_log)


def test_null_tokenizer_vocabulary_holds_its_eod():
    config = _config(["--model", "tiny", "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "128"])
    tokenizer = NullTokenizer(128)
    assert config.model.vocab_size == tokenizer.vocab_size == 129 and tokenizer.eod == 128
    assert config.data.vocab_size == 128      # the flag as given, which --use-checkpoint-args takes back
    assert model_vocab_size(None, None, 1024) == 1024 and model_vocab_size(None, 500, 1024) == 500


class _Special(NullTokenizer):
    """A tokenizer whose pad id lies past its own size (a damaged tokenizer config could say so)."""

    @property
    def pad_id(self):
        return 4000


def test_a_special_id_outside_the_vocabulary_is_one_line():
    with pytest.raises(ValueError, match=r"pad id 4000 is outside the model's vocabulary of 101 \(ids 0..100\); "
                                         r"raise --vocab-size to at least 4001"):
        check_special_ids(_Special(100), 101)
    check_special_ids(_Special(100), 4001)


def test_an_unreadable_tokenizer_is_one_argument_error(tmp_path):
    bad = tmp_path / "tok.model"
    bad.write_bytes(b"not a model")
    with pytest.raises(ArgumentError, match="is not a sentencepiece model"):
        _config(["--model", "tiny", "--mock-data", "--tokenizer-model", str(bad)])


def _write(prefix, docs):
    writer = IndexedDatasetWriter(str(prefix))
    for doc in docs:
        writer.add_document(np.asarray(doc))
    writer.finalize()
    return IndexedDataset(str(prefix))


def test_max_token_id_is_scanned_in_chunks_and_cached_until_the_file_changes(tmp_path, monkeypatch):
    rng = np.random.default_rng(0)
    docs = [rng.integers(0, 900, size=int(rng.integers(1, 50))) for _ in range(200)]
    monkeypatch.setattr(indexed_dataset, "_SCAN_CHUNK", 7)     # many chunks, a short last one
    ds = _write(tmp_path / "d", docs)
    cache = str(tmp_path / "cache")
    assert cached_max_token_id(ds, cache) == max(int(d.max()) for d in docs)
    [sidecar] = os.listdir(cache)

    def no_scan(indexed):
        raise AssertionError("scanned again although the file did not change")
    monkeypatch.setattr(indexed_dataset, "max_token_id", no_scan)
    assert cached_max_token_id(IndexedDataset(str(tmp_path / "d")), cache) == max(int(d.max()) for d in docs)
    monkeypatch.undo()
    os.utime(tmp_path / "d.bin", ns=(1, 1))    # keep the mtime from hiding a rewrite in the same clock tick
    ds = _write(tmp_path / "d", docs + [[1234]])
    assert cached_max_token_id(ds, cache) == 1234
    with open(os.path.join(cache, sidecar)) as fh:
        assert json.load(fh)["max_token_id"] == 1234
    with pytest.raises(ValueError, match=r"d.bin holds token id 1234, but the model's vocabulary is 1000 "
                                         r"\(ids 0..999\).*--vocab-size 1235 or more"):
        check_token_ids(ds, 1000, cache)
    check_token_ids(ds, 1235, cache)
    assert cached_max_token_id(_write(tmp_path / "empty", []), cache) == -1


def test_sentencepiece_and_tokenizer_json_export_as_autotokenizer_loads_them(sp_model, tmp_path):
    transformers = pytest.importorskip("transformers")
    from llamapipe.data.tokenizers.hf_export import special_token_ids, write_hf_tokenizer
    from llamapipe.tools import train_tokenizer
    (tmp_path / "t.txt").write_text(TEXT)
    assert train_tokenizer.main(["--tokenizer-type", "HuggingFaceTokenizer", "--input", str(tmp_path / "t.txt"),
                                 "--vocab-size", "300", "--model-prefix", str(tmp_path / "bpe")]) == 0
    text = "def f(y): return y * 42  # more words"
    for path in (sp_model, str(tmp_path / "bpe")):
        ours = build_tokenizer(path)
        out = tmp_path / ("hf_" + os.path.basename(path))
        files = write_hf_tokenizer(ours, str(out), 256)
        assert "tokenizer_config.json" in files
        hf = transformers.AutoTokenizer.from_pretrained(str(out))
        ids = hf(text).input_ids
        assert ids[-len(ours.encode(text)):] == ours.encode(text) and hf.decode(ids, skip_special_tokens=True) \
            .strip() == text
        assert (hf.bos_token_id, hf.eos_token_id) == (ours.bos_id, ours.eos_id)
        assert special_token_ids(ours)["eos_token_id"] == ours.eod
    assert write_hf_tokenizer(NullTokenizer(10), str(tmp_path / "null"), 256) == []

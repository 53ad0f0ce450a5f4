"""HuggingFaceTokenizer (a local tokenizer.json, LLaMA 3's kind) and NullTokenizer, through preprocessing.

The reference for every id is the `tokenizers` package itself (and transformers' PreTrainedTokenizerFast where
installed), loaded from the same local file; the .bin/.idx are read back with llamapipe's IndexedDataset.
"""
import gzip
import json
import os

import numpy as np
import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from llamapipe.core.config import DataConfig, TrainingConfig
from llamapipe.data.indexed_dataset import IndexedDataset
from llamapipe.data.redpajama import iter_documents
from llamapipe.data.sampler import build_data_iterators
from llamapipe.data.tokenizer import HuggingFaceTokenizer, NullTokenizer, SentencePieceTokenizer, build_tokenizer
from llamapipe.tools import preprocess_data, train_tokenizer

BOS, EOS = "<|begin_of_text|>", "<|end_of_text|>"
TEXTS = ["The quick brown fox jumps over the lazy dog.\nIt was 2024, and 12345 foxes agreed.",
         "Grüße aus Köln: naïve café, 東京 and emoji 🦙🦙 too.",
         "def f(x):\n    return x ** 2  # squares\n\n\nprint(f(3))",
         "   leading spaces, trailing tabs\t\t",
         "short"]


def _write_jsonl(path, texts, gz=False):
    lines = "".join(json.dumps({"text": t, "meta": {"i": i}}) + "\n" for i, t in enumerate(texts))
    with (gzip.open(path, "wt", encoding="utf-8") if gz else open(path, "w", encoding="utf-8")) as f:
        f.write(lines)


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    """A byte-level BPE tokenizer.json with LLaMA 3's special tokens (here ids 0 and 1) and bos-prepending
    post-processor, saved with a truncation length (as some fine-tuning files are), and its config."""
    d = tmp_path_factory.mktemp("hf")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=[BOS, EOS], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(TEXTS * 20, trainer)
    tok.post_processor = processors.TemplateProcessing(single=f"{BOS} $A", special_tokens=[(BOS, 0)])
    tok.enable_truncation(max_length=16)
    tok.save(str(d / "tokenizer.json"))
    config = {"bos_token": BOS, "eos_token": {"__type": "AddedToken", "content": EOS},   # both forms HF writes
              "tokenizer_class": "PreTrainedTokenizerFast"}
    (d / "tokenizer_config.json").write_text(json.dumps(config))
    return d


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    d = tmp_path_factory.mktemp("corpus")
    _write_jsonl(d / "a.jsonl", TEXTS[:3])
    _write_jsonl(d / "b.jsonl.gz", TEXTS[3:], gz=True)
    return d


def _preprocess(corpus, out, *flags):
    prefix = str(out / "data")
    assert preprocess_data.main(["--input", str(corpus), "--output-prefix", prefix, "--no-progress", *flags]) == 0
    return IndexedDataset(prefix + "_text_document")


@pytest.mark.parametrize("append_eod,workers", [(True, 2), (False, 1)])
def test_preprocess_writes_exactly_the_tokenizers_ids(hf_dir, corpus, tmp_path, append_eod, workers):
    reference = Tokenizer.from_file(str(hf_dir / "tokenizer.json"))
    assert len(reference.encode(TEXTS[0]).ids) == 16 and reference.encode(TEXTS[0]).ids[0] == 0
    reference.no_truncation()   # whole documents, and (below) no post-processor bos
    eos = [reference.token_to_id(EOS)] if append_eod else []
    flags = ["--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", str(hf_dir), "--workers", str(workers)]
    ds = _preprocess(corpus, tmp_path, *flags, *(["--append-eod"] if append_eod else []))
    assert len(ds) == len(TEXTS) and ds.dtype == np.uint16
    for i, text in enumerate(TEXTS):
        assert ds[i].tolist() == reference.encode(text, add_special_tokens=False).ids + eos, text
    assert max(len(ds[i]) for i in range(len(ds))) > 16


def test_special_ids_from_config_and_round_trips(hf_dir):
    tok = build_tokenizer(str(hf_dir / "tokenizer.json"), "HuggingFaceTokenizer")
    assert (tok.vocab_size, tok.bos_id, tok.eos_id, tok.eod, tok.pad_id) == (400, 0, 1, 1, None)
    assert tok.id_to_piece(tok.eos_id) == EOS
    for text in TEXTS:
        ids = tok.encode(text)
        assert tok.decode(ids) == text
        assert tok.encode(text, bos=True, eos=True) == [0] + ids + [1]
    assert tok.encode(TEXTS) == [tok.encode(t) for t in TEXTS]
    assert tok.decode(tok.encode(TEXTS[0], eos=True)) == TEXTS[0] + EOS


def test_special_ids_without_config_and_a_config_naming_a_missing_token(hf_dir, tmp_path):
    bare = tmp_path / "bare"
    bare.mkdir()
    (bare / "tokenizer.json").write_bytes((hf_dir / "tokenizer.json").read_bytes())
    tok = build_tokenizer(str(bare))
    assert isinstance(tok, HuggingFaceTokenizer) and (tok.bos_id, tok.eos_id) == (0, 1)
    (bare / "special_tokens_map.json").write_text(json.dumps({"eos_token": "<|eot_id|>"}))
    with pytest.raises(ValueError, match=r"names eos_token '<\|eot_id\|>', which .*tokenizer.json does not hold"):
        build_tokenizer(str(bare))


def test_ids_match_transformers(hf_dir):
    transformers = pytest.importorskip("transformers")
    ours = build_tokenizer(str(hf_dir))
    fast = transformers.PreTrainedTokenizerFast(tokenizer_file=str(hf_dir / "tokenizer.json"))
    assert fast(TEXTS, add_special_tokens=False)["input_ids"] == ours.encode(TEXTS)
    auto = transformers.AutoTokenizer.from_pretrained(str(hf_dir))
    assert (auto.bos_token_id, auto.eos_token_id) == (ours.bos_id, ours.eos_id)
    assert [auto.decode(ids) for ids in ours.encode(TEXTS)] == [ours.decode(ids) for ids in ours.encode(TEXTS)]


def test_trained_llama3_style_tokenizer(corpus, tmp_path):
    out = tmp_path / "bpe"
    assert train_tokenizer.main(["--input", str(corpus), "--vocab-size", "320", "--model-prefix", str(out),
                                 "--tokenizer-type", "HuggingFaceTokenizer"]) == 0
    tok = build_tokenizer(str(out))
    n = tok.vocab_size
    assert (tok.bos_id, tok.eos_id) == (n - 2, n - 1) and tok.id_to_piece(n - 2) == BOS
    for text in TEXTS:
        assert tok.decode(tok.encode(text)) == text
    digits = [tok.decode([i]) for i in tok.encode("1234567")]
    assert "".join(digits) == "1234567" and max(map(len, digits)) <= 3   # LLaMA 3 splits digits in threes
    raw = Tokenizer.from_file(str(out / "tokenizer.json"))
    assert raw.encode("hi").ids[0] == tok.bos_id   # the file's own post-processor prepends bos, as LLaMA 3's does


@pytest.mark.parametrize("vocab_size,dtype", [(10, np.uint16), (70000, np.int32)])
def test_null_tokenizer_preprocess(tmp_path, vocab_size, dtype):
    docs = ["3 1 4 1 5", "9  2\n6", str(vocab_size - 1)]
    _write_jsonl(tmp_path / "ids.jsonl", docs)
    ds = _preprocess(tmp_path / "ids.jsonl", tmp_path, "--tokenizer-type", "NullTokenizer", "--vocab-size",
                     str(vocab_size), "--append-eod")
    assert ds.dtype == dtype
    assert [ds[i].tolist() for i in range(len(ds))] == [[3, 1, 4, 1, 5, vocab_size], [9, 2, 6, vocab_size],
                                                         [vocab_size - 1, vocab_size]]
    tok = build_tokenizer(None, "NullTokenizer", vocab_size=vocab_size)
    assert (tok.vocab_size, tok.eod, tok.bos_id) == (vocab_size + 1, vocab_size, None)
    assert tok.decode(tok.encode("7 8 0")) == "7 8 0"


def test_null_tokenizer_rejects_text_that_is_not_ids(tmp_path):
    tok = NullTokenizer(10)
    with pytest.raises(ValueError, match="token id 11 is outside NullTokenizer's ids 0..10 \\(--vocab-size 10"):
        tok.encode("1 11")
    with pytest.raises(ValueError, match="integers separated by spaces, not 'one two'"):
        tok.encode("one two")


@pytest.mark.parametrize("flags,message", [
    (["--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", "meta-llama/Meta-Llama-3-8B"],
     "--tokenizer-model meta-llama/Meta-Llama-3-8B is not a local tokenizer.json or a directory holding one"),
    (["--tokenizer-type", "NullTokenizer"], "--tokenizer-type NullTokenizer needs --vocab-size"),
    ([], "give --tokenizer-model"),
    (["--tokenizer-type", "HuggingFaceTokenizer"], "--tokenizer-type HuggingFaceTokenizer needs --tokenizer-model"),
])
def test_user_errors_are_one_line(corpus, tmp_path, flags, message):
    with pytest.raises(SystemExit) as e:
        _preprocess(corpus, tmp_path, *flags)
    assert str(e.value).startswith(message) and "\n" not in str(e.value)


def test_type_inference_and_mismatches(hf_dir, tmp_path):
    import sentencepiece as spm
    (tmp_path / "t.txt").write_text("\n".join(TEXTS * 40))
    spm.SentencePieceTrainer.train(input=str(tmp_path / "t.txt"), model_prefix=str(tmp_path / "m"),
                                   vocab_size=400, model_type="bpe", byte_fallback=True, minloglevel=2)
    assert isinstance(build_tokenizer(str(tmp_path / "m.model")), SentencePieceTokenizer)
    assert isinstance(build_tokenizer(str(hf_dir)), HuggingFaceTokenizer)
    assert isinstance(build_tokenizer(str(hf_dir / "tokenizer.json")), HuggingFaceTokenizer)
    with pytest.raises(ValueError, match="is not a sentencepiece model .*--tokenizer-type HuggingFaceTokenizer"):
        build_tokenizer(str(hf_dir / "tokenizer.json"), "SentencePieceTokenizer")
    with pytest.raises(ValueError, match="is a directory without tokenizer.json"):
        build_tokenizer(str(tmp_path), "HuggingFaceTokenizer")
    with pytest.raises(ValueError, match="--tokenizer-type TikTokenizer is not one of"):
        build_tokenizer(str(hf_dir), "TikTokenizer")


def test_progress_bar_counts_input_bytes(hf_dir, corpus, tmp_path, capsys):
    files = [str(corpus / "a.jsonl"), str(corpus / "b.jsonl.gz")]
    size_a, size_b = map(os.path.getsize, files)
    where = preprocess_data.InputProgress(files)
    assert where.total == size_a + size_b
    positions = [where.after(doc) for doc in iter_documents(files)]
    # plain jsonl: the text bytes read so far; a .gz file counts when the reader has moved past it
    assert positions == [*np.cumsum([len(t.encode("utf-8")) for t in TEXTS[:3]]), size_a, size_a]
    preprocess_data.preprocess([str(corpus)], str(tmp_path / "p"), str(hf_dir), progress=True)
    bar = capsys.readouterr().err.replace("\r", "\n").strip().splitlines()[-1]
    total = size_a + size_b
    assert "100%" in bar and f"{total}/{total}" in bar and "<00:00" in bar   # done, with its ETA field


def test_hf_data_feeds_the_sampler(hf_dir, corpus, tmp_path):
    tok = build_tokenizer(str(hf_dir))
    _preprocess(corpus, tmp_path, "--tokenizer-model", str(hf_dir), "--append-eod")
    data = DataConfig(data_path=(str(tmp_path / "data_text_document"),), split="100,0,0",
                      data_cache_path=str(tmp_path / "cache"))
    training = TrainingConfig(micro_batch_size=2, global_batch_size=2, seq_length=16, train_iters=4, eval_iters=0)
    train, _, _ = build_data_iterators(data, training, dp_rank=0, dp_size=1, vocab_size=tok.vocab_size)
    rows = [row for mb in train for row in mb["tokens"].tolist()]
    assert len(rows) == 8 and all(0 <= t < tok.vocab_size for row in rows for t in row)
    assert any(tok.eod in row for row in rows)

"""Token ids against the model's vocabulary through pretrain_llama.py (issues 32 and 33): data holding ids the
model has no row for is refused when it is opened, in one line, at tp 1 and tp 2; NullTokenizer data written
with --append-eod (eod = --vocab-size) trains with a finite loss and resumes under --use-checkpoint-args."""
import json
import math
import os
import re
import subprocess
import sys

import pytest

from llamapipe.data.indexed_dataset import IndexedDataset, max_token_id
from llamapipe.tools import make_sample_corpus, preprocess_data, train_tokenizer
from tests.cli import read_metrics, torchrun
from tests.harness import ROOT

SHAPE = ["--num-layers", "2", "--hidden-size", "64", "--ffn-hidden-size", "128", "--num-attention-heads", "4",
         "--seq-length", "32", "--max-position-embeddings", "64", "--micro-batch-size", "2",
         "--global-batch-size", "4", "--lr", "1e-3", "--log-interval", "1", "--split", "98,2,0",
         "--eval-iters", "0", "--num-workers", "0"]


@pytest.fixture(scope="module")
def corpus_data(tmp_path_factory):
    """A corpus preprocessed with a 1024-piece tokenizer, and a 512-piece tokenizer too small for it."""
    tmp = tmp_path_factory.mktemp("vocab")
    corpus, prefix = str(tmp / "corpus"), str(tmp / "data" / "c")
    assert make_sample_corpus.main(["--out", corpus, "--max-mb", "0.5"]) == 0
    for name, size in (("big", "1024"), ("small", "512")):
        assert train_tokenizer.main(["--input", corpus, "--vocab-size", size, "--model-prefix", str(tmp / name)]) == 0
    assert preprocess_data.main(["--input", corpus, "--output-prefix", prefix, "--tokenizer-model",
                                 str(tmp / "big.model"), "--workers", "1", "--append-eod", "--no-progress"]) == 0
    return str(tmp / "small.model"), prefix + "_text_document"


@pytest.mark.parametrize("tp", [1, 2])
def test_data_with_ids_beyond_the_vocabulary_is_one_line(corpus_data, tmp_path, tp):
    small, data = corpus_data
    max_id = max_token_id(IndexedDataset(data))     # the reference: a plain scan of the file
    assert max_id >= 512
    args = SHAPE + ["--train-iters", "2", "--tensor-model-parallel-size", str(tp), "--data-path", data,
                    "--tokenizer-model", small, "--data-cache-path", str(tmp_path / "cache")]
    if tp == 1:     # one process without torchrun: the exit status is the run's own, and nothing else is printed
        proc = subprocess.run([sys.executable, "pretrain_llama.py", *args], cwd=ROOT, capture_output=True, text=True,
                              timeout=300, env=dict(os.environ, OMP_NUM_THREADS="1"))
        assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    else:           # torchrun reports the failed worker (exit 2) with its own traceback; the ranks print none
        proc = torchrun(tp, args)
        assert "exitcode  : 2" in proc.stderr and not re.search(r'File ".*llamapipe/', proc.stderr), proc.stderr[-3000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("pretrain_llama.py: error:")]
    assert len(errors) == 1, proc.stderr[-3000:]
    assert f"data file {data}.bin holds token id {max_id}" in errors[0] and "vocabulary is 512" in errors[0]
    sidecars = [f for f in os.listdir(tmp_path / "cache") if f.endswith("_max_token_id.json")]
    with open(tmp_path / "cache" / sidecars[0]) as fh:
        assert json.load(fh)["max_token_id"] == max_id    # cached for the next run


def test_null_tokenizer_eod_data_trains_finite_and_resumes_with_checkpoint_args(tmp_path):
    vocab = 200
    docs = tmp_path / "ids.jsonl"
    with open(docs, "w") as fh:   # short documents, so eod (id 200) is in every sample
        for i in range(300):
            fh.write(json.dumps({"text": " ".join(str((i * 7 + j * 3) % vocab) for j in range(5 + i % 9))}) + "\n")
    prefix = str(tmp_path / "ids")
    assert preprocess_data.main(["--input", str(docs), "--output-prefix", prefix, "--tokenizer-type",
                                 "NullTokenizer", "--vocab-size", str(vocab), "--append-eod", "--no-progress"]) == 0
    data = prefix + "_text_document"
    assert max_token_id(IndexedDataset(data)) == vocab
    null = ["--data-path", data, "--tokenizer-type", "NullTokenizer"]
    save, jsonl = str(tmp_path / "ckpt"), str(tmp_path / "m.jsonl")
    proc = torchrun(2, SHAPE + null + ["--vocab-size", str(vocab), "--train-iters", "2", "--tensor-model-parallel-size",
                                       "2", "--save", save, "--save-interval", "2", "--metrics-jsonl", jsonl])
    assert proc.returncode == 0, proc.stderr[-3000:]
    losses = [row["lm_loss"] for row in read_metrics(jsonl)]
    # a finite loss near uniform over the 201 ids (eod included) at initialisation
    assert len(losses) == 2 and all(math.isfinite(x) for x in losses) and abs(losses[0] - math.log(vocab + 1)) < 0.3
    with open(os.path.join(save, "iter_0000002", "metadata.json")) as fh:
        assert json.load(fh)["model_config"]["vocab_size"] == vocab + 1
    # the model's shape, --vocab-size 200 included, from the checkpoint; it loads (sizes checked) and trains on
    resumed = str(tmp_path / "r.jsonl")
    proc = torchrun(1, ["--use-checkpoint-args", "--load", save, "--train-iters", "3", "--override-opt_param-scheduler",
                        "--micro-batch-size", "2", "--global-batch-size", "4", "--lr", "1e-3", "--split", "98,2,0", "--eval-iters", "0",
                        "--num-workers", "0", "--log-interval", "1", "--metrics-jsonl", resumed] + null)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert [row["iteration"] for row in read_metrics(resumed)] == [3]


def _single(args):
    return subprocess.run([sys.executable, "pretrain_llama.py", *SHAPE, *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=300, env=dict(os.environ, OMP_NUM_THREADS="1"))


def test_resuming_with_another_tokenizer_of_the_same_size_is_refused_unless_allowed(corpus_data, tmp_path):
    """Issue 40: the checkpoint records its tokenizer's sha256 and size; another 1024-piece tokenizer (trained on
    part of the corpus) resumes it only with --allow-tokenizer-change (before: it trained on without a word); a
    checkpoint saved before the hash was recorded loads with a notice."""
    from llamapipe.training.checkpointing import catalog, integrity
    _, data = corpus_data
    tmp = os.path.dirname(os.path.dirname(data))
    big = os.path.join(tmp, "big.model")
    part = tmp_path / "part"
    part.mkdir()
    shard = sorted(f for f in os.listdir(os.path.join(tmp, "corpus")) if f.endswith(".jsonl"))[0]
    os.symlink(os.path.join(tmp, "corpus", shard), part / shard)
    assert train_tokenizer.main(["--input", str(part), "--vocab-size", "1024", "--model-prefix",
                                 str(tmp_path / "other")]) == 0
    other = str(tmp_path / "other.model")
    save = str(tmp_path / "ckpt")
    common = ["--data-path", data, "--data-cache-path", str(tmp_path / "cache"), "--lr-decay-iters", "10"]
    proc = _single(common + ["--tokenizer-model", big, "--train-iters", "1", "--save", save])
    assert proc.returncode == 0, proc.stderr[-3000:]
    resume = common + ["--train-iters", "2", "--load", save]
    refused = _single(resume + ["--tokenizer-model", other])
    assert refused.returncode == 2 and "Traceback" not in refused.stderr, refused.stderr[-3000:]
    (line,) = [x for x in refused.stderr.splitlines() if x.startswith("pretrain_llama.py: error:")]
    assert f"was trained with tokenizer SentencePieceTokenizer ({big}, sha256 " in line and "1024 ids) but this " \
           f"run's --tokenizer-model is SentencePieceTokenizer ({other}, sha256 " in line, line
    assert line.endswith("so its token ids mean other text; give the tokenizer it was trained with, or "
                         "--allow-tokenizer-change if the change is meant"), line
    allowed = _single(resume + ["--tokenizer-model", other, "--allow-tokenizer-change"])
    assert allowed.returncode == 0, allowed.stderr[-3000:]
    assert "going on (--allow-tokenizer-change)" in allowed.stdout
    ckpt = os.path.join(save, "iter_0000001")       # as saved before issue 40: the tokenizer by path only
    meta = catalog.read_metadata(ckpt)
    meta["tokenizer"] = {"type": "SentencePieceTokenizer", "model": big}
    integrity.write_json(os.path.join(ckpt, "metadata.json"), catalog.seal(meta))
    old = _single(resume + ["--tokenizer-model", other])
    assert old.returncode == 0, old.stderr[-3000:]
    assert f"notice: checkpoint {ckpt} records its tokenizer by path only ({big})" in old.stdout

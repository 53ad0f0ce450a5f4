"""LLaMA 3's kind of tokenizer end to end: a byte-level BPE tokenizer.json trained offline, preprocessing with
it, and pretrain_llama.py taking its vocabulary from it (the type guessed from the path, or named)."""
import math
import subprocess
import sys

import pytest

from llamapipe.data.tokenizer import build_tokenizer
from llamapipe.tools import make_sample_corpus, preprocess_data, train_tokenizer
from tests.cli import read_metrics
from tests.harness import ROOT

SHAPE = ["--num-layers", "2", "--hidden-size", "64", "--ffn-hidden-size", "128", "--num-attention-heads", "4",
         "--seq-length", "64", "--max-position-embeddings", "64", "--micro-batch-size", "2",
         "--global-batch-size", "4", "--train-iters", "3", "--log-interval", "1", "--split", "98,2,0",
         "--eval-iters", "0", "--num-workers", "0"]


@pytest.fixture(scope="module")
def hf_data(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("hf")
    corpus, tok, prefix = str(tmp / "corpus"), str(tmp / "tok"), str(tmp / "data" / "c")
    assert make_sample_corpus.main(["--out", corpus, "--max-mb", "0.3"]) == 0
    assert train_tokenizer.main(["--tokenizer-type", "HuggingFaceTokenizer", "--input", corpus,
                                 "--vocab-size", "700", "--model-prefix", tok]) == 0
    assert preprocess_data.main(["--input", corpus, "--output-prefix", prefix, "--tokenizer-model", tok,
                                 "--workers", "1", "--append-eod", "--no-progress"]) == 0
    return tok, prefix + "_text_document"


def _pretrain(args):
    return subprocess.run([sys.executable, "pretrain_llama.py", *SHAPE, *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=300)


@pytest.mark.parametrize("named", [False, True])
def test_pretrain_takes_the_vocabulary_of_a_tokenizer_json(hf_data, tmp_path, named):
    tok, data = hf_data
    vocab = build_tokenizer(tok).vocab_size
    jsonl = str(tmp_path / "m.jsonl")
    extra = ["--tokenizer-type", "HuggingFaceTokenizer"] if named else []
    proc = _pretrain(["--data-path", data, "--tokenizer-model", tok, "--metrics-jsonl", jsonl, *extra])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"vocabulary size {vocab} from --tokenizer-model {tok}" in proc.stderr + proc.stdout
    losses = [row["lm_loss"] for row in read_metrics(jsonl)]
    assert len(losses) == 3
    # at initialisation the model predicts about uniformly over the tokenizer's vocabulary (padded to 128)
    assert abs(losses[0] - math.log(vocab)) < 0.25, (losses[0], math.log(vocab))


def test_a_tokenizer_json_named_as_sentencepiece_is_one_error_line(hf_data):
    tok, data = hf_data
    proc = _pretrain(["--data-path", data, "--tokenizer-model", tok + "/tokenizer.json",
                      "--tokenizer-type", "SentencePieceTokenizer"])
    errors = [line for line in proc.stderr.splitlines() if "error" in line.lower()]
    assert proc.returncode == 2 and len(errors) == 1 and "--tokenizer-type HuggingFaceTokenizer" in errors[0], \
        proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr

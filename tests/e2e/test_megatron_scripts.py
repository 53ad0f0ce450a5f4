"""Megatron-LM's own LLaMA launch scripts, flag for flag, scaled down, through pretrain_llama.py under torchrun.

The flags are copied from NVIDIA/Megatron-LM examples/llama/ (commit 0c0185b, 2025-07-31, the scripts the
README's LLaMA 3 8B H200 runs use): train_llama3_8b_h200_bf16.sh with its mock-data branch, and
train_llama_1gpu_bf16_slimpajama.sh with real data (a BPE tokenizer.json and a corpus made here), also with the
training arguments by which Megatron's examples/post_training/modelopt/finetune.sh packs documents
(MLM_TRAIN_ARGS: --reset-position-ids --reset-attention-mask --eod-mask-loss and its neighbours). Only sizes,
lengths, intervals and paths are scaled; every other flag is the script's. Each run must end (exit 0) with
finite losses, and print one notice line per flag that has no effect here, once (rank 0 only).
"""
import gzip
import json
import math
import os

import pytest

from llamapipe.data.tokenizers.huggingface_tokenizer import HuggingFaceTokenizer
from llamapipe.tools import make_sample_corpus, preprocess_data, train_tokenizer
from llamapipe.training.arguments.megatron_compat import NOTICES
from tests.cli import read_metrics, torchrun

pytestmark = pytest.mark.slow


def h200_bf16(ckpt: str, tensorboard: str, cache: str) -> list[str]:
    """train_llama3_8b_h200_bf16.sh; 32 layers -> 2, hidden 4096 -> 64, 32 heads -> 4 (kv-channels 128 -> 16,
    8 groups -> 2), seq 8192 -> 32, ffn 14336 -> 224, vocab 128256 -> 256, gbs 128 -> 4, samples / 1.6e8."""
    model = ["--use-mcore-models", "--num-layers", "2", "--hidden-size", "64", "--ffn-hidden-size", "224",
             "--num-attention-heads", "4", "--group-query-attention", "--num-query-groups", "2",
             "--kv-channels", "16", "--seq-length", "32", "--max-position-embeddings", "32",
             "--position-embedding-type", "rope", "--rotary-base", "1000000", "--rotary-percent", "1.0",
             "--attention-dropout", "0.0", "--hidden-dropout", "0.0", "--swiglu", "--init-method-std", "0.0134",
             "--attention-backend", "fused", "--apply-layernorm-1p", "--untie-embeddings-and-output-weights",
             "--disable-bias-linear"]
    training = ["--micro-batch-size", "1", "--global-batch-size", "4", "--train-samples", "12",
                "--lr-decay-samples", "11", "--lr-warmup-samples", "2", "--lr", "0.00015", "--min-lr", "0.00001",
                "--decoupled-lr", "5.0e-4", "--decoupled-min-lr", "4.5e-5", "--lr-decay-style", "cosine",
                "--clip-grad", "1.0", "--weight-decay", "0.1", "--adam-beta1", "0.9", "--adam-beta2", "0.95",
                "--bf16", "--grad-reduce-in-bf16", "--cross-entropy-loss-fusion", "--calculate-per-token-loss",
                "--manual-gc", "--empty-unused-memory-level", "1", "--exit-duration-in-mins", "235",
                "--use-distributed-optimizer", "--overlap-grad-reduce", "--overlap-param-gather"]
    parallel = ["--tensor-model-parallel-size", "1", "--context-parallel-size", "1", "--sequence-parallel"]
    # the script's bash array word-splits "--split '99,1,0'", so Megatron receives the quotes too
    data = ["--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "256", "--data-cache-path", cache,
            "--tiktoken-pattern", "v2", "--split", "'99,1,0'", "--no-create-attention-mask-in-dataloader",
            "--no-mmap-bin-files", "--num-workers", "1"]
    logging = ["--log-interval", "1", "--save-interval", "1000", "--log-throughput", "--profile",
               "--profile-step-start", "4", "--profile-step-end", "6", "--ckpt-format", "torch_dist",
               "--distributed-timeout-minutes", "60", "--save", ckpt, "--load", ckpt, "--tensorboard-dir",
               tensorboard, "--wandb-project", "megatron-lm-training", "--wandb-exp-name", "llama3x-8b-bf16-tp1",
               "--wandb-save-dir", os.path.join(ckpt, "wandb"), "--log-params-norm", "--log-num-zeros-in-grad",
               "--log-timers-to-tensorboard"]
    return model + training + parallel + data + logging


def slimpajama_bf16(ckpt: str, tensorboard: str, data: str, tokenizer: str) -> list[str]:
    """train_llama_1gpu_bf16_slimpajama.sh; 12 layers -> 2, hidden 2048 -> 64, 16 heads -> 4 (4 groups -> 2),
    seq 2048 -> 32, ffn 5504 -> 172, mbs 16 -> 2, gbs 64 -> 4, iterations 500000 -> 3 (decay 430000 -> 3),
    intervals 100/1000/10000 -> 1/2/2, eval-iters 10 -> 1."""
    model = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
             "--max-position-embeddings", "32", "--attention-backend", "auto", "--normalization", "RMSNorm",
             "--position-embedding-type", "rope", "--untie-embeddings-and-output-weights", "--disable-bias-linear",
             "--transformer-impl", "transformer_engine", "--group-query-attention", "--num-query-groups", "2",
             "--attention-dropout", "0.0", "--hidden-dropout", "0.0", "--rotary-base", "500000",
             "--rotary-percent", "1.0", "--swiglu", "--ffn-hidden-size", "172", "--no-masked-softmax-fusion",
             "--attention-softmax-in-fp32"]
    training = ["--micro-batch-size", "2", "--global-batch-size", "4", "--train-iters", "3", "--weight-decay", "0.1",
                "--adam-beta1", "0.9", "--adam-beta2", "0.95", "--init-method-std", "0.006", "--clip-grad", "1.0",
                "--bf16", "--lr", "6.0e-5", "--lr-decay-style", "cosine", "--min-lr", "6.0e-6",
                "--lr-warmup-fraction", ".001", "--lr-decay-iters", "3"]
    parallel = ["--tensor-model-parallel-size", "1", "--pipeline-model-parallel-size", "1"]
    data_args = ["--data-path", data, "--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", tokenizer,
                 "--split", "949,50,1"]
    logging = ["--log-interval", "1", "--tensorboard-log-interval", "1", "--save-interval", "2", "--eval-interval",
               "2", "--save", ckpt, "--load", ckpt, "--eval-iters", "1", "--tensorboard-dir", tensorboard,
               "--wandb-project", "megatron-lm-training", "--wandb-exp-name", "llama3x-small-slimpajama-bf16",
               "--wandb-save-dir", os.path.join(ckpt, "wandb"), "--log-params-norm", "--log-num-zeros-in-grad",
               "--log-timers-to-tensorboard"]
    return model + training + parallel + data_args + logging


def _run(nproc: int, args: list[str], tmp_path) -> tuple[list[dict], str]:
    os.makedirs(tmp_path, exist_ok=True)
    jsonl = str(tmp_path / "metrics.jsonl")
    proc = torchrun(nproc, args + ["--metrics-jsonl", jsonl], timeout=600,
                    env={"WANDB_MODE": "offline", "WANDB_SILENT": "true"})
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    return read_metrics(jsonl), proc.stdout + proc.stderr


def _check_notices(args: list[str], output: str) -> None:
    """One line per no-effect flag the script passes, printed once although every rank parses the flags."""
    given = [entry for entry in NOTICES if entry.flag in args]
    assert given
    for entry in given:
        lines = [line for line in output.splitlines() if f"notice: {entry.flag} " in line]
        assert len(lines) == 1 and lines[0].endswith(f"has no effect here: {entry.why}"), (entry.flag, lines)


def _without(args: list[str], flags: tuple) -> list[str]:
    """`args` less `flags` and the value after each."""
    drop = {i for i, a in enumerate(args) if a in flags} | {i + 1 for i, a in enumerate(args) if a in flags}
    return [a for i, a in enumerate(args) if i not in drop]


def test_llama3_8b_h200_bf16_script_runs_to_the_end_and_resumes_with_checkpoint_args(tmp_path):
    args = h200_bf16(str(tmp_path / "ckpt"), str(tmp_path / "tb"), str(tmp_path / "cache"))
    rows, output = _run(2, args, tmp_path)
    assert [r["iteration"] for r in rows] == [1, 2, 3]          # 12 samples / global batch 4
    assert all(math.isfinite(r["lm_loss"]) for r in rows)
    _check_notices(args, output)
    # the same script resumed for one more batch, its model shape taken from the checkpoint it saved
    shape = ("--num-layers", "--hidden-size", "--ffn-hidden-size", "--num-attention-heads", "--num-query-groups",
             "--kv-channels", "--seq-length", "--max-position-embeddings", "--train-samples")
    resumed, output = _run(2, _without(args, shape) + ["--use-checkpoint-args", "--train-samples", "16"],
                           tmp_path / "resume")
    assert [r["iteration"] for r in resumed] == [4] and math.isfinite(resumed[0]["lm_loss"])
    assert "--use-checkpoint-args: --num-layers 2, --hidden-size 64, --ffn-hidden-size 224" in output


def _one_document_per_paragraph(corpus: str, out: str) -> int:
    """Rewrite the sample corpus (46 long documents) as RedPajama records of one paragraph each, so that the
    script's --split 949,50,1 leaves the test split a document (it needs more than 500)."""
    paragraphs = []
    for name in sorted(os.listdir(corpus)):
        with (gzip.open if name.endswith(".gz") else open)(os.path.join(corpus, name), "rt") as f:
            paragraphs += [p for line in f for p in json.loads(line)["text"].split("\n\n") if p.strip()]
    os.makedirs(out)
    with open(os.path.join(out, "paragraphs.jsonl"), "w") as f:
        for text in paragraphs:
            f.write(json.dumps({"text": text, "meta": {}, "red_pajama_subset": "sample"}) + "\n")
    return len(paragraphs)


@pytest.fixture(scope="module")
def bpe_corpus(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("slimpajama")
    corpus, tok, prefix = str(tmp / "paragraphs"), str(tmp / "tok"), str(tmp / "data" / "c")
    assert make_sample_corpus.main(["--out", str(tmp / "sample"), "--max-mb", "0.3"]) == 0
    assert _one_document_per_paragraph(str(tmp / "sample"), corpus) > 1000
    assert train_tokenizer.main(["--tokenizer-type", "HuggingFaceTokenizer", "--input", corpus,
                                 "--vocab-size", "700", "--model-prefix", tok]) == 0
    assert preprocess_data.main(["--input", corpus, "--output-prefix", prefix, "--tokenizer-model", tok,
                                 "--workers", "1", "--append-eod", "--no-progress"]) == 0
    return prefix + "_text_document", tok


# examples/post_training/modelopt/finetune.sh's MLM_TRAIN_ARGS (NVIDIA/Megatron-LM at d98e8a6), BACKEND=auto (cp 1)
PACKED_DOCUMENTS = ["--no-gradient-accumulation-fusion", "--reset-position-ids", "--reset-attention-mask",
                    "--eod-mask-loss", "--micro-batch-size", "1", "--attention-dropout", "0.0", "--hidden-dropout",
                    "0.0", "--no-check-for-nan-in-loss-and-grad", "--attention-backend", "auto"]


def test_slimpajama_script_with_megatrons_packed_document_flags_runs_to_the_end(tmp_path, bpe_corpus):
    """The three flags on real packed data, next to the flags Megatron's finetune.sh passes with them: the
    documents' boundaries come from the tokenizer's end-of-document id, which the run block names."""
    data, tokenizer = bpe_corpus
    args = slimpajama_bf16(str(tmp_path / "ckpt"), str(tmp_path / "tb"), data, tokenizer) + PACKED_DOCUMENTS
    rows, output = _run(1, args, tmp_path)
    assert [r["iteration"] for r in rows] == [1, 2, 3]
    assert all(math.isfinite(r["lm_loss"]) for r in rows)
    _check_notices(args, output)
    eod = HuggingFaceTokenizer(tokenizer).eod
    lines = [line for line in output.splitlines() if "run: packed documents:" in line]
    assert len(lines) == 1 and lines[0].endswith(
        "run: packed documents: attention within each document, positions restart at each document, no loss on "
        f"end-of-document tokens (end-of-document id {eod})"), lines


def test_llama_1gpu_bf16_slimpajama_script_runs_to_the_end(tmp_path, bpe_corpus):
    data, tokenizer = bpe_corpus
    args = slimpajama_bf16(str(tmp_path / "ckpt"), str(tmp_path / "tb"), data, tokenizer)
    rows, output = _run(1, args, tmp_path)
    assert [r["iteration"] for r in rows] == [1, 2, 3]
    assert all(math.isfinite(r["lm_loss"]) for r in rows)
    _check_notices(args, output)

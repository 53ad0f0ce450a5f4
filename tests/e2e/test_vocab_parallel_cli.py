"""--enable-vocab-parallel through the CLI (arXiv 2411.05288): the output layer split over the pipeline trains the
same per-iteration losses as the single-process run (fp32, rel 1e-5) under every schedule, at pp 2 and 4, with
tp 2 + sequence parallelism, dp 2 with ZeRO-1, ZeRO-2 and ZeRO-3 (the vocabulary shards as FSDP units of their
own) and --overlap-grad-reduce (the embedding's late gradient reduced at the step's end), recompute, --compile and
post-validation, and evaluates the same validation loss (forward-only S); its checkpoint loads without the split
and a checkpoint without it loads with it (the logical output.weight is one tensor), also under ZeRO-3, and
convert-hf exports the whole output layer from it. The vocabulary (250, padded to 256 or 512) leaves padding
rows, at pp 4 whole padding shards."""
import json
import math
import os
import subprocess
import sys

import pytest
import torch

from tests.cli import ROOT, TINY, read_metrics, train

ITERS = ["--train-iters", "4", "--micro-batch-size", "1", "--global-batch-size", "4", "--vocab-size", "250",
         "--make-vocab-size-divisible-by", "16", "--split", "90,10,0"]
EVAL = ["--eval-iters", "1", "--eval-interval", "2"]
VP = ["--enable-vocab-parallel"]
V2 = ["--num-virtual-stages-per-pipeline-rank", "2"]


def losses(records: list[dict], key: str = "lm_loss") -> list[float]:
    return [r[key] for r in records if key in r]


def validation(jsonl: str) -> list[float]:
    """The validation losses of a --metrics-jsonl file (`read_metrics` keeps the training records only)."""
    with open(jsonl) as f:
        return losses([json.loads(line) for line in f], "valid_lm_loss")


def assert_same(got: list[float], want: list[float], what: str) -> None:
    assert len(got) == len(want) and got, f"{what}: {len(got)} losses, expected {len(want)}"
    for it, (g, w) in enumerate(zip(got, want), 1):
        assert math.isclose(g, w, rel_tol=1e-5), f"{what}, value {it}: loss {g}, one process {w}"


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    jsonl = str(tmp_path_factory.mktemp("ref") / "m.jsonl")
    records = train(1, ITERS + EVAL, jsonl)
    return records, validation(jsonl)


CASES = {
    "pp4-1f1b-eval": (4, ["--pipeline-model-parallel-size", "4", "--pipeline-schedule", "1f1b", *EVAL]),
    "pp2-interleaved-recompute": (2, ["--pipeline-model-parallel-size", "2", "--pipeline-schedule", "interleaved",
                                      *V2, "--recompute-granularity", "full", "--recompute-method", "uniform"]),
    "pp2-tp2-sp-zb-h1": (4, ["--pipeline-model-parallel-size", "2", "--tensor-model-parallel-size", "2",
                             "--sequence-parallel", "--pipeline-schedule", "zb-h1"]),
    "pp2-zb-h2": (2, ["--pipeline-model-parallel-size", "2", "--pipeline-schedule", "zb-h2",
                      "--pipeline-profile-iters", "1"]),
    "pp2-dp2-zero1-v-half": (4, ["--pipeline-model-parallel-size", "2", "--pipeline-schedule", "v-half", *V2,
                                 "--use-distributed-optimizer"]),
    "pp2-auto-compile": (2, ["--pipeline-model-parallel-size", "2", "--pipeline-schedule", "auto", *V2,
                             "--pipeline-profile-iters", "1", "--compile"]),
    "pp2-dp2-zero3-1f1b-eval": (4, ["--pipeline-model-parallel-size", "2", "--pipeline-schedule", "1f1b",
                                    "--use-torch-fsdp2", *EVAL]),
    "pp2-dp2-zero2-zbv": (4, ["--pipeline-model-parallel-size", "2", "--pipeline-schedule", "zbv", *V2,
                              "--data-parallel-sharding-strategy", "optim_grads"]),
    # buckets of 1000 elements: the layers' start during the backward, the embedding's only at the step's end
    "pp2-dp2-overlap-zb-h1": (4, ["--pipeline-model-parallel-size", "2", "--pipeline-schedule", "zb-h1",
                                  "--overlap-grad-reduce", "--ddp-bucket-size", "1000"]),
}


@pytest.mark.parametrize("name", list(CASES))
def test_vocab_parallel_trains_like_one_process(reference, tmp_path, name):
    nproc, flags = CASES[name]
    jsonl = str(tmp_path / "m.jsonl")
    records = train(nproc, ITERS + VP + flags, jsonl)
    assert_same(losses(records), losses(reference[0]), name)
    if "--eval-iters" in flags:
        assert_same(validation(jsonl), reference[1], name + " validation")


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """Two iterations saved with the split (zbv, post-validation, pp 2) and without it (one process)."""
    root = tmp_path_factory.mktemp("ckpt")
    split = train(2, ITERS + VP + ["--pipeline-model-parallel-size", "2", "--pipeline-schedule", "zbv", *V2,
                                   "--enable-optimizer-post-validation", "--exit-interval", "2",
                                   "--save", str(root / "split")], str(root / "split.jsonl"))
    whole = train(1, ITERS + ["--exit-interval", "2", "--save", str(root / "whole")], str(root / "whole.jsonl"))
    return root, split, whole


def test_checkpoints_load_with_and_without_the_split(reference, saved, tmp_path):
    root, split, whole = saved
    ref = losses(reference[0])
    assert_same(losses(split), ref[:2], "zbv + post-validation, saved with the split")
    resumed = train(1, ITERS + ["--load", str(root / "split")], str(tmp_path / "a.jsonl"))
    assert_same(losses(resumed), ref[2:], "saved with the split, resumed without it")
    resumed = train(4, ITERS + VP + ["--load", str(root / "whole"), "--pipeline-model-parallel-size", "4",
                                     "--pipeline-schedule", "v-min", *V2], str(tmp_path / "b.jsonl"))
    assert_same(losses(resumed), ref[2:], "saved without the split, resumed with it (pp 4, v-min)")


def test_zero3_checkpoints_load_with_and_without_the_split(reference, saved, tmp_path):
    """Saved under ZeRO-3 + the split (pp 2 x dp 2, zbv) and resumed on one process without it; the checkpoint
    saved without the split resumed under ZeRO-3 + the split (1F1B)."""
    root, _, _ = saved
    ref = losses(reference[0])
    zero3 = ["--pipeline-model-parallel-size", "2", "--use-torch-fsdp2"]
    split = train(4, ITERS + VP + zero3 + ["--pipeline-schedule", "zbv", *V2, "--exit-interval", "2",
                                          "--save", str(tmp_path / "zero3")], str(tmp_path / "s.jsonl"))
    assert_same(losses(split), ref[:2], "ZeRO-3 + the split, saved")
    resumed = train(1, ITERS + ["--load", str(tmp_path / "zero3")], str(tmp_path / "a.jsonl"))
    assert_same(losses(resumed), ref[2:], "saved under ZeRO-3 with the split, resumed on one process without it")
    resumed = train(4, ITERS + VP + zero3 + ["--pipeline-schedule", "1f1b", "--load", str(root / "whole")],
                    str(tmp_path / "b.jsonl"))
    assert_same(losses(resumed), ref[2:], "saved without the split, resumed under ZeRO-3 with it")


def test_convert_hf_exports_the_whole_output_layer(saved, tmp_path):
    from safetensors.torch import load_file
    root, _, _ = saved
    heads = []
    for name in ("split", "whole"):
        proc = subprocess.run([sys.executable, "-m", "llamapipe", "convert-hf", "export", "--load", str(root / name),
                               "--hf-dir", str(tmp_path / name)], capture_output=True, text=True, timeout=300, cwd=ROOT)
        assert proc.returncode == 0, proc.stderr[-3000:]
        heads.append(load_file(os.path.join(tmp_path / name, "model.safetensors"))["lm_head.weight"])
    assert heads[0].shape == heads[1].shape == (250, 64)
    torch.testing.assert_close(heads[0], heads[1], rtol=1e-5, atol=1e-6)

"""End to end through torchrun: --rampup-batch-size with --train-samples on a 2-stage pipeline against one
process, with a resume mid-ramp, the sample-based learning rate, the norms and throughput in the JSONL
records; the final validation, the per-iteration JSONL under the default --log-interval, the summary line
and W&B (offline)."""
import glob
import json
import math

import pytest

from tests.cli import TINY, torchrun
from tests.unit.test_training_log import read_wandb_run

# TINY without its iteration-based warmup: a --train-samples run counts warmup in samples
BASE = [flag for i, flag in enumerate(TINY) if flag != "--lr-warmup-iters" and TINY[i - 1] != "--lr-warmup-iters"]
LR, MIN_LR, WARMUP, SAMPLES = 1e-3, 1e-4, 4, 20
RAMP = ["--micro-batch-size", "1", "--global-batch-size", "6", "--rampup-batch-size", "2", "2", "8",
        "--train-samples", str(SAMPLES), "--lr-warmup-samples", str(WARMUP), "--lr-decay-style", "cosine",
        "--min-lr", str(MIN_LR), "--log-params-norm", "--log-num-zeros-in-grad", "--log-throughput"]
# Megatron's ramp 2 -> 6 by 2 over 8 samples (one step every 4 samples), then 6 until 20 samples
BATCHES, CONSUMED = [2, 2, 4, 6, 6], [2, 4, 8, 14, 20]


def _run(nproc: int, args: list[str], jsonl: str, **kw) -> tuple[list[dict], str]:
    proc = torchrun(nproc, BASE + args + ["--metrics-jsonl", jsonl], **kw)
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    with open(jsonl) as f:
        return [json.loads(line) for line in f], proc.stdout


def _lr_after(samples: int) -> float:
    """The learning rate after `samples` consumed samples (Megatron's formula; decay over --train-samples)."""
    if samples <= WARMUP:
        return LR * samples / WARMUP
    ratio = (samples - WARMUP) / (SAMPLES - WARMUP)
    return MIN_LR + (LR - MIN_LR) * 0.5 * (math.cos(math.pi * ratio) + 1.0)


@pytest.mark.slow
def test_rampup_on_a_pipeline_matches_one_process_and_resumes_mid_ramp(tmp_path):
    """pp=2 stops after iteration 2 (4 of the 8 ramp samples consumed), saves, and a second run resumes from
    the checkpoint: together they give the one-process run's batch sizes, learning rates and losses. The
    first iteration of each run has no throughput."""
    ref, _ = _run(1, RAMP, str(tmp_path / "ref.jsonl"))
    pp2 = RAMP + ["--pipeline-model-parallel-size", "2", "--save", str(tmp_path / "ckpt")]
    head, _ = _run(2, pp2 + ["--exit-interval", "2"], str(tmp_path / "head.jsonl"))
    tail, _ = _run(2, pp2 + ["--load", str(tmp_path / "ckpt")], str(tmp_path / "tail.jsonl"))
    assert [r["iteration"] for r in head] == [1, 2] and [r["iteration"] for r in tail] == [3, 4, 5]
    for rows in (ref, head + tail):
        assert [r["iteration"] for r in rows] == [1, 2, 3, 4, 5]
        assert [r["global_batch_size"] for r in rows] == BATCHES
        assert [r["consumed_samples"] for r in rows] == CONSUMED
        assert [r["lr"] for r in rows] == pytest.approx([_lr_after(n) for n in CONSUMED], rel=1e-12)
    assert [r["tokens_per_sec"] is None for r in ref] == [True, False, False, False, False]
    assert [r["tokens_per_sec"] is None for r in head + tail] == [True, False, True, False, False]
    for a, b in zip(ref, head + tail):
        assert b["lm_loss"] == pytest.approx(a["lm_loss"], rel=1e-5)
        assert b["params_norm"] == pytest.approx(a["params_norm"], rel=1e-5)
        assert b["num_zeros_in_grad"] == a["num_zeros_in_grad"]


@pytest.mark.slow
def test_final_validation_summary_and_wandb(tmp_path):
    """--train-iters 5 --eval-interval 4: validation at 4 and after training at 5; under the default
    --log-interval 100 no iteration line is printed but every iteration has its JSONL record and W&B row
    (rank 0 writes the only run)."""
    args = ["--train-iters", "5", "--eval-interval", "4", "--eval-iters", "1", "--micro-batch-size", "1",
            "--global-batch-size", "4", "--log-interval", "100", "--wandb-project", "llamapipe-test",
            "--wandb-exp-name", "final-eval", "--wandb-save-dir", str(tmp_path / "wb")]
    rows, stdout = _run(2, args, str(tmp_path / "m.jsonl"), env={"WANDB_MODE": "offline", "WANDB_SILENT": "true"})
    train = {r["iteration"]: r["lm_loss"] for r in rows if "lm_loss" in r}
    valid = {r["iteration"]: r["valid_lm_loss"] for r in rows if "valid_lm_loss" in r}
    assert sorted(train) == [1, 2, 3, 4, 5] and sorted(valid) == [4, 5]
    assert "validation loss at iteration 4" in stdout and "validation loss at iteration 5" in stdout
    assert "iteration      1/" not in stdout
    before, after = (train[1] + train[2]) / 2, (train[4] + train[5]) / 2
    assert (f"mean lm loss {before:.4f} over iterations 1-2 -> {after:.4f} over iterations 4-5 (only 5 "
            "iterations, so means of 2 instead of means of 10)") in stdout
    (run_dir,) = glob.glob(str(tmp_path / "wb" / "wandb" / "offline-run-*"))
    run, _, history = read_wandb_run(run_dir)
    assert run == {"project": "llamapipe-test", "name": "final-eval"}
    assert {step: row["lm_loss"] for step, row in history.items()} == pytest.approx(train, rel=1e-12)
    assert {step: row["valid_lm_loss"] for step, row in history.items() if "valid_lm_loss" in row} == \
        pytest.approx(valid, rel=1e-12)

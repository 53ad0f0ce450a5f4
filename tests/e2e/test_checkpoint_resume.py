"""End to end through pretrain_llama.py (torchrun, 4 ranks): pp=2 dp=2 with the zb-h1 zero-bubble schedule
and ZeRO-1 saves every 3 iterations; resuming from the iteration-3 checkpoint alone reproduces
iterations 4..6 of the uninterrupted run bit for bit (loss, grad norm, learning rate)."""
from __future__ import annotations

import shutil

import pytest

from tests.cli import read_metrics, torchrun, train, TINY

FLAGS = ["--train-iters", "6", "--micro-batch-size", "1", "--global-batch-size", "8",
         "--pipeline-model-parallel-size", "2", "--pipeline-schedule", "zb-h1", "--use-distributed-optimizer"]


@pytest.mark.slow
def test_resume_from_mid_run_checkpoint_is_bit_exact(tmp_path):
    save = tmp_path / "run"
    full = train(4, FLAGS + ["--save", str(save), "--save-interval", "3"], str(tmp_path / "full.jsonl"))
    assert [r["iteration"] for r in full] == [1, 2, 3, 4, 5, 6]
    resume_dir = tmp_path / "resume"  # only the iteration-3 checkpoint, as if the job died after it
    resume_dir.mkdir()
    shutil.copytree(save / "iter_0000003", resume_dir / "iter_0000003")
    (resume_dir / "latest_checkpointed_iteration.txt").write_text("3\n")
    jsonl = str(tmp_path / "resumed.jsonl")
    proc = torchrun(4, TINY + FLAGS + ["--load", str(resume_dir), "--metrics-jsonl", jsonl])
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    resumed = read_metrics(jsonl)
    assert [r["iteration"] for r in resumed] == [4, 5, 6]
    for got, want in zip(resumed, full[3:]):
        for key in ("lm_loss", "grad_norm", "lr", "consumed_samples"):
            assert got[key] == want[key], f"iteration {got['iteration']} {key}: resumed {got[key]} vs {want[key]}"

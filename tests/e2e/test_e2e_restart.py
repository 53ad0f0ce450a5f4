"""A failure restarted: under `torchrun --max-restarts 3` a rank SIGKILLed at three points of one job (during
a checkpoint save, during validation, during the first iteration after a resume; the test hook
LLAMAPIPE_TEST_KILL, fault_injection.py, one point per torchrun attempt) makes the job restart and resume from
the newest valid checkpoint by itself: it finishes with every iteration's loss equal to an uninterrupted run's,
and each restart's log line says how many iterations were lost and how long the restart took."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

from tests.cli import ROOT, TINY, free_port, read_metrics, train

pytestmark = pytest.mark.slow

FLAGS = ["--micro-batch-size", "1", "--global-batch-size", "4", "--lr-decay-style", "constant",
         "--pipeline-model-parallel-size", "2", "--pipeline-schedule", "zb-h2", "--train-iters", "8",
         "--eval-interval", "5", "--eval-iters", "1"]
KILLS = "point=save,iteration=4,rank=1;point=validation,iteration=5,rank=0;point=resume,rank=1"


def test_a_rank_killed_during_a_save_a_validation_and_a_resume_restarts_to_the_uninterrupted_losses(tmp_path):
    ckpt, jsonl = str(tmp_path / "ckpt"), str(tmp_path / "run.jsonl")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
           "--master_port", str(free_port()), "--max-restarts", "3", "--monitor-interval", "0.2",
           "pretrain_llama.py", *TINY, *FLAGS, "--save", ckpt, "--load", ckpt, "--save-interval", "2",
           "--metrics-jsonl", jsonl]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT, LLAMAPIPE_TEST_KILL=KILLS)
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-5000:]
    assert "Traceback" not in out, out[-5000:]     # the killed attempts' survivors stop in one line each
    # attempt 0: killed saving iteration 4 (the save at 2 is the newest valid); attempt 1: killed validating
    # at 5 (4 saved); attempt 2: killed in its first iteration after resuming at 4
    lines = re.findall(r"restart \d \(torchrun --max-restarts\).*", out)
    assert len(lines) == 3, out[-5000:]
    assert "stopped while saving iteration 4; resumed from the checkpoint at iteration 2, so 2 iterations lost" \
        in lines[0], lines
    assert "stopped while validating at iteration 5; resumed from the checkpoint at iteration 4, so 1 iteration " \
        "lost" in lines[1], lines
    assert "stopped after iteration 4; resumed from the checkpoint at iteration 4, so 0 iterations lost" \
        in lines[2], lines
    records = [json.loads(line) for line in open(jsonl) if '"event": "restart"' in line]
    assert [(r["restart"], r["iterations_lost"]) for r in records] == [(1, 2), (2, 1), (3, 0)]
    assert all(r["restart_seconds"] > 0 for r in records)
    rows = {r["iteration"]: r["lm_loss"] for r in read_metrics(jsonl)}    # the last record of each iteration
    reference = train(2, FLAGS, str(tmp_path / "reference.jsonl"))
    assert rows == {r["iteration"]: r["lm_loss"] for r in reference}
    assert open(os.path.join(ckpt, "latest_checkpointed_iteration.txt")).read().strip() == "8"

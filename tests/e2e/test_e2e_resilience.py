"""Never lose work: SIGTERM on one rank, a killed worker under torchrun --max-restarts, non-finite loss.

All through the CLI (torchrun subprocesses, gloo, fp32). The learning rate is constant so a run's losses
do not depend on --train-iters and interrupted runs can be compared with an uninterrupted reference.
"""
from __future__ import annotations

import math
import os
import re
import signal
import subprocess
import sys
import time

import pytest

from tests.cli import ROOT, TINY, free_port, read_metrics, torchrun, train

FLAGS = ["--micro-batch-size", "1", "--global-batch-size", "4", "--lr-decay-style", "constant",
         "--pipeline-model-parallel-size", "2", "--pipeline-schedule", "zb-h2"]


def _children(pid: int) -> list[int]:
    """Direct child processes of `pid` (from /proc, no extra dependency)."""
    kids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    if int(f.read().rsplit(")", 1)[1].split()[1]) == pid:
                        kids.append(int(entry))
            except (OSError, IndexError, ValueError):
                continue
    return kids


def _launch(args: list[str], extra: list[str] | None = None) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
           "--master_port", str(free_port()), *(extra or []), "pretrain_llama.py", *TINY, *args]
    return subprocess.Popen(cmd, cwd=ROOT, env=dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _wait_for_iteration(jsonl: str, iteration: int, proc: subprocess.Popen, timeout: float = 180) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if os.path.exists(jsonl) and len(read_metrics(jsonl)) >= iteration:
            return
        assert proc.poll() is None, proc.communicate()[0][-3000:]
        time.sleep(0.05)
    raise AssertionError(f"no iteration {iteration} within {timeout}s")


def _workers(proc: subprocess.Popen) -> list[int]:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        workers = _children(proc.pid)
        if len(workers) == 2:
            return workers
        time.sleep(0.1)
    raise AssertionError(f"expected 2 workers under torchrun, found {_children(proc.pid)}")


@pytest.mark.parametrize("overlap", [[], ["--enable-optimizer-post-validation"]], ids=["sync", "post-validation"])
def test_sigterm_on_one_rank_saves_same_iteration_everywhere_and_resume_continues(tmp_path, overlap):
    """Under post-validation the ranks agree on the signal one iteration later, without a barrier per
    iteration, and drain before saving; the checkpoint then resumes (without the flag) bit-identically."""
    save, jsonl = str(tmp_path / "ckpt"), str(tmp_path / "run.jsonl")
    proc = _launch(FLAGS + overlap + ["--train-iters", "1000", "--exit-signal-handler", "--save", save,
                                      "--metrics-jsonl", jsonl])
    _wait_for_iteration(jsonl, 2, proc)
    os.kill(_workers(proc)[1], signal.SIGTERM)         # only rank 1 is told; all ranks must agree
    out = proc.communicate(timeout=180)[0]
    assert proc.returncode == 0, out[-3000:]
    stopped_at = read_metrics(jsonl)[-1]["iteration"]
    assert 2 <= stopped_at < 1000
    assert open(os.path.join(save, "latest_checkpointed_iteration.txt")).read().strip() == str(stopped_at)
    assert sorted(os.listdir(save)) == [f"iter_{stopped_at:07d}", "latest_checkpointed_iteration.txt"]

    end = stopped_at + 3
    resumed = train(2, FLAGS + ["--train-iters", str(end), "--load", save], str(tmp_path / "resumed.jsonl"))
    reference = train(2, FLAGS + ["--train-iters", str(end)], str(tmp_path / "reference.jsonl"))
    assert [r["iteration"] for r in resumed] == list(range(stopped_at + 1, end + 1))
    assert [r["lm_loss"] for r in resumed] == [r["lm_loss"] for r in reference[stopped_at:]]


def test_sigterm_to_torchrun_itself_saves_before_workers_are_killed(tmp_path):
    """SLURM signals the launcher: torchrun forwards SIGTERM, the workers agree, save and exit in time."""
    save, jsonl = str(tmp_path / "ckpt"), str(tmp_path / "run.jsonl")
    proc = _launch(FLAGS + ["--train-iters", "1000", "--exit-signal-handler", "--save", save,
                            "--metrics-jsonl", jsonl])
    _wait_for_iteration(jsonl, 2, proc)
    proc.send_signal(signal.SIGTERM)
    proc.communicate(timeout=180)
    stopped_at = read_metrics(jsonl)[-1]["iteration"]
    assert stopped_at < 1000
    assert open(os.path.join(save, "latest_checkpointed_iteration.txt")).read().strip() == str(stopped_at)


def test_torchrun_max_restarts_resumes_a_killed_worker_to_the_same_final_loss(tmp_path):
    ckpt, jsonl = str(tmp_path / "ckpt"), str(tmp_path / "run.jsonl")
    args = FLAGS + ["--train-iters", "10", "--save", ckpt, "--load", ckpt, "--save-interval", "2",
                    "--metrics-jsonl", jsonl]
    proc = _launch(args, extra=["--max-restarts", "1", "--monitor-interval", "0.2"])
    _wait_for_iteration(jsonl, 3, proc)
    os.kill(_workers(proc)[0], signal.SIGKILL)
    out = proc.communicate(timeout=300)[0]
    assert proc.returncode == 0, out[-4000:]
    rows = read_metrics(jsonl)
    assert rows[-1]["iteration"] == 10
    # The restarted workers resume from the newest checkpoint K and log K+1..10 again (none repeated when the
    # kill lands between the save at K and iteration K+1's log line, so count on the resume line, not repeats).
    resumed = re.findall(rf"resumed from {re.escape(ckpt)} at iteration (\d+)", out)
    assert resumed, "the restarted workers should have resumed from a checkpoint\n" + out[-3000:]
    k = int(resumed[-1])
    assert k % 2 == 0 and 2 <= k < 10
    assert [r["iteration"] for r in rows[-(10 - k):]] == list(range(k + 1, 11))
    reference = train(2, FLAGS + ["--train-iters", "10"], str(tmp_path / "reference.jsonl"))
    assert rows[-1]["lm_loss"] == reference[-1]["lm_loss"]


def _inject(tmp_path, extra: list[str]) -> tuple[subprocess.CompletedProcess, list[dict]]:
    jsonl = str(tmp_path / "m.jsonl")
    args = ["--inject-inf-iteration", "2", "--"] + TINY + FLAGS + ["--train-iters", "4", "--metrics-jsonl", jsonl]
    proc = torchrun(2, args + extra, script="tests/scripts/inject_inf.py")
    return proc, (read_metrics(jsonl) if os.path.exists(jsonl) else [])


def test_nonfinite_loss_stops_the_run_naming_the_iteration(tmp_path):
    proc, rows = _inject(tmp_path, [])
    assert proc.returncode != 0
    assert "iteration 2: lm loss is inf" in proc.stdout + proc.stderr
    assert [r["iteration"] for r in rows] == [1]


def test_skip_nonfinite_steps_skips_and_goes_on(tmp_path):
    proc, rows = _inject(tmp_path, ["--skip-nonfinite-steps"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "skipped iteration 2" in proc.stdout + proc.stderr
    assert [r["iteration"] for r in rows] == [1, 3, 4]
    assert all(math.isfinite(r["lm_loss"]) for r in rows) and rows[-1]["skipped_iterations"] == 1

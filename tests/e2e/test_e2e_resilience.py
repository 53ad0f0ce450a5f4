"""Never lose work: SIGTERM on one rank, on the launcher or on every process of the job (with data-loader
workers), a killed worker under torchrun --max-restarts, a failure on one rank, a full disk under the metrics,
non-finite loss.

All through the CLI (torchrun subprocesses, gloo, fp32). The learning rate is constant so a run's losses
do not depend on --train-iters and interrupted runs can be compared with an uninterrupted reference.
"""
from __future__ import annotations

import json
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


def _foreground_sigint() -> None:
    """In the child: SIGINT as a terminal's foreground job has it. A suite run as a background job (`... &` in a
    script) hands its children SIGINT ignored, which the run rightly keeps (signals.py), so Ctrl-C could not be
    tested there."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _launch(args: list[str], extra: list[str] | None = None) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
           "--master_port", str(free_port()), *(extra or []), "pretrain_llama.py", *TINY, *args]
    # Its own session, so a test can signal the launcher's process group as SLURM does.
    return subprocess.Popen(cmd, cwd=ROOT, env=dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
                            preexec_fn=_foreground_sigint)


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


LOADER = ["--num-workers", "2"]     # Megatron's default: data-loader worker processes in each rank's group


@pytest.fixture(scope="module")
def reference_16(tmp_path_factory) -> list[dict]:
    """The uninterrupted run's losses (constant LR: they do not depend on --train-iters)."""
    return train(2, FLAGS + ["--train-iters", "16"], str(tmp_path_factory.mktemp("ref") / "reference.jsonl"))


def _no_traceback_from_ranks(out: str) -> None:
    """torchrun prints its own SignalException/ChildFailedError traceback; the ranks print none."""
    assert f'File "{os.path.join(ROOT, "llamapipe")}' not in out and "DataLoader worker" not in out, out[-4000:]


@pytest.mark.parametrize("target", ["launcher", "every-process"])
def test_sigterm_with_loader_workers_saves_and_resumes_to_the_uninterrupted_losses(tmp_path, reference_16, target):
    """torchrun forwards SIGTERM to each rank's process group (data-loader workers included) and SIGKILLs what
    is left after --shutdown-timeout (30 s); SLURM signals every process of the job. The workers ignore it,
    the ranks agree, save and exit 0 (torchrun itself still exits 1, re-raising the signal it got)."""
    save, jsonl = str(tmp_path / "ckpt"), str(tmp_path / "run.jsonl")
    proc = _launch(FLAGS + LOADER + ["--train-iters", "1000", "--exit-signal-handler", "--save", save,
                                     "--metrics-jsonl", jsonl])
    _wait_for_iteration(jsonl, 2, proc)      # mid-run: 2 of 1000 iterations logged, loader workers busy
    if target == "launcher":
        proc.send_signal(signal.SIGTERM)
    else:
        for group in [proc.pid] + _workers(proc):  # torchrun starts each rank in its own session
            os.killpg(group, signal.SIGTERM)
    out = proc.communicate(timeout=180)[0]
    _no_traceback_from_ranks(out)
    stopped_at = read_metrics(jsonl)[-1]["iteration"]
    assert 2 <= stopped_at <= 14, out[-3000:]
    assert f"exiting at iteration {stopped_at}" in out
    assert open(os.path.join(save, "latest_checkpointed_iteration.txt")).read().strip() == str(stopped_at)
    resumed = train(2, FLAGS + LOADER + ["--train-iters", str(stopped_at + 2), "--load", save],
                    str(tmp_path / "resumed.jsonl"))
    assert [r["iteration"] for r in resumed] == [stopped_at + 1, stopped_at + 2]
    assert [r["lm_loss"] for r in resumed] == [r["lm_loss"] for r in reference_16[stopped_at:stopped_at + 2]]


@pytest.mark.parametrize("rank,where,message", [
    (0, "data", "--data-path shard /data/shard_07.bin: cannot read it on this node (injected)"),
    (1, "train", "[Errno 5] reading /data/shard_07.bin: Input/output error (injected)")], ids=["rank0-data", "rank1-train"])
def test_a_failure_on_one_rank_stops_the_others_with_one_line_each(tmp_path, rank, where, message):
    """The failing rank's one-line error; every other rank one line naming it, no traceback (before: a silent
    rank 1, or a gloo traceback on the rank that waited for it); a rank left waiting would hit the timeout."""
    proc = torchrun(2, ["--fail-rank", str(rank), "--fail-in", where, "--"] + TINY + FLAGS + ["--train-iters", "5"],
                    script="tests/scripts/fail_on_rank.py", timeout=120)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0
    _no_traceback_from_ranks(out)
    prefix = "pretrain_llama.py: error: " + ("" if rank == 0 else f"rank {rank}: ")
    assert [line for line in out.splitlines() if line.startswith("pretrain_llama.py: error:")] == [prefix + message]
    assert f"rank {1 - rank}: stopping: rank {rank} failed (its error is above)" in out, out[-3000:]


def test_full_disk_under_metrics_and_tensorboard_warns_once_each_and_still_saves(tmp_path):
    """--metrics-jsonl on a full disk (/dev/full) and an unwritable --tensorboard-dir: one warning each, the
    run trains to the end and saves (before: tracebacks on both ranks, nothing saved)."""
    pytest.importorskip("tensorboard")
    if not os.path.exists("/dev/full"):
        pytest.skip("needs Linux's /dev/full")
    blocker = tmp_path / "not_a_dir"
    blocker.write_text("")
    save = str(tmp_path / "ckpt")
    proc = torchrun(2, TINY + FLAGS + ["--train-iters", "3", "--save", save, "--metrics-jsonl", "/dev/full",
                                       "--tensorboard-dir", str(blocker / "tb")])
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    assert "Traceback" not in out, out[-4000:]
    for flag in ("--metrics-jsonl /dev/full", f"--tensorboard-dir {blocker / 'tb'}"):
        assert len(re.findall(rf"\] {re.escape(flag)}: cannot write", out)) == 1, out[-4000:]
    assert open(os.path.join(save, "latest_checkpointed_iteration.txt")).read().strip() == "3"


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
    records = [json.loads(line) for line in open(tmp_path / "m.jsonl")]
    assert [(r["iteration"], r["skipped"]) for r in records] == [(1, False), (2, True), (3, False), (4, False)]
    assert records[1]["skip_reason"] == "lm loss is inf" and "lm_loss" not in records[1]


def test_all_skipped_fp16_run_writes_one_record_per_iteration(tmp_path):
    """An initial loss scale of 1e30 overflows the fp16 gradients at every step (halving it three times does
    not help): every step is skipped (before: an empty JSONL)."""
    jsonl = tmp_path / "m.jsonl"
    args = FLAGS + ["--train-iters", "3", "--fp16", "--initial-loss-scale", "1e30", "--metrics-jsonl", str(jsonl)]
    proc = torchrun(2, TINY + args)
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = [json.loads(line) for line in open(jsonl)]
    assert [(r["iteration"], r["skipped"], r["skipped_iterations"]) for r in records] == \
        [(1, True, 1), (2, True, 2), (3, True, 3)]
    assert all(r["skip_reason"].startswith("inf/nan in gradients") and "lm_loss" not in r for r in records)


# Ctrl-C and the signal a job chooses (issue 40). One process (no torchrun) gets Ctrl-C as a terminal sends it: to
# its whole process group, data-loader workers included; torchrun passes SIGINT on to each rank's process group.
SINGLE = ["--micro-batch-size", "1", "--global-batch-size", "4", "--lr-decay-style", "constant"]


def _start_single(args: list[str]) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "pretrain_llama.py", *TINY, *args], cwd=ROOT,
                            env=dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True,
                            preexec_fn=_foreground_sigint)


def _start(target: str, args: list[str]) -> subprocess.Popen:
    return _start_single(SINGLE + args) if target == "single" else _launch(FLAGS + args)


def _send(proc: subprocess.Popen, target: str, sig: int) -> None:
    if target == "launcher":
        proc.send_signal(sig)
    else:   # Ctrl-C in a terminal, or SLURM: every process of the job
        for group in [proc.pid] + (_workers(proc) if target == "every-process" else []):
            os.killpg(group, sig)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.parametrize("target,sig", [("single", "SIGINT"), ("single", "SIGUSR1"), ("launcher", "SIGINT"),
                                        ("every-process", "SIGINT")])
def test_ctrl_c_or_the_exit_signal_with_the_handler_saves_and_resumes_to_the_uninterrupted_losses(
        tmp_path, reference_16, target, sig):
    """Before: Ctrl-C gave a KeyboardInterrupt traceback from every rank, nothing saved (torchrun SIGKILLed the
    ranks after 30 s); a single process then hung. SIGUSR1 is chosen with --exit-signal, as SLURM's
    --signal=USR1@120 jobs do."""
    save, jsonl = str(tmp_path / "ckpt"), str(tmp_path / "run.jsonl")
    chosen = ["--exit-signal", sig] if sig != "SIGINT" else []
    proc = _start(target, LOADER + chosen + ["--train-iters", "1000", "--exit-signal-handler", "--save", save,
                                            "--metrics-jsonl", jsonl])
    _wait_for_iteration(jsonl, 2, proc)
    _send(proc, target, getattr(signal, sig))
    out = proc.communicate(timeout=180)[0]
    _no_traceback_from_ranks(out)
    if target == "single":
        assert proc.returncode == 0, out[-3000:]
    stopped_at = read_metrics(jsonl)[-1]["iteration"]
    assert 2 <= stopped_at <= 14, out[-3000:]
    assert f"{sig} received; saving at iteration {stopped_at} and exiting" in out, out[-3000:]
    assert open(os.path.join(save, "latest_checkpointed_iteration.txt")).read().strip() == str(stopped_at)
    assert not os.path.exists(os.path.join(save, "llamapipe.lock"))
    nproc, flags = (1, SINGLE) if target == "single" else (2, FLAGS)
    resumed = train(nproc, flags + LOADER + ["--train-iters", str(stopped_at + 2), "--load", save],
                    str(tmp_path / "resumed.jsonl"))
    reference = reference_16 if nproc == 2 else train(1, SINGLE + ["--train-iters", str(stopped_at + 2)],
                                                       str(tmp_path / "reference.jsonl"))
    assert [r["iteration"] for r in resumed] == [stopped_at + 1, stopped_at + 2]
    assert [r["lm_loss"] for r in resumed] == [r["lm_loss"] for r in reference[stopped_at:stopped_at + 2]]


@pytest.mark.parametrize("target", ["single", "launcher", "every-process"])
def test_ctrl_c_without_the_handler_stops_in_one_line_per_rank_without_a_hang(tmp_path, target):
    """Without --exit-signal-handler Ctrl-C stops the run at once: one line per rank naming the signal and the
    iteration, no traceback, the data-loader workers gone, the --save lock released, and the process ends
    (before: a KeyboardInterrupt traceback, then a hang with both workers alive after 60 s)."""
    save, jsonl = tmp_path / "ckpt", str(tmp_path / "run.jsonl")
    proc = _start(target, LOADER + ["--train-iters", "1000", "--save", str(save), "--metrics-jsonl", jsonl])
    _wait_for_iteration(jsonl, 2, proc)
    ranks = [proc.pid] if target == "single" else _workers(proc)
    loaders = [pid for rank in ranks for pid in _children(rank)]
    assert len(loaders) == 2 * len(ranks), loaders
    _send(proc, target, signal.SIGINT)
    out = proc.communicate(timeout=60)[0]      # it ends in seconds; the timeout only catches a hang
    _no_traceback_from_ranks(out)
    assert "KeyboardInterrupt" not in out, out[-3000:]
    lines = [line for line in out.splitlines() if "stopped by SIGINT" in line]
    assert len(lines) == len(ranks), out[-3000:]
    prefixes = ["pretrain_llama.py: "] + [f"pretrain_llama.py: rank {r}: " for r in range(1, len(ranks))]
    for line in lines:
        assert any(re.fullmatch(re.escape(p) + r"stopped by SIGINT at iteration \d+; the work since the last "
                                r"checkpoint is not saved \(--exit-signal-handler saves before stopping\)", line)
                   for p in prefixes), line
    if target == "single":
        assert proc.returncode == -signal.SIGINT, out[-3000:]
    assert not (save / "llamapipe.lock").exists()
    assert not [pid for pid in ranks + loaders if _alive(pid)]


_SLOW_RANK0 = """
import os, sys, time
sys.path.insert(0, {root!r})
if os.environ["RANK"] == "0":
    time.sleep(120)      # rank 0 is busy (a slow file system, a loaded node) when the others reach the bad flag
from llamapipe.train import main
sys.exit(main())
"""


@pytest.mark.parametrize("bad", [["--rope-theta", "5e5"], ["--exit-signal", "SIGKILL"]], ids=["check", "argparse"])
def test_a_flag_error_is_written_by_the_first_rank_to_find_it(tmp_path, bad):
    """Issue 40: only rank 0 wrote a flag error; when another rank exited first, torchrun killed rank 0 before it
    wrote, and the user saw only torchrun's ChildFailedError. The first rank to reach the error writes it."""
    script = tmp_path / "slow_rank0.py"
    script.write_text(_SLOW_RANK0.format(root=ROOT))
    proc = torchrun(2, TINY + FLAGS + ["--train-iters", "2"] + bad, script=str(script), timeout=120)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0
    errors = [line for line in out.splitlines() if line.startswith("pretrain_llama.py: error:")]
    assert len(errors) == 1 and bad[0] in errors[0], out[-3000:]

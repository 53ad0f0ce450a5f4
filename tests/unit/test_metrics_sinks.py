"""Metrics writers that survive a full disk, and one JSONL record per iteration, skipped ones included.

A sink whose write fails (ENOSPC, a vanished directory, a W&B service that died) warns once, naming the
flag and file, and is dropped; the other sinks and training go on (issue 32 items 4 and 11)."""
import errno
import json
import logging
import os

import pytest

from llamapipe.training.config import LoggingConfig
from llamapipe.training.log import MetricsWriter
from llamapipe.training.progress import TrainingProgress
from tests.unit.test_training_log import MODEL, log_lines  # noqa: F401 - the fixture

RECORD = {"iteration": 1, "lm_loss": 2.5, "lr": 1e-3}


class _Failing:
    """Stands in for a SummaryWriter / W&B run whose every write fails as on a full disk."""

    def __init__(self) -> None:
        self.calls = 0

    def _fail(self, *args, **kwargs) -> None:
        self.calls += 1
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    add_scalar = log = close = finish = _fail


def _warnings(lines: list[str], flag: str) -> list[str]:
    return [line for line in lines if line.startswith(flag)]


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs Linux's /dev/full")
def test_jsonl_on_a_full_disk_warns_once_and_the_other_sinks_go_on(tmp_path, log_lines):  # noqa: F811
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    tb_dir = str(tmp_path / "tb")
    writer = MetricsWriter(LoggingConfig(metrics_jsonl="/dev/full", tensorboard_dir=tb_dir), enabled=True)
    for it in (1, 2, 3):
        writer.write(dict(RECORD, iteration=it))
    writer.close()
    warned = _warnings(log_lines, "--metrics-jsonl /dev/full")
    assert len(warned) == 1 and "No space left on device" in warned[0], log_lines
    events = EventAccumulator(tb_dir)
    events.Reload()
    assert [e.step for e in events.Scalars("lm_loss")] == [1, 2, 3]   # TensorBoard kept every record


@pytest.mark.parametrize("sink", ["_tb", "_wandb"])
def test_tensorboard_and_wandb_failing_mid_run_warn_once_and_jsonl_goes_on(tmp_path, log_lines, sink):  # noqa: F811
    path = str(tmp_path / "m.jsonl")
    writer = MetricsWriter(LoggingConfig(metrics_jsonl=path, tensorboard_dir=None), enabled=True)
    failing = _Failing()
    setattr(writer, sink, failing)
    for it in (1, 2, 3):
        writer.write(dict(RECORD, iteration=it))
    writer.close()
    # The write that failed, then (TensorBoard only) one quiet close; nothing after that.
    assert failing.calls == {"_tb": 2, "_wandb": 1}[sink]
    flag = {"_tb": "--tensorboard-dir", "_wandb": "--wandb-project"}[sink]
    assert len(_warnings(log_lines, flag)) == 1, log_lines
    assert [json.loads(line)["iteration"] for line in open(path)] == [1, 2, 3]


def test_unwritable_tensorboard_dir_at_start_warns_and_training_goes_on(tmp_path, log_lines):  # noqa: F811
    pytest.importorskip("tensorboard")
    blocker = tmp_path / "file"
    blocker.write_text("")
    path = str(tmp_path / "m.jsonl")
    writer = MetricsWriter(LoggingConfig(metrics_jsonl=path, tensorboard_dir=str(blocker / "tb")), enabled=True)
    writer.write(RECORD)
    writer.close()
    assert len(_warnings(log_lines, f"--tensorboard-dir {blocker / 'tb'}")) == 1, log_lines
    assert [json.loads(line) for line in open(path)] == [{**RECORD, "run_id": writer.run_id}]


def test_skipped_iterations_get_a_record_each_and_end_console_intervals(tmp_path, log_lines):  # noqa: F811
    """Iterations 1, 3 trained, 2 and 4 skipped, --log-interval 2: four records in order, the skipped ones
    without lm_loss; two console lines (iteration 4 ends the second interval though it was skipped)."""
    path = str(tmp_path / "m.jsonl")
    writer = MetricsWriter(LoggingConfig(metrics_jsonl=path, log_interval=2), enabled=True)
    progress = TrainingProgress(writer, MODEL, seq_length=8, world_size=1, train_iters=4, log_interval=2)
    common = dict(global_batch_size=4, seconds=0.5, lr=1e-3)
    for it in (1, 3):
        progress.iteration(iteration=it, consumed_samples=4 * it, loss=3.0 - it / 10, loss_scale=1024.0,
                           grad_norm=0.5, skipped_iterations=it // 2, **common)
        progress.skipped(iteration=it + 1, consumed_samples=4 * (it + 1), loss_scale=512.0,
                         skipped_iterations=it // 2 + 1, reason="inf/nan in gradients", **common)
    writer.close()
    rows = [json.loads(line) for line in open(path)]
    assert [(r["iteration"], r["skipped"]) for r in rows] == [(1, False), (2, True), (3, False), (4, True)]
    assert rows[3] == {"iteration": 4, "consumed_samples": 16, "global_batch_size": 4, "elapsed_ms": 500.0,
                       "lr": 1e-3, "loss_scale": 512.0, "skipped_iterations": 2, "skipped": True,
                       "skip_reason": "inf/nan in gradients", "run_id": writer.run_id}
    lines = [line for line in log_lines if line.startswith("iteration")]
    assert len(lines) == 2 and "lm loss: 2.900000E+00" in lines[0] and "lm loss: 2.700000E+00" in lines[1]


def test_jsonl_cut_short_by_a_full_disk_keeps_whole_lines_and_a_resume_starts_a_fresh_line(
        tmp_path, log_lines, monkeypatch):  # noqa: F811
    """Issue 51: a record the disk cut short stayed half-written, and the resumed run's first record was
    appended onto it (an unparseable line). Now the cut record is taken back; a file an older version left
    mid-line gets a newline before the first record."""
    path = tmp_path / "m.jsonl"
    writer = MetricsWriter(LoggingConfig(metrics_jsonl=str(path), tensorboard_dir=None), enabled=True)
    writer.write(dict(RECORD, iteration=1))
    real_write = os.write

    def disk_fills(fd: int, data: bytes) -> int:   # the jsonl's fd takes 5 bytes, then the disk is full
        return real_write(fd, data[:5]) if fd == writer._jsonl.fd else real_write(fd, data)

    monkeypatch.setattr(os, "write", disk_fills)
    writer.write(dict(RECORD, iteration=2))
    monkeypatch.undo()
    writer.close()
    assert len(_warnings(log_lines, f"--metrics-jsonl {path}")) == 1, log_lines
    assert [json.loads(line)["iteration"] for line in path.read_text().splitlines()] == [1]
    with open(path, "a") as fh:     # what an older version's cut-short record left
        fh.write('{"iteration": 2, "lm_')
    resumed = MetricsWriter(LoggingConfig(metrics_jsonl=str(path), tensorboard_dir=None), enabled=True)
    resumed.write(dict(RECORD, iteration=2))
    resumed.close()
    lines = path.read_text().splitlines()
    assert lines[1] == '{"iteration": 2, "lm_' and json.loads(lines[2])["iteration"] == 2, lines

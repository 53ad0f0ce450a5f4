"""training/restart_record.py: the progress record a restarted attempt reads, the restart line, the save-cost
line (the end-to-end restarts are tests/e2e/test_e2e_restart.py)."""
from __future__ import annotations

import json
import os

import pytest

from llamapipe.training.restart_record import (PROGRESS_FILE, ProgressRecord, read_progress, restart_line,
                                              restart_report, save_cost_line)


def test_a_restarted_attempt_reads_what_the_failed_one_reached_and_says_what_was_lost(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    monkeypatch.setenv("TORCHELASTIC_MAX_RESTARTS", "3")
    record = ProgressRecord(str(tmp_path), enabled=True)
    record.note(7)
    record.note(8, "saving")
    written = json.loads((tmp_path / PROGRESS_FILE).read_text())
    assert written["iteration"] == 8 and written["phase"] == "saving" and written["attempt"] == 0
    assert restart_report(str(tmp_path), 6) is None, "a first start reports nothing"
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    report = restart_report(str(tmp_path), 6, now=written["time"] + 12.5)
    assert report["iterations_lost"] == 2 and report["restart_seconds"] == pytest.approx(12.5)
    assert report["failed_while"] == "saving" and report["restart"] == 1
    assert restart_line(report).startswith("restart 1 (torchrun --max-restarts): the failed attempt stopped while "
                                           "saving iteration 8; resumed from the checkpoint at iteration 6, so 2 "
                                           "iterations lost; the restart took 12.5 s")
    assert [n for n in os.listdir(tmp_path)] == [PROGRESS_FILE], "no temporary file is left"


def test_no_record_a_damaged_one_or_rank_1_write_nothing_and_report_nothing(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "2")
    monkeypatch.setenv("TORCHELASTIC_MAX_RESTARTS", "3")
    ProgressRecord(str(tmp_path), enabled=False).note(3)
    monkeypatch.setenv("TORCHELASTIC_MAX_RESTARTS", "0")     # a job torchrun will not restart: no file
    ProgressRecord(str(tmp_path), enabled=True).note(3)
    assert not os.listdir(tmp_path) and restart_report(str(tmp_path), 0) is None
    (tmp_path / PROGRESS_FILE).write_text("{not json")
    assert read_progress(str(tmp_path)) is None and restart_report(str(tmp_path), 0) is None
    os.remove(tmp_path / PROGRESS_FILE)
    os.mkfifo(tmp_path / PROGRESS_FILE)     # never blocks, never a traceback
    assert read_progress(str(tmp_path)) is None


def test_an_unwritable_record_warns_once_and_training_goes_on(tmp_path, monkeypatch):
    blocker = tmp_path / "file"
    blocker.write_text("")
    monkeypatch.setenv("TORCHELASTIC_MAX_RESTARTS", "1")
    record = ProgressRecord(str(blocker / "ckpt"), enabled=True)
    record.note(1)
    assert record.path is None
    record.note(2)      # nothing more


def test_the_save_cost_line_gives_the_share_the_loss_and_youngs_interval():
    line = save_cost_line(100, 2.0, 1.0, 50)
    assert line.startswith("checkpoint at iteration 100 saved in 2.00 s: at --save-interval 50 (1.00 s per "
                           "iteration) saves take 3.8% of the run and a failure loses 25 iterations (25.0 s)")
    assert "saving every 588 s (--save-interval 588) costs least" in line     # sqrt(2 x 2 x 86400) = 587.9
    assert save_cost_line(3, 0.5, None, None) == "checkpoint at iteration 3 saved in 0.50 s"


def test_a_restartable_job_that_would_not_resume_is_told_at_start(tmp_path, monkeypatch, llamapipe_log):
    from llamapipe.training.arguments.parser import build_parser, config_from_args
    from tests.cli import TINY
    save, other = str(tmp_path / "ck"), str(tmp_path / "other")
    os.mkdir(save)
    os.mkdir(other)
    monkeypatch.setenv("TORCHELASTIC_MAX_RESTARTS", "3")
    for flags, said in ((["--save", save], "without --load a restarted attempt starts again from iteration 0"),
                        ([], "without --save a restarted attempt starts again from iteration 0"),
                        (["--save", save, "--load", other], f"a restarted attempt loads --load {other} again")):
        llamapipe_log.clear()
        config_from_args(build_parser().parse_args(TINY + flags), 1)
        [line] = [m for m in llamapipe_log if "torchrun --max-restarts" in m]
        assert line.startswith("notice: torchrun --max-restarts 3: " + said) and line.endswith("to resume"), line
    llamapipe_log.clear()
    config_from_args(build_parser().parse_args(TINY + ["--save", save, "--load", save]), 1)
    monkeypatch.setenv("TORCHELASTIC_MAX_RESTARTS", "0")
    config_from_args(build_parser().parse_args(TINY + ["--save", save]), 1)
    assert not [m for m in llamapipe_log if "torchrun --max-restarts" in m]


def test_a_restart_that_loaded_nothing_says_it_started_again():
    line = restart_line({"restart": 1, "failed_while": "training", "failed_at_iteration": 5,
                         "resumed_from_iteration": 0, "iterations_lost": 5, "restart_seconds": 3.0})
    assert "stopped after iteration 5; started again from iteration 0 (nothing loaded), so 5 iterations lost" in line

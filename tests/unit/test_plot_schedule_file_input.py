"""`llamapipe plot-schedule --schedule-file` on a FIFO or a binary file (issue 51, items 3 and 12): one line naming
the file, without blocking on the FIFO."""
from __future__ import annotations

import os

from llamapipe.tools import plot_schedule


def test_a_fifo_is_refused_without_blocking(tmp_path, capsys):
    fifo = tmp_path / "s.csv"
    os.mkfifo(fifo)
    assert plot_schedule.main(["--schedule-file", str(fifo), "--out", str(tmp_path / "s.png")]) == 2
    err = capsys.readouterr().err
    assert err == f"llamapipe plot-schedule: error: schedule file {fifo} is a FIFO (named pipe), not a regular file\n"


def test_a_binary_file_is_refused_naming_it(tmp_path, capsys):
    binary = tmp_path / "s.csv"
    binary.write_bytes(b"\xff\xfe\x00\x81")
    assert plot_schedule.main(["--schedule-file", str(binary), "--out", str(tmp_path / "s.png")]) == 2
    err = capsys.readouterr().err
    assert f"schedule file {binary} is not UTF-8 text" in err and err.count("\n") == 1
    assert not (tmp_path / "s.png").exists()

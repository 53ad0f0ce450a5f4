"""--pipeline-trace's window at run time: a run that resumed past the window writes no file and says why."""
from __future__ import annotations

import logging
from types import SimpleNamespace

from llamapipe.core.logger import get_logger
from llamapipe.training.trace_log import PipelineTrace


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def test_a_run_resumed_after_the_window_writes_no_trace_and_says_why(tmp_path):
    ps = SimpleNamespace(rank=0, pp_ranks=[0], coords={"pp": 0}, size=lambda axis: 1)
    path = tmp_path / "t.json"
    trace = PipelineTrace(str(path), ps, start=1, end=3)
    handler = _Lines()
    get_logger().addHandler(handler)
    try:
        for completed in (5, 6, 7):          # resumed at iteration 5: the window (iterations 2-3) never opens
            trace.before_iteration(completed)
        trace.finish()
    finally:
        get_logger().removeHandler(handler)
    assert not path.exists() and trace.written
    [line] = [m for m in handler.lines if "--pipeline-trace" in m]
    assert "nothing traced and no file written" in line and "iterations 2-3" in line and "resumed" in line
    assert "opens when 1 iteration is complete" in line, line

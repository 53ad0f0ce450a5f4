"""The hang watchdog in one process: two ranks' watches share an in-memory store in place of the c10d one; a
stalled step is reported once, written as JSON into --save, and both ranks leave with status 1 (or keep waiting)."""
from __future__ import annotations

import json
import threading
from types import SimpleNamespace

import logging

import pytest

from llamapipe.core.logger import get_logger

from llamapipe.core.pipeline_parallel import position as position_module
from llamapipe.core.pipeline_parallel.schedule_ir import Action
from llamapipe.training.hang_watch import REPORT_FILE, HangWatch, StallHook


class DictStore:
    """The c10d store calls the watch uses (check, set, get, add)."""

    def __init__(self) -> None:
        self.data, self.lock = {}, threading.Lock()

    def check(self, keys):
        return all(k in self.data for k in keys)

    def set(self, key, value):
        self.data[key] = value.encode() if isinstance(value, str) else value

    def get(self, key):
        return self.data[key]

    def add(self, key, n):
        with self.lock:
            self.data[key] = int(self.data.get(key, 0)) + n
            return self.data[key]


def _ps(rank):
    return SimpleNamespace(rank=rank, pp_rank=rank, pp_size=2, pp_ranks=(0, 1), dp_rank=0, dp_size=1, cp_rank=0,
                           cp_size=1, tp_rank=0, tp_size=1)


def _until(predicate, polls=400):
    """Wait for the watchdog's threads to act: `predicate` checked every 50 ms, a failure after `polls` checks
    (a guard against a watchdog that never acts, not a measure of how fast it acts)."""
    for _ in range(polls):
        if predicate():
            return
        threading.Event().wait(0.05)
    pytest.fail("the watchdog did not act")


@pytest.mark.parametrize("keep_waiting", [False, True], ids=["exit", "keep-waiting"])
def test_a_stalled_step_is_reported_once_and_both_ranks_leave(tmp_path, keep_waiting):
    lines: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: lines.append(record.getMessage())
    get_logger().addHandler(handler)
    store, exits = DictStore(), []
    watches = [HangWatch(_ps(r), 0.3, keep_waiting, str(tmp_path), store, 2, exits.append) for r in (0, 1)]
    try:
        for w in watches:
            w.begin_iteration(5)
            w.position.step_begin(None, w.rank, False)
        watches[1].position.action_begin(Action("F", 0, 3))             # rank 1 stops inside F mb 3
        watches[0].position.action_begin(Action("B", 0, 2))             # rank 0 waits for its gradient
        watches[0].position.message_waiting(SimpleNamespace(kind="grad", microbatch=2, stage=0, src=1))
        if keep_waiting:
            _until(lambda: store.check(["llamapipe/hang/0/done"]) and all(w.episode == 1 for w in watches))
            assert exits == []
        else:
            _until(lambda: len(exits) == 2)
            assert exits == [1, 1]
        with open(tmp_path / REPORT_FILE) as f:
            record = json.load(f)
    finally:
        for w in watches:
            w.end_iteration()
        position_module.install(None)
        get_logger().removeHandler(handler)
    assert record["report"]["stopped"] == 1 and record["report"]["chain"] == [0]
    assert record["report"]["paragraph"].startswith("hang at iteration 5: rank 1 (pp 1) stopped in F mb 3 chunk 0")
    out = "\n".join(lines)
    assert out.count("hang report: hang at iteration 5") == 1
    assert "rank 0 (pp 0) waits in B mb 2 chunk 0 for rank 1's gradient of mb 2 (for stage 0)" in out


def test_the_test_stop_fires_only_at_its_rank_iteration_and_action():
    hook = StallHook("rank=1,iteration=2,action=F,microbatch=1", 1, SimpleNamespace(iteration=2))
    fired = []
    hook.point = fired.append                                   # instead of sleeping forever
    hook.step_begin(None, 0, forward_only=True)
    hook.action_begin(Action("F", 0, 1))                        # an evaluation step: never
    hook.step_begin(None, 0, forward_only=False)
    hook.action_begin(Action("F", 0, 0))
    hook.action_begin(Action("B", 0, 1))
    assert fired == []
    hook.action_begin(Action("F", 0, 1))
    assert fired == ["F"]
    assert (hook.target, hook.iteration, hook.kind, hook.microbatch, hook.chunk) == (1, 2, "F", 1, None)


def test_the_flag_defaults_below_the_collective_timeout_and_refuses_one_above_it():
    from llamapipe.core.config import ArgumentError
    from llamapipe.training.arguments.parser import build_parser, config_from_args
    from tests.cli import TINY

    def logging_of(*flags):
        return config_from_args(build_parser().parse_args(TINY + list(flags)), 1).logging

    assert logging_of().hang_report_seconds == 300.0 and not logging_of().hang_report_keep_waiting
    assert logging_of("--distributed-timeout-minutes", "4").hang_report_seconds == 120.0
    assert logging_of("--hang-report-seconds", "0").hang_report_seconds == 0.0
    with pytest.raises(ArgumentError, match=r"--hang-report-seconds 600 must be below --distributed-timeout-minutes "
                                            r"10 \(600 s\)"):
        logging_of("--hang-report-seconds", "600")
    with pytest.raises(ArgumentError, match="0 \\(off\\) or positive, got -1"):
        logging_of("--hang-report-seconds", "-1")
    with pytest.raises(ArgumentError, match="--hang-report-seconds nan is not a finite number"):
        logging_of("--hang-report-seconds", "nan")
    with pytest.raises(ArgumentError, match=r"--hang-report-seconds 0.01 is below 1 s: .* give 0 \(off\) or at "
                                            r"least 1$"):
        logging_of("--hang-report-seconds", "0.01")
    assert logging_of("--hang-report-seconds", "1").hang_report_seconds == 1.0
    assert logging_of("--distributed-timeout-minutes", "0.02").hang_report_seconds == 0.0   # half of 1.2 s: off


def test_keep_waiting_with_the_watch_off_is_a_notice(llamapipe_log):
    from llamapipe.training.arguments.parser import build_parser, config_from_args
    from tests.cli import TINY
    config_from_args(build_parser().parse_args(TINY + ["--hang-report-seconds", "0", "--hang-report-keep-waiting"]), 1)
    assert "notice: --hang-report-keep-waiting has no effect with --hang-report-seconds 0: no hang is reported" \
        in llamapipe_log


def test_a_rank_inside_a_collective_is_in_it_and_waits_for_its_peers():
    watch = HangWatch(_ps(1), 60.0, False, None, DictStore(), 2, [].append)
    try:
        watch.begin_iteration(3)
        with watch.collective("grad-reduce", "the gradient reduction", [0, 1]):
            inside = watch.position.snapshot()
        after = watch.position.snapshot()
    finally:
        watch.end_iteration()
        position_module.install(None)
    assert inside["phase"] == "in the gradient reduction" and inside["wait"]["peers"] == [0], inside
    assert after["phase"] == "after the gradient reduction" and after["wait"] is None, after

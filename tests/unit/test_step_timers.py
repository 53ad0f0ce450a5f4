"""The runtime-options object and the per-rank timers (--timing-log-level), in one process.

The timers' accounting is checked on a clock the test controls: compute, communication and idle must add up to
the iteration, a message wait must count as idle, evaluation steps must not count. Whether the measured bubble
matches the simulator on real (sleeping) stages is benchmarks/bench_timers.py's synthetic mode."""
from __future__ import annotations

import re

import pytest
import torch

from llamapipe.core.parallel_state import ParallelState
from llamapipe.core.pipeline_parallel import executor, step_timers
from llamapipe.core.pipeline_parallel.runtime import ActionTimes, RuntimeOptions, StepObserver
from llamapipe.core.pipeline_parallel.schedule_ir import Action, Plan
from llamapipe.core.pipeline_parallel.step_timers import StepTimers, bubble
from llamapipe.training.timers_log import TimersLog, build_timers


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch):
    c = Clock()
    monkeypatch.setattr(step_timers.time, "perf_counter", c)
    return c


def _step(timers: StepTimers, clock: Clock, forward_only: bool = False) -> None:
    """One step on the controlled clock: F 3 s (1 s of it waiting for its input), a 0.5 s message post, B 4 s,
    then the optimizer 2 s and 1 s of gradient reduction, then 1.5 s unaccounted (a wait at a collective)."""
    timers.step_begin(None, 0, forward_only)
    timers.action_done(Action("F", 0, 0), clock.now, clock.now + 3.0, 1.0)
    timers.comm_done("post", clock.now + 3.0, clock.now + 3.5)
    timers.action_done(Action("B", 0, 0), clock.now + 3.5, clock.now + 7.5, 0.0)
    clock.now += 7.5
    timers.step_end((0, torch.float32))
    if forward_only:
        return
    with timers.region("optimizer"):
        clock.now += 2.0
    with timers.region("all-grads-sync"):
        clock.now += 1.0
    clock.now += 1.5
    timers.mark()


def test_compute_communication_and_idle_add_up_to_the_iteration(clock):
    timers = StepTimers(level=2)
    for _ in range(2):
        _step(timers, clock)
    out = timers.interval()
    assert out["iterations"] == 2 and out["iteration"] == pytest.approx(2 * 12.0)
    assert out["compute"] == pytest.approx(2 * (2.0 + 4.0 + 2.0))          # F without its wait, B, optimizer
    assert out["communication"] == pytest.approx(2 * (0.5 + 1.0))          # the post and the gradient reduction
    assert out["idle"] == pytest.approx(2 * (1.0 + 1.5))                   # the message wait and the collective
    assert out["compute"] + out["communication"] + out["idle"] == pytest.approx(out["iteration"])
    assert out["forward-compute"] == pytest.approx(2 * 2.0) and out["forward-recv"] == pytest.approx(2 * 1.0)
    assert out["backward-compute"] == pytest.approx(2 * 4.0) and out["optimizer"] == pytest.approx(2 * 2.0)
    assert out["forward-backward"] == pytest.approx(2 * 7.5)
    assert bubble(out) == pytest.approx(2.5 / 12.0)
    assert timers.interval()["iterations"] == 0, "interval() starts a new interval"


def test_evaluation_and_global_points_are_not_idle_time(clock):
    timers = StepTimers(level=1)
    _step(timers, clock)
    _step(timers, clock, forward_only=True)          # an evaluation: not timed
    clock.now += 30.0                                # a checkpoint save
    timers.restart()
    _step(timers, clock)
    out = timers.interval()
    assert out["iterations"] == 2 and out["iteration"] == pytest.approx(24.0)
    assert out["compute"] == pytest.approx(16.0) and "forward-compute" not in out, "level 1 keeps the split only"


def test_level_zero_builds_no_timers_and_the_block_reads_like_megatrons():
    assert build_timers(0) is None and build_timers(2).level == 2
    timers = StepTimers(1)
    ranks = [dict.fromkeys(timers.names, 0.0) | {"iterations": 2.0, "iteration": 2.0, "compute": 1.5, "idle": 0.5},
             dict.fromkeys(timers.names, 0.0) | {"iterations": 2.0, "iteration": 2.0, "compute": 1.9, "idle": 0.1}]
    blocks = {option: TimersLog(timers, ParallelState(), option).block(ranks) for option in ("max", "minmax", "all")}
    assert blocks["minmax"].splitlines()[0] == "(min, max) time across ranks (ms):"
    assert re.search(r"^    compute \.{3,}: \(750\.00, 950\.00\)$", blocks["minmax"], re.M)
    assert re.search(r"^    compute \.{3,}: 950\.00$", blocks["max"], re.M)
    assert re.search(r"^    compute \.{3,}: rank 0: 750\.00, rank 1: 950\.00$", blocks["all"], re.M)
    assert "forward-backward" not in blocks["max"], "a timer that measured nothing on every rank is left out"
    assert "rank 0: compute 750.0, communication 0.0, idle 250.0 (bubble 25.0%)" in blocks["minmax"]


def test_one_process_interval_fields_name_the_worst_rank(clock):
    timers = StepTimers(1)
    _step(timers, clock)
    fields = TimersLog(timers, ParallelState(), "max").interval_fields()
    assert fields["bubble_max"] == pytest.approx(2.5 / 12.0) and fields["bubble_max_rank"] == 0
    assert fields["bubble_pp0"] == fields["bubble_max"] and fields["timers"]["rank0"]["idle"] == pytest.approx(2500.0)


def test_runtime_options_refuse_an_unknown_option_and_a_non_observer():
    with pytest.raises(TypeError):
        RuntimeOptions(action_times=[])                           # an old keyword is an error, not dropped
    with pytest.raises(AssertionError):
        RuntimeOptions(observers=(object(),))
    base = RuntimeOptions(fused_bw=True)
    extra = ActionTimes()
    assert base.observing(None) is base and base.observing(extra).observers == (extra,)
    assert base.observing(extra).fused_bw, "observing keeps every other option"


class Recorder(StepObserver):
    def __init__(self) -> None:
        self.events: list = []

    def step_begin(self, plan, pp_rank, forward_only) -> None:
        self.events.append(("begin", forward_only))

    def action_done(self, action, start, end, blocked_s) -> None:
        assert end >= start and blocked_s >= 0.0
        self.events.append((action.kind, action.microbatch))

    def forward_done(self, key, output) -> None:
        self.events.append(("forward_done", key))

    def step_end(self, largest_send) -> None:
        self.events.append(("end",))


def test_the_executor_shows_every_action_to_every_observer():
    """F0 B0 F1 B1 W0 W1 on one rank: both observers see the actions in plan order, and the action times
    (what the profiled schedules fit) have one entry per action."""
    model = torch.nn.Linear(4, 4)
    model.set_input_tensor = lambda t: None
    model.pre_process = model.post_process = True

    def forward_step(data_iterator, chunk):
        out = chunk(next(data_iterator))
        return out, lambda o: (o.sum(), torch.tensor(float(o.numel())), {})

    kinds = [("F", 0), ("B", 0), ("F", 1), ("B", 1), ("W", 0), ("W", 1)]
    plan = Plan("f-b-f-b-w-w", 1, 1, 2, "interleaved", (tuple(Action(k, 0, mb) for k, mb in kinds),))
    recorder, times = Recorder(), ActionTimes()
    executor.run(plan, model_chunks=[model], forward_step_func=forward_step, data_iterator=iter(torch.ones(2, 3, 4)),
                 parallel_state=ParallelState(), num_microbatches=2, options=RuntimeOptions(observers=(recorder,))
                 .observing(times))
    assert recorder.events == [("begin", False), ("forward_done", (0, 0)), ("F", 0), ("B", 0),
                               ("forward_done", (0, 1)), ("F", 1), ("B", 1), ("W", 0), ("W", 1), ("end",)]
    assert [a.kind for a, _ in times.times] == [k for k, _ in kinds] and all(s >= 0 for _, s in times.times)

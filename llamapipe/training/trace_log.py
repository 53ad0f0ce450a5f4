"""--pipeline-trace PATH: one Chrome-trace JSON of the iterations Megatron's --profile-step-start/-end name.

As in Megatron-LM, the trace starts when `profile_step_start` iterations have completed and stops when
`profile_step_end` have (the default 10 and 12 trace iterations 11 and 12); `--profile-ranks` picks the ranks
that record (default: all). Every rank keeps its own events (`core/pipeline_parallel/trace.TraceRecorder`);
when the window closes (or training ends inside it), all ranks send theirs to rank 0, which writes one file:

- `traceEvents`: each rank a process ("rank 3 (pp 1, tp 1, dp 0)"), its tracks as threads (compute, waiting,
  communication), one complete event per action and arrows from each message's send to its receive; it opens
  in Perfetto (ui.perfetto.dev) and chrome://tracing;
- `otherData.llamapipe`: the plans the ranks ran and the recorded steps, which `llamapipe plot-trace` draws
  beside the simulator's plan with the measured costs.

The file is written whole or not at all and never through a link planted at PATH (`llamapipe/safe_files.py`).
"""
from __future__ import annotations

import json
import os
from typing import Optional

from llamapipe.core.logger import get_logger
from llamapipe.core.parallel_state import ParallelState
from llamapipe.core.pipeline_parallel.trace import TRACKS, TraceRecorder, common_zero, gather_events
from llamapipe.safe_files import replace_atomically

log = get_logger()
FORMAT = 1      # otherData.llamapipe.format: what plot-trace reads


def build_trace(config, ps: ParallelState) -> Optional["PipelineTrace"]:
    """The job's trace under --pipeline-trace (None without it)."""
    cfg = config.logging
    if cfg.pipeline_trace is None:
        return None
    return PipelineTrace(cfg.pipeline_trace, ps, cfg.profile_step_start, cfg.profile_step_end,
                         None if cfg.profile_ranks is None else list(cfg.profile_ranks),
                         schedule=config.parallel.pipeline_schedule)


class PipelineTrace:
    """Starts and stops the recorder at the profiled iterations and writes the merged trace."""

    def __init__(self, path: str, ps: ParallelState, start: int, end: int, ranks: Optional[list[int]] = None,
                 schedule: str = "") -> None:
        self.path, self.ps, self.start, self.end, self.schedule = path, ps, start, end, schedule
        self.recorder = TraceRecorder(ps.rank, ps.pp_ranks)
        self.records = ranks is None or ps.rank in ranks
        self.written = False
        self.started = False        # the window opened (the same on every rank: they count the same iterations)
        self.last = start           # the last iteration begun inside the window

    def before_iteration(self, completed: int) -> None:
        """Called on every rank before each training iteration, with the count of iterations completed."""
        if completed == self.start:
            zero = common_zero()                     # collective: every rank reaches it at the same iteration
            self.started = True
            if self.records:
                self.recorder.start(completed + 1, zero)
        elif self.recorder.recording:
            self.recorder.iteration = completed + 1
        if self.started and completed < self.end:
            self.last = completed + 1
        if completed == self.end and not self.written:
            self.finish()

    def finish(self) -> None:
        """Stop and write (collective); at the end of training too, when it ended inside the window. A run that
        never reached the window (it resumed past it) writes nothing and says so: never an empty trace."""
        if self.written or self.start >= self.end:
            return
        if not self.started:
            self.written = True
            log.warning(f"--pipeline-trace {self.path}: nothing traced and no file written: the window of "
                        f"iterations {self.start + 1}-{self.end} (--profile-step-start {self.start}, "
                        f"--profile-step-end {self.end}) opens when {self.start} iteration"
                        f"{'s are' if self.start != 1 else ' is'} complete, and "
                        "this run did not pass that point (it resumed after it)")
            return
        self.recorder.stop()
        coords = self.ps.coords
        name = f"rank {self.ps.rank} (" + ", ".join(f"{a} {coords.get(a, 0)}" for a in ("pp", "tp", "cp", "dp")
                                                   if self.ps.size(a) > 1 or a == "pp") + ")"
        payloads = gather_events(self.recorder.payload(name))
        self.written = True
        if payloads is None:
            return
        trace = chrome_trace(payloads, self.schedule, self.start, self.last)
        try:
            write_trace(self.path, trace)
        except OSError as err:       # a trace is never worth the run: say so and train on
            log.warning(f"--pipeline-trace {self.path}: cannot write the trace ({err}); training goes on")
            return
        actions = sum(1 for e in trace["traceEvents"] if e.get("ph") == "X" and "kind" in e.get("args", {}))
        log.info(f"pipeline trace: iterations {self.start + 1}-{self.last} of {len(payloads)} ranks ({actions} "
                 f"actions) written to {self.path}; open it in https://ui.perfetto.dev or chrome://tracing, or "
                 f"draw it beside its plan with `llamapipe plot-trace {self.path}`")


def chrome_trace(payloads: list[dict], schedule: str, start: int, end: int) -> dict:
    """The merged trace: metadata naming every rank and track, then every rank's events."""
    events: list[dict] = []
    plans: dict[str, dict] = {}
    steps: dict[str, list] = {}
    for p in payloads:
        rank = p["rank"]
        events.append({"ph": "M", "pid": rank, "name": "process_name", "args": {"name": p["name"]}})
        events.append({"ph": "M", "pid": rank, "name": "process_sort_index", "args": {"sort_index": rank}})
        for track, tid in TRACKS.items():
            events.append({"ph": "M", "pid": rank, "tid": tid, "name": "thread_name", "args": {"name": track}})
        events += p["events"]
        plans.update(p["plans"])
        steps[str(rank)] = {"pp_rank": p["pp_rank"], "steps": p["steps"]}
    return {"traceEvents": events, "displayTimeUnit": "ms",
            "otherData": {"llamapipe": {"format": FORMAT, "schedule": schedule, "iterations": [start + 1, end],
                                        "plans": plans, "steps": steps}}}


def write_trace(path: str, trace: dict) -> None:
    """Write `trace` as JSON to `path`, whole or not at all, never through a link (`safe_files`)."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with replace_atomically(path, "w") as f:
        json.dump(trace, f)

"""Per-rank timers of the pipeline: where each rank's time went, and the bubble the run actually paid.

Megatron-LM's timers (`--timing-log-level`) time phases under fixed names (forward-backward, forward-compute,
backward-compute, the send/recv timers, optimizer, ...) and fold a rank's idle time into its receive timers,
so its users cannot see the bubble (Megatron-LM issues 691 and 828); the zero-bubble fork prints the
*simulated* bubble of its plan. `StepTimers` is a `runtime.StepObserver`: it sees every action, message
wait and communication call of the executor, and the training step adds its optimizer and gradient
reduction (`region`). Each rank splits its wall time into

- compute: the plan's actions (F, B, W, BW, S, T) without their message waits, the vocabulary-parallel
  embedding, the optimizer step and the other regions the step times;
- communication: issuing and completing pipeline messages (posting receives, sending, the step's final wait
  for its sends) and data-parallel gradient reduction;
- idle: everything else, chiefly waiting for a message a peer has not sent yet, and a rank's wait for the
  others at the step's collectives. The measured bubble of a rank is its idle share of the iteration.

An iteration runs from one `mark` to the next (the training step marks where it ends); evaluation and
checkpoint saves between iterations are left out (`restart`).

Level 1 keeps per-interval sums only (a few float additions per action); level 2 adds Megatron's per-phase
names. `actions` (in `interval()`) is the compute of the plan's F/B/W/S/T actions alone (count x median per
kind, `robust_sum`), which
training/straggler.py compares across ranks: the optimizer's and embedding's regions hold collectives where a
rank waits for the others. With `cpu_clock` (CPU ranks, which share cores: a rank descheduled mid-action
would look slow) `actions` counts the thread's CPU time instead of wall time. `interval()` hands the sums over and starts a new interval; `gather_intervals` collects every rank's.
"""
from __future__ import annotations

import statistics
import time
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, Iterator, Optional

import torch
import torch.distributed as dist

from llamapipe.core.pipeline_parallel.runtime import StepObserver

if TYPE_CHECKING:
    from llamapipe.core.pipeline_parallel.schedule_ir import Action, Plan

# Megatron's timer names for what the executor does (level 2), and the rank split (level 1).
COMPUTE_TIMERS = {"F": "forward-compute", "B": "backward-compute", "BW": "backward-compute",
                  "W": "backward-weight-compute", "S": "output-layer-compute", "T": "output-layer-compute"}
RECV_TIMERS = {"F": "forward-recv", "B": "backward-recv", "BW": "backward-recv", "W": "backward-recv",
               "S": "output-layer-recv", "T": "output-layer-recv"}
SPLIT = ("compute", "communication", "idle")
LEVEL1 = ("iteration", "forward-backward", "optimizer", *SPLIT)
COPY_TIMERS = {"O": "activation-offload", "R": "activation-reload", "OW": "activation-offload",
               "RW": "activation-reload"}   # PipeOffload's copies: communication
LEVEL2 = ("forward-compute", "backward-compute", "backward-weight-compute", "output-layer-compute",
          "embedding-compute", "forward-recv", "backward-recv", "output-layer-recv", "pipeline-send-recv",
          "activation-offload", "activation-reload", "all-grads-sync")
COMMUNICATION_REGIONS = ("all-grads-sync",)


class StepTimers(StepObserver):
    """One rank's time by category over the current logging interval (seconds, summed over iterations)."""

    def __init__(self, level: int = 1, cpu_clock: bool = False) -> None:
        assert level in (1, 2), level
        self.cpu_clock = cpu_clock      # `actions` in this thread's CPU time (ranks sharing CPU cores)
        self._cpu = 0.0
        self.level = level
        self.names = LEVEL1 + (LEVEL2 if level == 2 else ())
        self._sums = dict.fromkeys(self.names, 0.0)
        self.iterations = 0
        self._fb_start: Optional[float] = None
        self._last: Optional[float] = None       # the previous `mark`: where the current iteration began
        self._timing = False
        self._actions: dict[str, list[float]] = {}  # each compute action's time, by kind: the straggler's

    # -- the executor's hooks ------------------------------------------------------------------------------
    def step_begin(self, plan: "Plan", pp_rank: int, forward_only: bool) -> None:
        self._timing = not forward_only          # evaluation is not part of a training iteration
        if self.cpu_clock:
            self._cpu = time.thread_time()
        self._fb_start = time.perf_counter() if self._timing else None
        if self._timing and self._last is None:
            self._last = self._fb_start

    def action_done(self, action: "Action", start: float, end: float, blocked_s: float) -> None:
        if self._timing and action.kind in COPY_TIMERS:
            self._add("communication", end - start - blocked_s, COPY_TIMERS[action.kind])
        elif self._timing:
            if self.cpu_clock:      # the CPU time since the previous hook: this action's, waits barely count
                cpu, self._cpu = self._cpu, time.thread_time()
                self._actions.setdefault(action.kind, []).append(self._cpu - cpu)
            else:
                self._actions.setdefault(action.kind, []).append(end - start - blocked_s)
            self._add("compute", end - start - blocked_s, COMPUTE_TIMERS[action.kind])
            self._add(None, 0.0, RECV_TIMERS[action.kind], blocked_s)

    def comm_done(self, what: str, start: float, end: float) -> None:
        if self.cpu_clock:
            self._cpu = time.thread_time()
        if self._timing:
            self._add("communication", end - start, "pipeline-send-recv")

    def phase_done(self, what: str, start: float, end: float, blocked_s: float) -> None:
        if self._timing:
            self._add("compute", end - start - blocked_s, "embedding-compute")

    def step_end(self, largest_send: tuple[int, torch.dtype]) -> None:
        if self._timing and self._fb_start is not None:
            self._sums["forward-backward"] += time.perf_counter() - self._fb_start
        self._timing, self._fb_start = False, None

    # -- the training step's hooks ---------------------------------------------------------------------------
    @contextmanager
    def region(self, name: str) -> Iterator[None]:
        """Time a part of the training step outside the executor: "optimizer" (compute) or "all-grads-sync"
        (communication: the data-parallel gradient reduction)."""
        start = time.perf_counter()
        try:
            yield
        finally:
            seconds = time.perf_counter() - start
            if name in COMMUNICATION_REGIONS:
                self._add("communication", seconds, name)
            else:
                self._add("compute", seconds, None)
                self._sums[name] = self._sums.get(name, 0.0) + seconds

    def mark(self) -> None:
        """A training iteration ends here on this rank: its wall time runs from the previous mark (or from the
        first forward-backward); idle is what compute and communication leave of it."""
        now = time.perf_counter()
        if self._last is not None:
            self.iterations += 1
            self._sums["iteration"] += now - self._last
        self._last = now

    def restart(self) -> None:
        """After a global point (evaluation, checkpoint save): the next iteration begins now, so their time is
        not counted as idle (Megatron stops its interval timer around a save too)."""
        self._last = time.perf_counter()

    def _add(self, split: Optional[str], seconds: float, name: Optional[str], recv_s: float = 0.0) -> None:
        if split is not None:
            self._sums[split] += seconds
        if self.level == 2 and name is not None:
            self._sums[name] += seconds + recv_s

    # -- reading ---------------------------------------------------------------------------------------------
    def interval(self) -> dict[str, float]:
        """This interval's sums in seconds (idle filled in; `iterations` the count), then a new interval."""
        out = dict(self._sums, iterations=float(self.iterations), actions=robust_sum(self._actions))
        out["idle"] = max(out["iteration"] - out["compute"] - out["communication"], 0.0)
        self._sums, self.iterations, self._actions = dict.fromkeys(self.names, 0.0), 0, {}
        return out


def robust_sum(times: dict[str, list[float]]) -> float:
    """The actions' total time as count x median per kind: one action slowed by a page fault or a context
    switch does not move it, a rank slower at every action does."""
    return sum(len(t) * statistics.median(t) for t in times.values() if t)


def gather_intervals(values: dict[str, float], group: Any = None) -> list[dict[str, float]]:
    """Every rank's `interval()` (all ranks of `group` call it with the same keys), indexed by group rank."""
    keys = sorted(values)
    local = torch.tensor([values[k] for k in keys], dtype=torch.float64)
    if not dist.is_initialized():
        return [values]
    out = [torch.empty_like(local) for _ in range(dist.get_world_size(group))]
    dist.all_gather(out, local, group=group)
    return [dict(zip(keys, t.tolist())) for t in out]


def bubble(values: dict[str, float]) -> float:
    """The idle share of a rank's iterations (0 when nothing was timed)."""
    return values["idle"] / values["iteration"] if values["iteration"] > 0 else 0.0

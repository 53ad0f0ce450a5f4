"""Where one rank is in its plan right now: the in-memory record a hang report is made of (`hang_report`).

`RankPosition` is a `runtime.StepObserver`: the executor tells it when each action begins and ends and which
message of which peer it blocks on; the training step names the iteration and the collectives around the
step (`waiting`: the data-parallel gradient reduction), and context parallelism's ring says when it waits
for its neighbours' keys and values. Each update is a few attribute stores (no lock, no allocation beyond a
small dict per wait), so it stays on for every run; a watchdog thread (training/hang_watch.py) reads
`snapshot()` when no progress was made for a while.

One process is one rank, so the position is installed once per process (`install`): code that cannot be
handed an observer (the CP ring, all-gather and all-to-all, deep inside attention) reports its waits through the
module's `waiting`, which does nothing when no position is installed.
"""
from __future__ import annotations

import time
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, Iterator, Optional, Sequence

from llamapipe.core.pipeline_parallel.runtime import StepObserver

if TYPE_CHECKING:
    from llamapipe.core.pipeline_parallel.schedule_ir import Action, Plan

PAYLOADS = {"act": "activation", "grad": "gradient", "hidden": "hidden state", "targets": "targets",
            "vgrad": "output-layer gradient"}


def describe(action: "Action") -> str:
    """`F mb 2 chunk 0`: an action as the report names it."""
    return f"{action.kind} mb {action.microbatch} chunk {action.chunk}"


class RankPosition(StepObserver):
    """One rank's position: the iteration, the last action done, the action running (or None between
    actions), what it blocks on (`wait`: peers as global ranks, what it waits for, whether a collective) and
    when it last made progress (`time.time()`, comparable across the processes of one host and, roughly,
    across hosts)."""

    def __init__(self, rank: int, coords: dict[str, int], pp_ranks: Sequence[int] = ()) -> None:
        self.rank, self.coords, self.pp_ranks = rank, dict(coords), tuple(pp_ranks) or (rank,)
        self.iteration = 0
        self.active = False              # inside a watched iteration
        self.phase = "between iterations"   # a phrase: "stopped <phase>" (hang_report)
        self.last_done: Optional[str] = None
        self.current: Optional[str] = None
        self.wait: Optional[dict] = None
        self.step_start = self.progress_at = time.time()
        self._pp_rank = 0

    # -- the training loop ---------------------------------------------------------------------------------
    def begin_iteration(self, iteration: int) -> None:
        """Iteration `iteration` (1-based, as the log counts) starts: watched until `end_iteration`."""
        self.iteration, self.phase, self.active = iteration, "at the step's start", True
        self.last_done = self.current = self.wait = None
        self.step_start = self._progress()

    def end_iteration(self) -> None:
        self.active, self.phase, self.wait = False, "between iterations", None
        self._progress()

    def enter(self, phase: str) -> None:
        """The rank is now in `phase` of the step, outside the plan's actions: a phrase the report uses as is
        ("in the optimizer step")."""
        self.phase, self.current, self.wait = phase, None, None
        self._progress()

    @contextmanager
    def waiting(self, what: str, peers: Sequence[int], collective: bool = False) -> Iterator[None]:
        """Blocked on `peers` (global ranks) for `what`; `collective`: every peer must join the same call."""
        previous = self.wait
        self.wait = {"what": what, "peers": sorted(set(peers) - {self.rank}) or [self.rank],
                     "collective": collective}
        self._progress()
        try:
            yield
        finally:
            self.wait = previous
            self._progress()

    # -- the executor's hooks ------------------------------------------------------------------------------
    def step_begin(self, plan: "Plan", pp_rank: int, forward_only: bool) -> None:
        self._pp_rank, self.phase = pp_rank, "in an evaluation step" if forward_only else "forward-backward"
        self._progress()

    def action_begin(self, action: "Action") -> None:
        self.current, self.wait = describe(action), None
        self._progress()

    def action_done(self, action: "Action", start: float, end: float, blocked_s: float) -> None:
        self.last_done, self.current, self.wait = describe(action), None, None
        self._progress()

    def message_waiting(self, msg: Any) -> None:
        peer = self.pp_ranks[msg.src] if msg.src < len(self.pp_ranks) else msg.src
        self.wait = {"what": f"{PAYLOADS.get(msg.kind, msg.kind)} of mb {msg.microbatch} (for stage {msg.stage})",
                     "peers": [peer], "collective": False}

    def message_received(self, msg: Any, when: float) -> None:
        self.wait = None
        self._progress()

    def comm_begin(self, what: str) -> None:
        if what == "finish" and len(self.pp_ranks) > 1:     # the step's sends complete once the peers take them
            n = len(self.pp_ranks)
            peers = {self.pp_ranks[(self._pp_rank + d) % n] for d in (-1, 1)}
            self.wait = {"what": "its sent messages to be received", "peers": sorted(peers - {self.rank}),
                         "collective": False}

    def comm_done(self, what: str, start: float, end: float) -> None:
        if what == "finish":
            self.wait = None
        self._progress()

    def step_end(self, largest_send: Any) -> None:
        self.phase = "after its forward-backward"
        self._progress()

    # -- reading -------------------------------------------------------------------------------------------
    def _progress(self) -> float:
        self.progress_at = time.time()
        return self.progress_at

    def idle_s(self, now: Optional[float] = None) -> float:
        """Seconds since the last progress."""
        return (time.time() if now is None else now) - self.progress_at

    def snapshot(self, now: Optional[float] = None) -> dict:
        """The position as plain data (JSON-ready) at `now`."""
        now = time.time() if now is None else now
        return {"rank": self.rank, "coords": dict(self.coords), "iteration": self.iteration, "phase": self.phase,
                "last_done": self.last_done, "current": self.current,
                "wait": None if self.wait is None else dict(self.wait),
                "idle_s": round(now - self.progress_at, 3), "step_elapsed_s": round(now - self.step_start, 3),
                "progress_at": self.progress_at}


_installed: Optional[RankPosition] = None


def install(position: Optional[RankPosition]) -> None:
    """Make `position` this process's (None: none) for `waiting` callers that have no observer."""
    global _installed
    _installed = position


@contextmanager
def waiting(what: str, peers: Sequence[int], collective: bool = False) -> Iterator[None]:
    """Record a blocking wait on `peers` in this process's position, if one is installed."""
    if _installed is None:
        yield
        return
    with _installed.waiting(what, peers, collective):
        yield

"""--hang-report-seconds: when a training step makes no progress for that long, every rank says where it is in its
plan and one report names the rank that stopped first and the chain of waits behind it; then the run exits
(status 1, the checkpoints on disk untouched) or, under --hang-report-keep-waiting, goes on waiting.

Each rank keeps its position (`core.pipeline_parallel.position.RankPosition`, an observer of the executor) and
runs a daemon watchdog thread. A rank that is hung cannot take part in a gloo collective, so the positions travel
through the job's c10d key-value store (torchrun's agent, or rank 0's TCPStore): the first rank whose step
stalls posts its position, becomes the reporter and asks the others to post theirs; every watchdog answers
within a second, however long its own rank has waited. The reporter waits up to a few seconds for them, builds
the report (`core.pipeline_parallel.hang_report.explain`), logs it and writes every position with the report to
`hang_report.json` in --save (when given). Every rank then leaves through `process_exit.exit_from_watchdog`: threads
that are not daemons (an asynchronous checkpoint writer) finish first, so a checkpoint is never left half
written; the main thread, blocked in a receive, ends with the process, without a traceback.

LLAMAPIPE_TEST_STALL (tests only): `rank=1,iteration=2,action=F,microbatch=1` makes that global rank sleep forever
before that action of that iteration (`action`: a plan kind, `grad-reduce` for the data-parallel gradient
reduction or `optimizer` for the optimizer step; `microbatch` and `chunk` optional).
"""
from __future__ import annotations

import json
import os
import threading
import time
from contextlib import contextmanager, nullcontext
from typing import Any, Callable, Iterator, Optional, Sequence

from llamapipe.core.logger import get_logger
from llamapipe.core.parallel_state import ParallelState
from llamapipe.core.pipeline_parallel.hang_report import explain, where
from llamapipe.core.pipeline_parallel.position import RankPosition, install
from llamapipe.core.pipeline_parallel.runtime import StepObserver

log = get_logger()
STALL_ENV = "LLAMAPIPE_TEST_STALL"
REPORT_FILE = "hang_report.json"
HANG_EXIT_STATUS = 1
_PREFIX = "llamapipe/hang"


class StallHook(StepObserver):
    """The test-only stop (LLAMAPIPE_TEST_STALL): sleep forever before the chosen action of the chosen iteration."""

    def __init__(self, spec: str, rank: int, position: RankPosition) -> None:
        fields = dict(item.split("=", 1) for item in spec.split(",") if "=" in item)
        self.rank, self.position = rank, position
        self.target = int(fields.get("rank", -1))
        self.iteration, self.kind = int(fields.get("iteration", 1)), fields.get("action", "F")
        self.microbatch = int(fields["microbatch"]) if "microbatch" in fields else None
        self.chunk = int(fields["chunk"]) if "chunk" in fields else None
        self._training = False

    def step_begin(self, plan: Any, pp_rank: int, forward_only: bool) -> None:
        self._training = not forward_only

    def action_begin(self, action: Any) -> None:
        if (self._training and action.kind == self.kind and self.microbatch in (None, action.microbatch)
                and self.chunk in (None, action.chunk)):
            self.point(action.kind)

    def point(self, name: str) -> None:
        """Sleep forever when `name` is the chosen stop on this rank in this iteration."""
        if name == self.kind and self.rank == self.target and self.position.iteration == self.iteration:
            log.error(f"rank {self.rank}: {STALL_ENV}: stopping before {name} of iteration {self.iteration} (test)")
            while True:
                time.sleep(3600)


class HangWatch:
    """One rank's position, the test stop, and the watchdog thread that reports a hang."""

    def __init__(self, ps: ParallelState, seconds: float, keep_waiting: bool, save_dir: Optional[str],
                 store: Any, world_size: int, exit_fn: Callable[[int], Any],
                 alive: Callable[[], bool] = lambda: True) -> None:
        coords = {axis: getattr(ps, f"{axis}_rank") for axis in ("pp", "dp", "cp", "tp")
                  if getattr(ps, f"{axis}_size") > 1}
        self.ps, self.rank, self.world_size = ps, ps.rank, world_size
        self.position = RankPosition(ps.rank, coords, ps.pp_ranks)
        spec = os.environ.get(STALL_ENV)
        self.stall = StallHook(spec, ps.rank, self.position) if spec else None
        self.seconds, self.keep_waiting, self.save_dir = seconds, keep_waiting, save_dir
        self.store, self.exit_fn, self.alive = store, exit_fn, alive    # alive: the process group still exists
        self.episode = 0                  # hangs reported so far (under --hang-report-keep-waiting)
        self._reported_at: Optional[float] = None    # the progress time of the hang last reported
        install(self.position)
        threading.Thread(target=self._watch, name="llamapipe-hang-watch", daemon=True).start()

    def observers(self) -> tuple[StepObserver, ...]:
        """The executor's observers: the position, then the test stop (a stopped rank is in its action)."""
        return tuple(o for o in (self.position, self.stall) if o is not None)

    def begin_iteration(self, iteration: int) -> None:
        self.position.begin_iteration(iteration)

    def end_iteration(self) -> None:
        self.position.end_iteration()

    @contextmanager
    def collective(self, name: str, what: str, peers: Sequence[int]) -> Iterator[None]:
        """A collective of the step (`name` for the test stop: grad-reduce) that waits on `peers`."""
        self.position.enter(f"before {what}")
        if self.stall is not None:
            self.stall.point(name)
        self.position.enter(f"in {what}")       # joined it: the position line says so beside what it waits for
        with self.position.waiting(what, peers, collective=True):
            yield
        self.position.enter(f"after {what}")

    # -- the watchdog thread -------------------------------------------------------------------------------
    def _key(self, *parts: Any) -> str:
        return "/".join([_PREFIX, str(self.episode), *map(str, parts)])

    def _watch(self) -> None:
        tick = min(1.0, max(self.seconds / 4, 0.1))
        while True:
            time.sleep(tick)
            try:
                self._check()
            except Exception as err:     # noqa: BLE001 - the store is gone (the job ends): stop watching
                if self.position.active:
                    log.error(f"rank {self.rank}: hang watchdog stopped: {type(err).__name__}: {err}")
                return

    def _check(self) -> None:
        pos = self.position
        if self._reported_at == pos.progress_at:        # this hang was reported; wait for progress
            return
        if not pos.active and not self.alive():     # the run is over: nothing to watch, no store to ask
            return
        asked = self.store.check([self._key("ask")])
        if not asked and not (pos.active and pos.idle_s() >= self.seconds):
            return
        self._reported_at = pos.progress_at
        snapshot = pos.snapshot()
        self.store.set(self._key("pos", self.rank), json.dumps(snapshot))
        log.error(f"hang: {where(snapshot)} position: {_position_line(snapshot)}")
        if self.store.add(self._key("reporter"), 1) == 1:
            self.store.set(self._key("ask"), "1")
            self._report()
        else:
            self._wait_for(self._key("done"), self.seconds + 15.0)
        self.episode += 1
        if not self.keep_waiting:
            self.exit_fn(HANG_EXIT_STATUS)
        log.error(f"rank {self.rank}: --hang-report-keep-waiting: still waiting")

    def _wait_for(self, key: str, timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        while not self.store.check([key]):
            if time.monotonic() > deadline:
                return False
            time.sleep(0.05)
        return True

    def _report(self) -> None:
        deadline = time.monotonic() + max(3.0, min(self.seconds, 10.0))
        keys = [self._key("pos", r) for r in range(self.world_size)]
        while time.monotonic() < deadline and not all(self.store.check([k]) for k in keys):
            time.sleep(0.05)
        positions = [json.loads(self.store.get(k)) for k in keys if self.store.check([k])]
        report = explain(positions, self.world_size)
        log.error(f"hang report: {report['paragraph']}")
        path = self._write(report, positions)
        action = "exiting" if not self.keep_waiting else "the ranks keep waiting (--hang-report-keep-waiting)"
        log.error(f"hang report: {'written to ' + path if path else 'no --save: no JSON file written'}; "
                  f"{action} (no progress for --hang-report-seconds {self.seconds:g})")
        self.store.set(self._key("done"), "1")

    def _write(self, report: dict, positions: list[dict]) -> Optional[str]:
        if not self.save_dir:
            return None
        from llamapipe.safe_files import replace_atomically
        path = os.path.join(self.save_dir, REPORT_FILE)
        try:
            with replace_atomically(path, "w") as out:
                json.dump({"report": report, "hang_report_seconds": self.seconds, "positions": positions,
                           "written_at": time.time()}, out, indent=1)
        except OSError as err:
            log.error(f"hang report: could not write {path}: {err}")
            return None
        return path


def _position_line(snap: dict) -> str:
    wait = snap["wait"]
    waiting = (f"; waits for {wait['what']} from rank(s) {', '.join(map(str, wait['peers']))}" if wait else
               "; waits on no peer")
    return (f"iteration {snap['iteration']}, {snap['current'] and 'in ' + snap['current'] or snap['phase']}, "
            f"last done {snap['last_done'] or 'nothing'}{waiting}; no progress for {snap['idle_s']:.1f} s, "
            f"step running {snap['step_elapsed_s']:.1f} s")


def build_hang_watch(config: Any, ps: ParallelState) -> Optional[HangWatch]:
    """The job's hang watch (None under --hang-report-seconds 0, or without a process group's store)."""
    seconds = config.logging.hang_report_seconds
    if not seconds:
        return None
    import torch.distributed as dist
    from llamapipe.process_exit import exit_from_watchdog
    try:
        store = dist.distributed_c10d._get_default_store()
    except (RuntimeError, ValueError, AttributeError):
        return None
    from llamapipe.training.checkpointing.save_lock import release_all
    return HangWatch(ps, seconds, config.logging.hang_report_keep_waiting, config.checkpoint.save, store,
                     dist.get_world_size(), lambda code: exit_from_watchdog(code, then=release_all),
                     alive=dist.is_initialized)


def hang_region(watch: Optional[HangWatch], name: str, what: str, peers: Sequence[int]):
    """`watch.collective(...)`, or nothing without a watch."""
    return watch.collective(name, what, peers) if watch is not None else nullcontext()

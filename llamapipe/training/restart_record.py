"""A failure restarted: what a restarted job lost, and what a save costs.

Under `torchrun --max-restarts N` a failed worker (SIGKILL, a node lost) makes torchrun start every worker
again (`TORCHELASTIC_RESTART_COUNT` counts the restarts); with `--load` = `--save` they resume from the newest
checkpoint that verifies. What torchrun does not say is what the failure cost. So global rank 0 of a job torchrun may restart
(`TORCHELASTIC_MAX_RESTARTS` above 0) keeps `<save>/progress.json` (the iteration reached, what the run was doing: "training", "saving" or "validating",
the wall time and the attempt), rewritten whole (safe_files: a temporary name, then one rename; no fsync, it is
advisory) after every iteration and before every save and validation. A restarted attempt reads it after it
loads and says, in one line and one JSONL record: the restart count, the iteration resumed from, the
iteration the failed attempt had reached (and where), the iterations lost between them, and the time from that
record to the resumed start (an upper bound on the restart's cost: it includes the failed attempt's last
moments, torchrun's detection, start-up and the load).

`save_cost_line` turns each save's measured time into `--save-interval` advice: the share of the training time
the saves take, against the iterations a failure loses on average (half the interval), and Young's interval
(sqrt(2 x save time x mean time between failures), J. W. Young, CACM 1974) for a failure a day.
"""
from __future__ import annotations

import json
import math
import os
import time
from typing import Optional

from llamapipe.core.logger import get_logger
from llamapipe.safe_files import create_new, read_regular_named, replace_with

PROGRESS_FILE = "progress.json"
log = get_logger()


def restart_count() -> int:
    """torchrun's restart count of this attempt (0: the first start, or no torchrun)."""
    try:
        return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    except ValueError:
        return 0


def restartable() -> bool:
    """Whether torchrun may restart this job (`--max-restarts` above 0: TORCHELASTIC_MAX_RESTARTS)."""
    try:
        return int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0")) > 0
    except ValueError:
        return False


class ProgressRecord:
    """`<save>/progress.json`, written by global rank 0 only (`enabled`) of a job torchrun may restart; a write
    that fails warns once and stops (the record is advisory: a full disk must not stop training)."""

    def __init__(self, save_dir: Optional[str], enabled: bool) -> None:
        self.path = os.path.join(save_dir, PROGRESS_FILE) if save_dir and enabled and restartable() else None
        self.attempt = restart_count()

    def note(self, iteration: int, phase: str = "training") -> None:
        if self.path is None:
            return
        text = json.dumps({"iteration": iteration, "phase": phase, "time": time.time(), "attempt": self.attempt})
        try:
            os.makedirs(os.path.dirname(self.path), exist_ok=True)
            replace_with(self.path, lambda tmp: _write(tmp, text))
        except OSError as err:
            log.warning(f"{self.path}: cannot write ({err}); a restart will not be able to say what it lost")
            self.path = None


def _write(path: str, text: str) -> None:
    with create_new(path, "w") as fh:
        fh.write(text)


def read_progress(save_dir: Optional[str]) -> Optional[dict]:
    """The last progress record in `save_dir` (None when there is none or it does not parse)."""
    if not save_dir:
        return None
    path = os.path.join(save_dir, PROGRESS_FILE)
    try:
        data = json.loads(read_regular_named(path, "the progress record", max_bytes=4096))
        return data if isinstance(data, dict) and isinstance(data.get("iteration"), int) else None
    except (OSError, ValueError):
        return None


def restart_report(save_dir: Optional[str], resumed_iteration: int, now: Optional[float] = None) -> Optional[dict]:
    """On a restarted attempt: what the failure cost, as a record (None on a first start or without a record).
    Call it after the load, before this attempt writes its own progress."""
    attempt = restart_count()
    record = read_progress(save_dir)
    if attempt == 0 or record is None:
        return None
    reached = int(record["iteration"])
    seconds = (now if now is not None else time.time()) - float(record.get("time", 0.0))
    return {"iteration": resumed_iteration, "restart": attempt, "resumed_from_iteration": resumed_iteration,
            "failed_at_iteration": reached, "failed_while": str(record.get("phase", "training")),
            "iterations_lost": max(reached - resumed_iteration, 0), "restart_seconds": max(seconds, 0.0)}


def restart_line(report: dict) -> str:
    """One paragraph for the log from `restart_report`'s record."""
    lost = report["iterations_lost"]
    where = {"training": "after iteration", "saving": "while saving iteration",
             "validating": "while validating at iteration"}.get(report["failed_while"], "at iteration")
    resumed = report["resumed_from_iteration"]
    start = (f"resumed from the checkpoint at iteration {resumed}" if resumed else
             "started again from iteration 0 (nothing loaded)")
    return (f"restart {report['restart']} (torchrun --max-restarts): the failed attempt stopped {where} "
            f"{report['failed_at_iteration']}; {start}, so {lost} iteration{'s' if lost != 1 else ''} lost; "
            f"the restart took {report['restart_seconds']:.1f} s (from the failed attempt's last progress record to "
            "this resumed start: failure detection, start-up and the checkpoint load)")


def restart_notice(save_dir: Optional[str], load_dir: Optional[str]) -> Optional[str]:
    """Under torchrun --max-restarts: a start-up notice (without its "notice: ") when a restarted attempt would
    not resume from the failed attempt's newest checkpoint (that needs --load = --save)."""
    if not restartable() or (save_dir and load_dir and os.path.realpath(save_dir) == os.path.realpath(load_dir)):
        return None
    n = os.environ.get("TORCHELASTIC_MAX_RESTARTS")
    if not save_dir:
        what = "without --save a restarted attempt starts again from iteration 0"
    elif not load_dir:
        what = (f"without --load a restarted attempt starts again from iteration 0 and finds the failed attempt's "
                f"checkpoints in --save {save_dir}")
    else:
        what = (f"a restarted attempt loads --load {load_dir} again, not the failed attempt's newer checkpoints in "
                f"--save {save_dir}")
    return f"torchrun --max-restarts {n}: {what}; pass the same directory as --save and --load to resume"


def save_cost_line(iteration: int, save_s: float, iteration_s: Optional[float], save_interval: Optional[int]) -> str:
    """The measured save time and what it means for --save-interval: the saves' share of the run, what a
    failure loses on average (half an interval), and Young's interval for a failure a day (sqrt(2 x save time x
    the mean time between failures) between saves costs least)."""
    line = f"checkpoint at iteration {iteration} saved in {save_s:.2f} s"
    if not iteration_s or not save_interval:
        return line
    share = save_s / (save_s + save_interval * iteration_s)
    lost = save_interval / 2
    young = math.sqrt(2 * save_s * 86400.0)
    return (f"{line}: at --save-interval {save_interval} ({iteration_s:.2f} s per iteration) saves take "
            f"{100 * share:.1f}% of the run and a failure loses {lost:g} iteration{'s' if lost != 1 else ''} "
            f"({lost * iteration_s:.1f} s) on average; with one failure a day, saving every {young:.0f} s "
            f"(--save-interval {max(1, round(young / iteration_s))}) costs least")

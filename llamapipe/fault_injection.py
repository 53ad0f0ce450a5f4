"""Test-only faults, read from the environment once per process: a slow rank and a killed rank.

Shared by core (the executor slows an action) and training (the loop kills a rank at a chosen point), so it
lives outside both, like safe_files. Nothing here acts unless its variable is set; the tests set them.

- `LLAMAPIPE_TEST_SLOW="rank=3,fraction=0.2"`: global rank 3 spends 0.2 x each action's CPU time more right
  after the action (inside its timing, busy), as a chip 20% slower would (`slow_action`).
- `LLAMAPIPE_TEST_KILL="point=save,iteration=4,rank=1;point=validation,iteration=5,rank=0;point=resume,rank=1"`:
  the i-th entry acts only in torchrun's attempt i (`TORCHELASTIC_RESTART_COUNT`, 0 for the first start), so
  one job under `--max-restarts` meets each failure once: the rank SIGKILLs itself at that point (`kill_at`).
  Points: "save" (during the checkpoint save after iteration N: some files written, the tracker not yet),
  "validation" (during the validation after iteration N), "iteration" (after iteration N), "resume" (during
  the first iteration after a resume, whatever its number).
"""
from __future__ import annotations

import os
import signal
import time
from typing import Optional

POINTS = ("save", "validation", "iteration", "resume")


def _fields(text: str, variable: str) -> dict[str, str]:
    try:
        return dict(part.split("=", 1) for part in text.split(",") if part)
    except ValueError:
        raise ValueError(f"{variable}: {text!r} is not key=value pairs separated by commas") from None


class _Slow:
    def __init__(self) -> None:
        text = os.environ.get("LLAMAPIPE_TEST_SLOW", "")
        fields = _fields(text, "LLAMAPIPE_TEST_SLOW")
        self.active = bool(text) and int(fields["rank"]) == int(os.environ.get("RANK", "0"))
        self.fraction = float(fields.get("fraction", "0")) if text else 0.0


_SLOW: Optional[_Slow] = None


def slow_action(cpu_start: float) -> None:
    """Called by the executor after each action whose thread CPU time began at `cpu_start`
    (`time.thread_time()`): on the slowed rank, spin until the thread has spent `fraction` more CPU time, as a
    chip that much slower would (a sleep would leave the core to the other ranks, which a slower chip does not).
    """
    global _SLOW
    if _SLOW is None:
        _SLOW = _Slow()
    if _SLOW.active:
        now = time.thread_time()
        target = now + _SLOW.fraction * (now - cpu_start)
        while time.thread_time() < target:
            pass


def slowing() -> bool:
    """Whether LLAMAPIPE_TEST_SLOW is set at all (the executor checks it once per step)."""
    return bool(os.environ.get("LLAMAPIPE_TEST_SLOW"))


def _kill_entry() -> Optional[dict[str, str]]:
    """This attempt's entry of LLAMAPIPE_TEST_KILL, when it names this rank (None otherwise)."""
    text = os.environ.get("LLAMAPIPE_TEST_KILL", "")
    if not text:
        return None
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    entries = [e for e in text.split(";") if e]
    if attempt >= len(entries):
        return None
    entry = _fields(entries[attempt], "LLAMAPIPE_TEST_KILL")
    if entry.get("point") not in POINTS:
        raise ValueError(f"LLAMAPIPE_TEST_KILL: point {entry.get('point')!r} is not one of {', '.join(POINTS)}")
    return entry if int(entry.get("rank", "0")) == int(os.environ.get("RANK", "0")) else None


def kill_at(point: str, iteration: int, resumed: bool = False) -> None:
    """SIGKILL this process when this attempt's LLAMAPIPE_TEST_KILL entry names `point` (at `iteration`; for
    "resume", the first iteration of a resumed run, `resumed` True) and this rank."""
    entry = _kill_entry()
    if entry is None or entry["point"] != point:
        return
    if (point == "resume" and resumed) or (point != "resume" and int(entry.get("iteration", "-1")) == iteration):
        os.kill(os.getpid(), signal.SIGKILL)

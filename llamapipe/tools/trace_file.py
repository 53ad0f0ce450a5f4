"""Read a --pipeline-trace file for `plot-trace` and check every part of it the tool uses (issue 51).

A trace may come from anyone: a FIFO or a device instead of a file, a file too large to hold in memory, JSON
nested past Python's recursion limit, fields of the wrong type, NaN timestamps, a plan of 10^9 ranks. Each is
refused here with `TraceError`, one line naming the file and what is wrong, before the tool computes anything;
the input is opened without blocking (O_NONBLOCK) and checked to be a regular file before a byte is read.
"""
from __future__ import annotations

import json
import math
import errno
from numbers import Real
from typing import Any

from llamapipe.core.pipeline_parallel.schedule_ir import KINDS as ACTION_KINDS, Plan
from llamapipe.core.pipeline_parallel.trace import TRACKS
from llamapipe.safe_files import read_regular_named

# json.load holds ~10x the file's size as Python objects; 10^6 actions take ~200 MB of trace
MAX_TRACE_BYTES = 512 * 2 ** 20


class TraceError(ValueError):
    """A trace file that plot-trace cannot use; the message names the file and is one line."""


def read_json(path: str) -> Any:
    """The JSON value in the regular file at `path` (a FIFO does not block the open; it is refused)."""
    try:
        raw = read_regular_named(path, f"trace {path}", MAX_TRACE_BYTES)
    except OSError as err:
        hint = "; trace fewer iterations (--profile-step-start/end)" if err.errno == errno.EFBIG else ""
        raise TraceError(f"{err.strerror}{hint}") from None
    try:
        return json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise TraceError(f"{path}: cannot read a JSON trace ({err})") from None
    except RecursionError:
        raise TraceError(f"{path}: cannot read a JSON trace (nested too deeply)") from None


def _int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _number(value: Any) -> bool:
    return isinstance(value, Real) and not isinstance(value, bool) and math.isfinite(value)


def check_steps(path: str, data: dict) -> None:
    """`steps`: global rank -> {"pp_rank": int, "steps": [{"iteration": int, "plan": a key of `plans`}]}."""
    steps, plans = data.get("steps"), data.get("plans")
    if not isinstance(steps, dict) or not isinstance(plans, dict):
        raise TraceError(f"{path}: otherData.llamapipe.steps and .plans must be objects")
    for rank, info in steps.items():
        where = f"{path}: steps[{rank!r}]"
        if not rank.isdigit() or not isinstance(info, dict) or not _int(info.get("pp_rank")) \
                or not isinstance(info.get("steps"), list):
            raise TraceError(f"{where} must be a rank number mapping to pp_rank (an integer) and steps (a list)")
        for s in info["steps"]:
            if not isinstance(s, dict) or not _int(s.get("iteration")) or s.get("plan") not in plans:
                raise TraceError(f"{where} holds {str(s)[:80]}; each step needs an integer iteration and a "
                                 "plan named in plans")


def check_plan(path: str, data: Any, ranks: int) -> Plan:
    """The plan in `data`, for a trace of `ranks` pipeline ranks; its size is checked before it is built."""
    pp = data.get("pp") if isinstance(data, dict) else None
    if not _int(pp) or pp != ranks:
        raise TraceError(f"{path}: the plan has pp {pp!r} but the trace has {ranks} pipeline ranks; draw a trace "
                         "of every rank (--profile-ranks left out)")
    try:
        return Plan.from_json(data)
    except (AssertionError, KeyError, TypeError, ValueError) as err:
        raise TraceError(f"{path}: its plan is not a valid schedule ({type(err).__name__} {err})") from None


def action_events(path: str, events: Any) -> list[dict]:
    """The complete ("X") events that are pipeline actions, each checked; the other events are not used."""
    if not isinstance(events, list):
        raise TraceError(f"{path}: traceEvents must be a list of events, not {type(events).__name__}")
    out = []
    for i, e in enumerate(events):
        if not isinstance(e, dict):
            raise TraceError(f"{path}: traceEvents[{i}] is {type(e).__name__}, not an event object")
        args = e.get("args")
        if e.get("ph") != "X" or not isinstance(args, dict) or "kind" not in args:
            continue
        if args["kind"] not in ACTION_KINDS or not all(_int(args.get(k)) for k in ("chunk", "mb", "iteration")) \
                or not _int(e.get("pid")):
            raise TraceError(f"{path}: traceEvents[{i}] needs a kind of {'/'.join(ACTION_KINDS)}, integer chunk, "
                             "mb, iteration and pid")
        if not _number(e.get("ts")) or not _number(e.get("dur")) or e["dur"] < 0:
            raise TraceError(f"{path}: traceEvents[{i}] has ts {e.get('ts')!r} and dur {e.get('dur')!r}; both "
                             "must be finite numbers, dur at least 0")
        out.append(e)
    return out


def send_times(events: list) -> dict[int, list[float]]:
    """Per pid, the sorted start times of the message arrows ("s" events) with a finite time."""
    sends: dict[int, list[float]] = {}
    for e in events:
        if isinstance(e, dict) and e.get("ph") == "s" and _int(e.get("pid")) and _number(e.get("ts")):
            sends.setdefault(e["pid"], []).append(e["ts"])
    return {pid: sorted(ts) for pid, ts in sends.items()}


def busy_outside_actions(events: list) -> dict[int, list[tuple[float, float]]]:
    """Per pid, (start us, end us) of the other time the step timers count as busy: the communication track
    (posts, flushes) and the compute track's phases outside the plan (the vocabulary-parallel embedding)."""
    busy: dict[int, list[tuple[float, float]]] = {}
    for e in events:
        args = e.get("args") if isinstance(e, dict) else None
        if e.get("ph") != "X" or not isinstance(args, dict) or "kind" in args or not _int(e.get("pid")) \
                or e.get("tid") not in (TRACKS["communication"], TRACKS["compute"]):
            continue
        if _number(e.get("ts")) and _number(e.get("dur")) and e["dur"] >= 0:
            busy.setdefault(e["pid"], []).append((e["ts"], e["ts"] + e["dur"]))
    return busy

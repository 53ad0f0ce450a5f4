"""Schedules as files, the application's side of core/pipeline_parallel/schedule_csv.py (which parses the text):
read a torch.distributed.pipelining CSV schedule, verified by the simulator, and make it the schedule
`--pipeline-schedule file:PATH` names (`load_schedule`); write one (`llamapipe plot-schedule --export-csv`).

Every rank parses the flags, so every rank reads the file and adds its plan to the schedule table once, before
anything asks the table for it (setup, the executor, `auto`).
"""
from __future__ import annotations

import os
from typing import Optional

from llamapipe.core.config import ArgumentError
from llamapipe.safe_files import read_regular_named
from llamapipe.core.pipeline_parallel.schedule_csv import from_csv, to_csv
from llamapipe.core.pipeline_parallel.schedule_ir import Plan
from llamapipe.core.pipeline_parallel.simulator import PlanError
from llamapipe.core.pipeline_parallel.schedule_specs import (FILE_PREFIX, ScheduleSpec, add_file_plan, file_plan,
                                                             schedule_spec)


def read_schedule_file(path: str, *, name: Optional[str] = None) -> Plan:
    """The plan in the torch CSV file at `path` (named `name`, else "file"), verified; PlanError naming the file,
    the rank and the action for anything wrong with it."""
    label = f"schedule file {path}"
    try:
        text = read_regular_named(path, label).decode("utf-8")
    except UnicodeDecodeError as err:
        raise PlanError(f"{label} is not UTF-8 text (byte {err.start}); give a torch CSV schedule") from None
    except OSError as err:
        raise PlanError(err.strerror) from None
    return from_csv(text, name=name or "file", label=label)


def write_schedule_file(plan: Plan, path: str) -> None:
    """`plan` in torch's compute-only CSV format at `path`."""
    with open(path, "w", newline="") as fh:
        fh.write(to_csv(plan))


def load_schedule(name: str) -> ScheduleSpec:
    """The spec of a --pipeline-schedule value: a schedule of the table, or file:PATH, whose file is read and
    verified once (then the table answers that name too); ValueError in one sentence for an unknown name, a
    missing file or a bad one."""
    if isinstance(name, str) and name.startswith(FILE_PREFIX) and file_plan(name) is None:
        path = name[len(FILE_PREFIX):]
        if not os.path.isfile(path):
            raise ArgumentError(f"--pipeline-schedule {name}: no such file")
        add_file_plan(read_schedule_file(path, name=name))
    return schedule_spec(name)

"""--pipeline-schedule-file PATH: train with a schedule written in a file (torch.distributed.pipelining's CSV format).

Why: torchtitan users hand their schedule over as a file (`parallelism.pipeline_parallel_schedule_csv`, read by
torch's `_PipelineScheduleRuntime._load_csv`), and `llamapipe plot-schedule --export-csv` writes any of ours. The
file is read and verified by the simulator while the flag is parsed (`training.schedule_file`; a bad file is one
error line naming the rank and the action), and the flag then stands for `--pipeline-schedule file:PATH` with the
file's model chunks per rank (`--num-virtual-stages-per-pipeline-rank`); other values given those flags are an error.
"""
from __future__ import annotations

import argparse
import os

from llamapipe.core.config import ArgumentError
from llamapipe.core.pipeline_parallel.schedule_csv import describe
from llamapipe.core.pipeline_parallel.schedule_specs import FILE_PREFIX, file_plan
from llamapipe.training.schedule_file import load_schedule


def _flag(dest: str) -> str:
    return "--" + dest.replace("_", "-")


class _ScheduleFile(argparse.Action):
    def __call__(self, parser, namespace, path, option_string=None):
        path = os.path.abspath(path)
        if not os.path.isfile(path):
            parser.error(f"{option_string} {path}: no such file")
        try:
            spec = load_schedule(FILE_PREFIX + path)
        except UnicodeDecodeError as err:    # the decoder's message does not say which file
            parser.error(f"{option_string} {path}: not a text CSV file (byte {err.start} is not {err.encoding})")
        except ValueError as err:
            parser.error(f"{option_string}: {err}")
        setattr(namespace, self.dest, path)
        wanted = {"pipeline_schedule": FILE_PREFIX + path,
                  "num_virtual_stages_per_pipeline_rank": spec.min_chunks if spec.min_chunks > 1 else None}
        for dest, value in wanted.items():
            current = getattr(namespace, dest)
            if current not in (parser.get_default(dest), value):
                parser.error(f"{option_string} sets {_flag(dest)} {value}, which contradicts {_flag(dest)} "
                             f"{current}; drop one")
            setattr(namespace, dest, value)
        namespace.pipeline_schedule_file_sets = wanted     # checked again once every flag is read


def add_schedule_file_flag(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("pipeline schedule from a file")
    g.add_argument("--pipeline-schedule-file", action=_ScheduleFile, default=None, metavar="PATH",
                   help="train with the schedule in PATH, torch.distributed.pipelining's CSV action format (what "
                        "torchtitan's pipeline_parallel_schedule_csv takes; llamapipe plot-schedule --export-csv "
                        "writes one): --pipeline-schedule file:PATH with the file's model chunks per rank, verified "
                        "by the simulator before training")


def check_schedule_file(args: argparse.Namespace) -> None:
    """The flags the file set still hold its values: one given after --pipeline-schedule-file (the action above
    sees only those before it) contradicts it."""
    for dest, value in (getattr(args, "pipeline_schedule_file_sets", None) or {}).items():
        current = getattr(args, dest)
        if current != value:
            raise ArgumentError(f"--pipeline-schedule-file {args.pipeline_schedule_file} sets {_flag(dest)} {value}, "
                                f"which contradicts {_flag(dest)} {current}; drop one")


def schedule_file_lines(args: argparse.Namespace) -> list[str]:
    """The start-up line on a --pipeline-schedule-file: its shape and what the simulator found (bubble, memory)."""
    path = getattr(args, "pipeline_schedule_file", None)
    if path is None:
        return []
    return [f"--pipeline-schedule-file {path}: verified, {describe(file_plan(FILE_PREFIX + path))}"]

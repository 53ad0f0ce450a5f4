"""The one table of --pipeline-schedule names: what each builds, how many model chunks per rank it takes,
where it places the virtual stages, whether it splits B/W and whether it profiles first.

Why one table: argument checks, the executor's entry points, model building (placement), `auto`'s
profiler, plot-schedule and the benchmarks all ask these questions of a schedule name; each reads the
answer here instead of spelling out its own list of names. `build` is the only dispatch on the name.
Papers: 1F1B and interleaved (arXiv 2104.04473), GPipe (arXiv 1811.06965), ZB-H1/H2 and the cost-fitted
`auto` (arXiv 2401.10241), ZB-V, V-Half and V-Min (arXiv 2405.15362), DualPipeV (DualPipe of arXiv
2412.19437 on the V placement, as torch.distributed.pipelining's ScheduleDualPipeV), the zero-bubble fork's grouped
interleaved 1F1B and 1F1B-V (PipeOffload, arXiv 2503.01328; `builders_grouped`). A grouped schedule also answers
"NAME:N", its microbatch group size N (`grouped_name`): Megatron's interleaved groups and the fork's. A schedule can also be a
file, "file:PATH" (torch's CSV action format, `schedule_csv`): once the application has read the file and added
its plan (`add_file_plan`), that name has a spec made from the plan.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

from llamapipe.core.config import ConfigError
from llamapipe.core.pipeline_parallel import (auto_plan, builders, builders_dualpipe, builders_grouped, builders_seq,
                                              builders_v)
from llamapipe.core.pipeline_parallel.schedule_ir import Plan, splits_backward
from llamapipe.core.pipeline_parallel.simulator import Costs
from llamapipe.core.pipeline_parallel.vocab_parallel import with_vocab_parallel

# (pp, vpp, m, costs or None, memory limit in activation units or None, post-validation) -> Plan. Everything
# that changes a plan is an argument here, so no code outside this table branches on a schedule's name.
Builder = Callable[[int, int, int, Optional[Costs], Optional[float], bool], Plan]
SeqBuilder = Callable[[int, int, int, int], Plan]    # (pp, vpp, m, K) -> a Seq1F1B plan of m*K pieces


@dataclass(frozen=True)
class ScheduleSpec:
    """One --pipeline-schedule name and the answers every reader of the name needs."""
    name: str
    builder: Builder
    min_chunks: int                     # model chunks per pipeline rank it accepts: min_chunks..max_chunks
    max_chunks: Optional[int]           # None: no upper bound
    default_chunks: int                 # what plot-schedule and the benchmarks use when not told
    v_placement: bool = False           # with two chunks per rank: V placement (stage v on rank 2p-1-v for v >= p)
    zero_bubble: bool = False           # backward split into B (input gradient) and W (weight gradient)
    profiled: bool = False              # profiles F/B/W for the first iterations, then fits its plan to them
    memory_capped: bool = False         # --pipeline-memory-limit caps its plan
    planned: bool = True                # `llamapipe plan` ranks it (GPipe: 1F1B does the same work in less memory)
    seq_builder: Optional[SeqBuilder] = None    # its Seq1F1B plan (--num-seq-splits K > 1), None: not supported

    def accepts(self, vpp: int) -> bool:
        return vpp >= self.min_chunks and (self.max_chunks is None or vpp <= self.max_chunks)

    def chunks_text(self) -> str:
        """How many chunks it takes, in words: "uses one model chunk per pipeline rank"."""
        lo, hi = self.min_chunks, self.max_chunks
        if lo == hi == 1:
            return "uses one model chunk per pipeline rank"
        if lo == hi:
            return f"needs exactly {lo} model chunks per pipeline rank"
        if hi is None:
            return f"needs {lo} or more model chunks per pipeline rank"
        return f"supports {' or '.join(map(str, range(lo, hi + 1)))} model chunks per pipeline rank"

    def chunks_error(self, vpp: int) -> Optional[str]:
        """One sentence when `vpp` chunks per rank do not fit this schedule (naming the config field
        pipeline_schedule), else None."""
        if self.accepts(vpp):
            return None
        return f"pipeline_schedule {self.name} {self.chunks_text()}, got {vpp}"

    def check_chunks(self, vpp: int) -> None:
        error = self.chunks_error(vpp)
        if error is not None:
            raise ConfigError(error, "pipeline_schedule")

    def placement(self, vpp: int) -> str:
        """Where virtual stages go (`schedule_ir.stage_of`): "v" or "interleaved"."""
        return "v" if self.v_placement and vpp == 2 else "interleaved"

    def build(self, pp: int, vpp: int, m: int, costs: Optional[Costs] = None,
              mem_limit: Optional[float] = None, *, post_validation: bool = False) -> Plan:
        """This schedule's plan for pp ranks, vpp chunks per rank and m microbatches; the profiled schedules
        plan for the longest stage span when `post_validation` lets iterations overlap."""
        self.check_chunks(vpp)
        return self.builder(pp, vpp, m, costs, mem_limit, post_validation)


def _one_chunk(fn: Callable[[int, int], Plan]) -> Builder:
    return lambda pp, vpp, m, costs, mem_limit, post_validation: fn(pp, m)


def _zb_h2(pp: int, vpp: int, m: int, costs: Optional[Costs], mem_limit: Optional[float],
           post_validation: bool) -> Plan:
    """The unit-cost ZB-H2, or with measured `costs` the plan fitted to them (ZB-H2's own cap: 2p-1)."""
    if costs is None:
        return builders.zb_h2(pp, m)
    return auto_plan.zb_h2_fitted(pp, m, costs, post_validation=post_validation)


def _auto(pp: int, vpp: int, m: int, costs: Optional[Costs], mem_limit: Optional[float],
          post_validation: bool) -> Plan:
    return auto_plan.plan_auto(pp, vpp, m, costs, mem_limit, post_validation=post_validation)


FILE_PREFIX = "file:"      # a schedule read from the file at PATH ("file:PATH"), added by `add_file_plan`
_FILES: dict[str, tuple[Plan, ScheduleSpec]] = {}     # file:PATH -> its plan and spec, once added


class _Table(dict):
    """The table of named schedules; `SPECS["file:PATH"]` is also answered, by the spec of an added schedule file
    (`add_file_plan`), without joining the table: iterating it lists the named schedules only."""

    def __missing__(self, name: str) -> ScheduleSpec:
        if name in _FILES:
            return _FILES[name][1]
        spec = _grouped_spec(name)
        if spec is None:
            raise KeyError(name)
        return spec


SPECS: dict[str, ScheduleSpec] = _Table({spec.name: spec for spec in (
    ScheduleSpec("1f1b", _one_chunk(builders.one_f_one_b), 1, 1, 1,
                 seq_builder=lambda pp, vpp, m, k: builders_seq.seq_1f1b(pp, m, k)),
    ScheduleSpec("interleaved", lambda pp, vpp, m, *_: builders.interleaved(pp, vpp, m), 2, None, 2,
                 seq_builder=lambda pp, vpp, m, k: builders_seq.checked_relabel(builders.interleaved(pp, vpp, m * k),
                                                                                k)),
    ScheduleSpec("gpipe", _one_chunk(builders.gpipe), 1, 1, 1, planned=False),
    ScheduleSpec("zb-h1", _one_chunk(builders.zb_h1), 1, 1, 1, zero_bubble=True,
                 seq_builder=lambda pp, vpp, m, k: builders_seq.seq_zb_h1(pp, m, k)),
    ScheduleSpec("zb-h2", _zb_h2, 1, 1, 1, zero_bubble=True, profiled=True),
    ScheduleSpec("zbv", _one_chunk(builders.zbv), 2, 2, 2, v_placement=True, zero_bubble=True,
                 seq_builder=lambda pp, vpp, m, k: builders_seq.seq_zbv(pp, m, k)),
    ScheduleSpec("v-half", _one_chunk(builders_v.v_half), 2, 2, 2, v_placement=True, zero_bubble=True),
    ScheduleSpec("v-min", _one_chunk(builders_v.v_min), 2, 2, 2, v_placement=True, zero_bubble=True),
    ScheduleSpec("dualpipev", _one_chunk(builders_dualpipe.dualpipev), 2, 2, 2, v_placement=True, zero_bubble=True),
    ScheduleSpec("group-interleaved", lambda pp, vpp, m, *_: builders_grouped.group_interleaved(pp, vpp, m, pp),
                 2, None, 2),
    ScheduleSpec("1f1b-v", _one_chunk(builders_grouped.one_f_one_b_v), 2, 2, 2, v_placement=True),
    ScheduleSpec("auto", _auto, 1, 2, 1, v_placement=True, zero_bubble=True, profiled=True,
                 memory_capped=True),
)})


# schedules with a microbatch group size: "NAME:N" builds NAME with groups of N (the row itself: its default)
_GROUPED = {"interleaved": builders.interleaved, "group-interleaved": builders_grouped.group_interleaved}


def grouped_name(base: str, group: int) -> str:
    """The schedule name of `base` with microbatch groups of `group` ("interleaved:8")."""
    assert base in _GROUPED, f"{base} takes no microbatch group size"
    return f"{base}:{group}"


def megatron_grouped(schedule: str, group: int, pp: int) -> Optional[str]:
    """`schedule` with Megatron's microbatch groups of `group` (--microbatch-group-size-per-virtual-pipeline-stage):
    interleaved:N, or interleaved itself at Megatron's default N = pp; None for a schedule without such groups."""
    if schedule != "interleaved":
        return None
    return schedule if group == pp else grouped_name(schedule, group)


def _grouped_spec(name: str) -> Optional[ScheduleSpec]:
    """The spec of "NAME:N" for a grouped schedule NAME, else None."""
    base, _, group = name.partition(":") if isinstance(name, str) else ("", "", "")
    if base not in _GROUPED or not group.isdigit():
        return None
    build_grouped, n = _GROUPED[base], int(group)
    return ScheduleSpec(name, lambda pp, vpp, m, *_: build_grouped(pp, vpp, m, n), 2, None, 2)


SCHEDULES = tuple(SPECS)            # the --pipeline-schedule names (a schedule file's file:PATH is none of them)


def add_file_plan(plan: Plan) -> ScheduleSpec:
    """Make a plan the application read from a schedule file a schedule of this process, named as the plan is
    (file:PATH): `SPECS`, `schedule_spec` and `build` answer that name from then on. The first plan added under a
    name stays (a file is read once per run)."""
    assert plan.name.startswith(FILE_PREFIX), f"a schedule file's plan is named {FILE_PREFIX}PATH, not {plan.name}"
    if plan.name not in _FILES:
        _FILES[plan.name] = (plan, _file_spec(plan))
    return _FILES[plan.name][1]


def file_plan(name: str) -> Optional[Plan]:
    """The plan of the schedule file `name` (file:PATH) once it was added (`add_file_plan`), else None."""
    return _FILES[name][0] if name in _FILES else None


def _file_spec(plan: Plan) -> ScheduleSpec:
    """The spec of a schedule file's plan: its builder returns the plan for the pipeline size and microbatches it
    was written for, and refuses others in one sentence."""
    path = plan.name[len(FILE_PREFIX):]

    def builder(pp: int, vpp: int, m: int, *_) -> Plan:
        if (pp, m) != (plan.pp, plan.num_microbatches):
            raise ValueError(f"schedule file {path} plans {plan.num_microbatches} microbatches on {plan.pp} pipeline "
                             f"ranks, but this run has {m} microbatches on {pp}")
        return plan
    split = splits_backward(plan)
    return ScheduleSpec(plan.name, builder, plan.vpp, plan.vpp, plan.vpp, v_placement=plan.placement == "v",
                        zero_bubble=split, planned=False)


def schedule_spec(name: str) -> ScheduleSpec:
    """The spec of a --pipeline-schedule name (or of an added schedule file, file:PATH); ConfigError naming the
    choices if there is none."""
    if isinstance(name, str) and name.startswith(FILE_PREFIX) and name not in _FILES:
        raise ConfigError(f"pipeline_schedule {name} names a schedule file that was not read; the application reads "
                          "it and adds its plan (add_file_plan)", "pipeline_schedule")
    if name not in SPECS and name not in _FILES and _grouped_spec(name) is None:
        raise ConfigError(f"pipeline_schedule {name} is unknown; choose one of {', '.join(SPECS)}",
                          "pipeline_schedule")
    return SPECS[name]


def build(schedule: str, pp: int, vpp: int, m: int, costs: Optional[Costs] = None,
          mem_limit: Optional[float] = None, *, post_validation: bool = False, vocab_parallel: bool = False) -> Plan:
    """Plan for a --pipeline-schedule name; `costs` are used by the profiled schedules (auto and zb-h2: fitted
    to them when given, else the unit-cost plan), `mem_limit` by the memory-capped one (auto), and
    `post_validation` by both profiled ones (they plan for the longest stage span then). `vocab_parallel`
    adds the output layer's S/T actions on every rank where they fit best under `costs`
    (`vocab_parallel.with_vocab_parallel`)."""
    plan = schedule_spec(schedule).build(pp, vpp, m, costs, mem_limit, post_validation=post_validation)
    if not vocab_parallel:
        return plan
    return with_vocab_parallel(plan, costs)


def build_seq(schedule: str, pp: int, vpp: int, m: int, k: int) -> Plan:
    """The Seq1F1B plan of `schedule` with every microbatch in `k` sequence pieces (builders_seq.py); one process
    runs each microbatch's pieces forward, then backward in reverse."""
    if pp == 1:
        return builders_seq.no_pipelining(m, k)
    spec = schedule_spec(schedule)
    if spec.seq_builder is None:
        supported = ", ".join(name for name, s in SPECS.items() if s.seq_builder is not None)
        raise ConfigError(f"num_seq_splits {k} needs pipeline_schedule one of {supported}, got {schedule}",
                          "num_seq_splits", "pipeline_schedule")
    spec.check_chunks(vpp)
    return spec.seq_builder(pp, vpp, m, k)


def default_schedule(vpp: int) -> str:
    """Megatron's schedule when none is named: interleaved with several chunks per rank, else 1F1B."""
    return "interleaved" if vpp > 1 else "1f1b"

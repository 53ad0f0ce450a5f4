"""Measured pass times turned into simulator costs: the one path shared by `auto`'s in-run profiling
(`auto_schedule.measured_costs`) and `llamapipe profile` / `llamapipe plan --profile`.

Why one path: the zero-bubble paper (Qi et al., arXiv 2401.10241, section 3) fits its schedule to measured F,
B and W times; the planner predicts a step from the same kind of measurement. Both reduce a list of
(action, seconds) records with `pass_medians` (the median of each pass, so one slow outlier does not move the
plan) and build their `Costs` from those medians.

`StageCosts` extends the simulator's `Costs` with per-virtual-stage times and activation bytes, so uneven layer
splits, the embedding on the first stage and the output layer with its loss on the last are simulated as
they are (the simulator asks a `Costs` for every action's durations and memory; it needs nothing else).
`stage_costs` builds one from per-component costs (one decoder layer, the embedding, the output layer + loss)
and each stage's layer count: a stage's pass is the sum of its parts. With vocabulary parallelism (arXiv
2411.05288) both vocabulary layers leave the stages: the output layer runs as the S/T actions of every rank
(`head_f`/`head_b` over pp each, the simulator's rule) and the embedding's shards run on every rank before
and after the plan (`vocab_runtime`), which the caller adds.
"""
from __future__ import annotations

import dataclasses
import statistics
from typing import Iterable, Sequence

from llamapipe.core.pipeline_parallel.schedule_ir import KIND_SPECS, PASSES, VOCAB_PASSES, Action, Plan
from llamapipe.core.pipeline_parallel.simulator import Costs


def pass_medians(action_times: Iterable[tuple[Action, float]]) -> dict[str, float]:
    """Median seconds of each pass kind (F, B, W) over `(action, seconds)` records; 0.0 for a kind with none.
    A fused BW record counts for neither B nor W (it cannot be split after the fact)."""
    by_kind: dict[str, list[float]] = {k: [] for k in PASSES}
    for action, seconds in action_times:
        if action.kind in by_kind:
            by_kind[action.kind].append(float(seconds))
    return {k: statistics.median(v) if v else 0.0 for k, v in by_kind.items()}


def costs_from_medians(medians: dict[str, float], **extra: float) -> Costs:
    """The simulator's `Costs` from per-pass medians (a pass never measured gets 1 ns, so F and B stay
    positive as the simulator requires); `extra` sets comm, memory or head fields."""
    f, b, w = (max(float(medians.get(k, 0.0)), 1e-9) for k in PASSES)
    return Costs(f=f, b=b, w=w, **extra)


@dataclasses.dataclass(frozen=True)
class PassCosts:
    """One model component's measured pass times (seconds) and activation bytes for one microbatch:
    `act_bytes` held from F to B, `w_bytes` held from B to W."""
    f: float
    b: float
    w: float = 0.0
    act_bytes: float = 0.0
    w_bytes: float = 0.0

    def scaled(self, times: float = 1.0, memory: float = 1.0) -> "PassCosts":
        return PassCosts(self.f * times, self.b * times, self.w * times, self.act_bytes * memory,
                         self.w_bytes * memory)

    def __add__(self, other: "PassCosts") -> "PassCosts":
        return PassCosts(*(x + y for x, y in zip(dataclasses.astuple(self), dataclasses.astuple(other))))


@dataclasses.dataclass(frozen=True)
class StageCosts(Costs):
    """`Costs` whose F/B/W times and activation bytes differ per virtual stage (`stages[s]`); the base fields
    (f, b, w, act_mem, w_mem) are the stages' largest, for builders that plan with one cost per pass. Memory is
    in bytes here (the simulator's units are whatever the costs say). `action_s` is the runtime's cost of one
    action beyond its compute and `message_s` its cost per p2p message to or from another rank
    (`profile_overhead`), added to the first part of every action, so they add up along the critical path as
    they do at run time."""
    stages: tuple = ()
    action_s: float = 0.0
    message_s: float = 0.0

    def part_durations(self, plan: Plan, rank: int, a: Action) -> list[float]:
        if a.kind in VOCAB_PASSES:
            times = super().part_durations(plan, rank, a)
        else:
            stage = self.stages[plan.stage_of(rank, a.chunk)]
            by_part = {"F": stage.f, "B": stage.b, "W": stage.w}
            times = [by_part[part] for part in KIND_SPECS[a.kind].parts]
        return [times[0] + self.action_s + self.message_s * remote_messages(plan, rank, a), *times[1:]]

    def action_mem_delta(self, plan: Plan, rank: int, a: Action) -> float:
        if a.kind in VOCAB_PASSES:
            return super().action_mem_delta(plan, rank, a)
        stage = self.stages[plan.stage_of(rank, a.chunk)]
        return {"F": stage.act_bytes, "B": stage.w_bytes - stage.act_bytes, "W": -stage.w_bytes,
                "BW": -stage.act_bytes}[a.kind]


def remote_messages(plan: Plan, rank: int, a: Action) -> int:
    """p2p messages `a` receives or sends from or to another rank: an F from the previous stage and to the next,
    a B/BW from the next and to the previous (a hop within one rank is a local hand-off), an S or T one (the
    hidden state in, the partial gradient out), a W none."""
    if a.kind in VOCAB_PASSES:
        return 1
    if a.kind == "W":
        return 0
    stage = plan.stage_of(rank, a.chunk)
    return sum(0 <= other < plan.num_stages and plan.rank_chunk_of(other)[0] != rank
               for other in (stage - 1, stage + 1))


def stage_costs(layer: PassCosts, embedding: PassCosts, head: PassCosts, layer_counts: Sequence[int], *,
                comm: float = 0.0, vocab_parallel: bool = False, action_s: float = 0.0,
                message_s: float = 0.0) -> StageCosts:
    """Per-stage costs of a layer split: stage s runs layer_counts[s] decoder layers, stage 0 the embedding,
    the last stage the output layer and loss (with `vocab_parallel` neither: every rank runs 1/pp of the
    output layer as S/T, and of the embedding outside the plan); `action_s`, `message_s`: see `StageCosts`."""
    last = len(layer_counts) - 1
    stages = []
    for s, n in enumerate(layer_counts):
        total = layer.scaled(n, n)
        if s == 0 and not vocab_parallel:
            total = total + embedding
        if s == last and not vocab_parallel:
            total = total + head
        stages.append(total)
    act = max(max(st.act_bytes for st in stages), 1.0)
    w_mem = min(max(st.w_bytes for st in stages), act)
    head_fields = dict(head_f=head.f, head_b=head.b + head.w, head_mem=head.act_bytes) if vocab_parallel else {}
    return StageCosts(f=max(max(st.f for st in stages), 1e-9), b=max(max(st.b for st in stages), 1e-9),
                      w=max(st.w for st in stages), comm=comm, act_mem=act, w_mem=w_mem, stages=tuple(stages),
                      action_s=action_s, message_s=message_s, **head_fields)


def uniform_costs(costs: StageCosts) -> Costs:
    """One time per pass, the slowest stage's (what `auto_schedule.measured_costs` hands the cost-fitted builders
    at run time: each rank's median, then the MAX over the world), for predicting the plan zb-h2 / auto fit.
    The per-action overhead is part of each pass, as it is of the action times measured at run time (F and B
    with one message each, as on most stages)."""
    a, msg = costs.action_s, costs.message_s
    return Costs(f=costs.f + a + msg, b=costs.b + a + msg, w=costs.w + a, comm=costs.comm,
                 head_f=costs.head_f, head_b=costs.head_b)

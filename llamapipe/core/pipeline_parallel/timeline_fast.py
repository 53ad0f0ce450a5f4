"""The simulator's timeline of a plan without vocabulary parallelism, from a table built once per plan.

Why: the planner simulates the same few plans under thousands of cost sets (one per layout it ranks), and the
auto schedule and the offload placement simulate theirs again and again; `simulator.run_timeline` asked the
plan for each action's stage, message and sender on every call (47 million `stage_of` calls to rank
LLaMA-3.1-405B on 1,024 GPUs). Here what follows from the plan alone (each action's message in and out, and
whether it crosses ranks) is computed once per plan (`plan_steps`, cached), and a run asks the costs once per
rank, chunk and kind (`Costs.part_durations`, per stage in `profile_costs.StageCosts`; never per microbatch). Same execution model and the same numbers as the generic loop
(`simulator.run_timeline` keeps it for vocabulary-parallel plans; a test compares both on every builder).
"""
from __future__ import annotations

import functools
from typing import Optional

from llamapipe.core.pipeline_parallel.schedule_ir import KIND_SPECS, PRODUCER, Plan


@functools.lru_cache(maxsize=2048)
def plan_steps(plan: Plan) -> tuple[tuple[tuple, ...], ...]:
    """Each rank's steps of `plan` (cached: plans are frozen and hash by their actions). A step is a tuple
    (action, need, remote, send, cost): the key (payload, source stage, microbatch) of the message it waits
    for or None, whether that message crosses ranks (costs comm), the key of the message it sends or None, and
    (chunk, kind), what its duration depends on."""
    n, rows = plan.num_stages, []
    owner = [plan.rank_chunk_of(stage)[0] for stage in range(n)]
    flows = {kind: (spec.flow, spec.payload) for kind, spec in KIND_SPECS.items()}
    for rank, actions in enumerate(plan.actions):
        stages = [plan.stage_of(rank, chunk) for chunk in range(plan.vpp)]
        row = []
        for a in actions:
            stage, (flow, payload) = stages[a.chunk], flows[a.kind]
            src, dst = stage - flow, stage + flow
            need = (payload, src, a.microbatch) if flow and 0 <= src < n else None
            send = (payload, stage, a.microbatch) if flow and 0 <= dst < n else None
            row.append((a, need, need is not None and owner[src] != rank, send, (a.chunk, a.kind)))
        rows.append(tuple(row))
    return tuple(rows)


def _durations(plan: Plan, costs, rank: int, row: tuple) -> dict:
    """(chunk, kind) -> (whole time, time until its message is sent) of the actions of `row` on `rank`."""
    table = {}
    for a, _, _, _, key in row:
        if key not in table:
            spec, times = KIND_SPECS[a.kind], costs.part_durations(plan, rank, a)
            upto = spec.parts.index(PRODUCER[spec.payload]) + 1 if spec.payload else len(times)
            table[key] = (sum(times), sum(times[:upto]))
    return table


def fast_timeline(plan: Plan, costs, early_send: bool, release: Optional[list[float]]):
    """(timeline, positions): start and end of every action run, and how far each rank got (all of its
    actions unless the plan deadlocks; the caller says where)."""
    steps = plan_steps(plan)
    tables = [_durations(plan, costs, rank, row) for rank, row in enumerate(steps)]
    pos, clock = [0] * plan.pp, list(release) if release is not None else [0.0] * plan.pp
    sent: dict = {}
    timeline: list[list] = [[] for _ in range(plan.pp)]
    comm, progressed = costs.comm, True
    while progressed:
        progressed = False
        for rank, row in enumerate(steps):
            i, now, out, table = pos[rank], clock[rank], timeline[rank], tables[rank]
            while i < len(row):
                action, need, remote, send, key = row[i]
                ready = 0.0
                if need is not None:
                    arrived = sent.get(need)
                    if arrived is None:
                        break
                    ready = arrived + comm if remote else arrived
                start = now if now > ready else ready
                whole, until_send = table[key]
                now = start + whole
                if send is not None:
                    sent[send] = start + until_send if early_send else now
                out.append((start, now, action))
                i += 1
            progressed = progressed or i > pos[rank]
            pos[rank], clock[rank] = i, now
    return timeline, pos

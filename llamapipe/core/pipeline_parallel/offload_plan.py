"""Offload placed by the schedule (PipeOffload, Wan et al., arXiv 2503.01328, ICML 2025): a builder pass.

`with_offload(plan, chunk_num, ...)` adds, on every rank, an O (device-to-host copy of what the forward saved
for its backward) right after each F of a local chunk below `chunk_num` (the zero-bubble fork's
`--offload-chunk-num`: `should_offload = chunk < offload_chunk_num`), and an R (host-to-device copy) `reload_lead`
backwards before that microbatch's B: 1 (the fork's, on a GPU, where the copy back runs on its own stream and has
the time of one backward to finish) or 0 (right before the B: where copies are synchronous, as on a CPU, a lead
only holds the reloaded activations longer). An activation whose forward-to-backward gap is too short stays on the
device, as in the fork's `add_send_recv`: there must be an action between its O and its R, and the gap from the
end of the F to the start of the action the R precedes must exceed 3 x (D2H + H2D), with one copy taking
`offload_time` x (F + B + W) of the chunk (the fork's `--offload-time`).

With `held` (`--offload-weight-grad-inputs`) the same chunks also move what each deferred weight gradient holds
between its B and its W (the layer inputs and output gradients W multiplies): an OW right after a split B and an RW
before its W (`reload_lead` 1: before the action that precedes the W), under the same gap rule. On a zero-bubble
schedule's last ranks that is most of the peak: the cool-down runs every remaining B before the Ws.

The pass is pure (no torch): the simulator prices the O/R (`Costs.offload`, `Costs.offload_share`), the
executor runs them (`offload_store`), `plot-schedule` and the trace draw them.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Optional

from llamapipe.core.pipeline_parallel.schedule_ir import BACKWARD_KINDS, OFFLOAD_PASSES, Action, Plan
from llamapipe.core.pipeline_parallel.simulator import Costs, run_timeline

SAFETY = 3.0      # the fork's margin: the gap must hold three round trips


@dataclasses.dataclass(frozen=True)
class OffloadOptions:
    """What the executor needs to offload a job's activations (`runtime.RuntimeOptions.offload`)."""
    chunk_num: int                  # local chunks below this offload (the fork's --offload-chunk-num)
    offload_time: float = 0.0       # one copy's share of F + B + W (the fork's --offload-time)
    min_numel: int = 0              # smaller saved tensors stay on the device (Megatron's minimum size)
    reload_lead: int = 1            # backwards between an R and its B (1: copies overlap, 0: synchronous copies)
    modules: tuple[str, ...] = ()   # only what these submodules save (paths ending so: "attention.core"); () all
    fraction: float = 1.0           # share of each forward's offloadable bytes an O moves (Megatron's fraction)
    rank_delta_bytes: int = 0       # pipeline rank r's Os move r x this many bytes fewer per step (Megatron's)
    held: bool = False              # also OW/RW: what deferred weight gradients hold from B to W


@functools.lru_cache(maxsize=64)
def offload_plan(plan: Plan, options: OffloadOptions) -> Plan:
    """`plan` with its O/R actions; every rank derives the same plan from the same one."""
    return with_offload(plan, options.chunk_num, offload_time=options.offload_time, reload_lead=options.reload_lead,
                        held=options.held)


def with_offload(plan: Plan, chunk_num: int, costs: Optional[Costs] = None, offload_time: float = 0.0,
                 reload_lead: int = 1, held: bool = False) -> Plan:
    """`plan` with O/R actions for the chunks below `chunk_num` (see the module docstring). `costs` time the plan
    (unit costs by default); `offload_time` is one copy's share of F + B + W; `reload_lead` 1 or 0 backwards;
    `held`: OW/RW for the deferred weight gradients' inputs too."""
    assert reload_lead in (0, 1), reload_lead
    if chunk_num <= 0 or any(a.kind in OFFLOAD_PASSES for acts in plan.actions for a in acts):
        return plan
    costs = costs or Costs()
    timeline = run_timeline(plan, costs)        # a plan that deadlocks raises here (PlanError)
    copy = offload_time * (costs.f + costs.b + costs.w)
    actions = tuple(_rank_with_offload(row, chunk_num, SAFETY * 2 * copy, reload_lead, held) for row in timeline)
    name = plan.name if plan.name.endswith("+offload") else plan.name + "+offload"
    return dataclasses.replace(plan, name=name, actions=actions)


def _rank_with_offload(row: list, chunk_num: int, min_gap: float, lead: int, held: bool) -> tuple[Action, ...]:
    """One rank's actions (its simulated (start, end, action) row) with O after each chosen F and R before its B
    (`lead` 0) or the backward that precedes it (`lead` 1); with `held`, OW after each chosen B and RW before its W
    (`lead` 0) or the action that precedes it (`lead` 1)."""
    acts = [a for _, _, a in row]
    where = {(a.kind, a.chunk, a.microbatch): i for i, a in enumerate(acts)}
    before: dict[int, list[Action]] = {}
    after: dict[int, list[Action]] = {}
    for i, a in enumerate(acts):
        if a.chunk >= chunk_num or a.kind not in (("F", "B") if held else ("F",)):
            continue
        if a.kind == "F":
            j = where.get(("B", a.chunk, a.microbatch), where.get(("BW", a.chunk, a.microbatch)))
            k = None if j is None else _reload_slot(acts, i, j) if lead else (j if j > i + 1 else None)
        else:
            j = where.get(("W", a.chunk, a.microbatch))
            k = None if j is None else (j - lead if j - lead > i + 1 else None)
        if k is None or row[k][0] - row[i][1] <= min_gap:
            continue            # too short a gap: the tensors stay on the device
        out, back = ("O", "R") if a.kind == "F" else ("OW", "RW")
        after.setdefault(i, []).append(Action(out, a.chunk, a.microbatch))
        before.setdefault(k, []).append(Action(back, a.chunk, a.microbatch))
    out: list[Action] = []
    for i, a in enumerate(acts):
        out += before.get(i, [])
        out.append(a)
        out += after.get(i, [])
    return tuple(out)


def _reload_slot(acts: list[Action], i: int, j: int) -> Optional[int]:
    """Index of the action the R of the F at `i` (its B at `j`) goes before: the last backward between them, else
    the action just before the B; None unless an action lies between the O and the R."""
    for k in range(j - 1, i + 1, -1):
        if acts[k].kind in BACKWARD_KINDS:
            return k
    return j - 1 if j - 1 > i + 1 else None


def offloaded_keys(plan: Plan, pp_rank: int) -> frozenset:
    """(chunk, microbatch) of every O on `pp_rank`: the forwards whose saved tensors go through the store."""
    return frozenset((a.chunk, a.microbatch) for a in plan.actions[pp_rank] if a.kind == "O")

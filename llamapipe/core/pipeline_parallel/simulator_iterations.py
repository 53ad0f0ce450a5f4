"""Simulate K chained training iterations of a plan, with or without optimizer post-validation.

Why: what a pipeline costs per step is not one iteration's makespan. A synchronous optimizer step
(global grad norm, non-finite check) is a barrier: every rank starts iteration k+1 only after the slowest
rank finished iteration k and stepped. With post-validation (zero-bubble paper, Qi et al., arXiv 2401.10241,
section 4) each rank steps as soon as its own last action is done and starts the next iteration at once,
so iterations overlap and the steady-state time per iteration approaches the longest stage span.

Model: rank r may start iteration k+1 at its release time: barrier + opt[r] without post-validation
(barrier = the latest end of iteration k over all ranks), its own last end of iteration k + opt[r] with
it. Inside an iteration the usual cross-rank dependencies and comm costs apply. Every message of
iteration k+1 follows those of k on its stream, and a rank finishes iteration k before it starts k+1,
so the iterations can be simulated one after the other, each from the ranks' release times.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from llamapipe.core.config import ConfigError
from llamapipe.core.pipeline_parallel.schedule_ir import Plan
from llamapipe.core.pipeline_parallel.simulator import (
    Costs,
    Result,
    measure,
    run_timeline,
    verify,
)


@dataclass
class IterationsResult:
    """What `simulate_iterations` measures.

    `iteration_end[k]`: when iteration k+1 is over on every rank (its last action plus that rank's
    optimizer step). `time_per_iteration`: the steady state, (end of the last - end of the first) /
    (K - 1), or the single iteration's end when K = 1. `result` is the whole run as one `Result`
    (makespan = end of the last action; busy, span and bubble rates over all K iterations) for the
    visualiser; `iteration_of` gives each of its timeline entries' iteration (0-based) and `optimizer`
    each rank's optimizer-step boxes (start, end, iteration)."""
    iterations: int
    post_validation: bool
    iteration_end: list[float]
    time_per_iteration: float
    result: Result = field(repr=False)
    iteration_of: list[list[int]] = field(repr=False)
    optimizer: list[list[tuple[float, float, int]]] = field(repr=False)


def _per_rank(optimizer_step: float | Sequence[float], pp: int) -> list[float]:
    steps = [float(optimizer_step)] * pp if isinstance(optimizer_step, (int, float)) else list(optimizer_step)
    if len(steps) != pp or min(steps) < 0:
        raise ValueError(f"optimizer step cost must be one non-negative number or one per pipeline rank "
                         f"({pp}), got {optimizer_step}")
    return steps


def simulate_iterations(plan: Plan, costs: Costs | None = None, iterations: int = 2, *,
                        post_validation: bool = False, optimizer_step: float | Sequence[float] = 0.0,
                        early_send: bool = True) -> IterationsResult:
    """Verify `plan`, then run `iterations` chained iterations of it under `costs`.

    `optimizer_step` is the optimizer step's time, one number or one per pipeline rank."""
    if iterations < 1:
        raise ConfigError(f"iterations must be at least 1, got {iterations}", "iterations")
    costs = costs or Costs()
    opt = _per_rank(optimizer_step, plan.pp)
    verify(plan)
    release = [0.0] * plan.pp
    timeline: list[list] = [[] for _ in range(plan.pp)]
    iteration_of: list[list[int]] = [[] for _ in range(plan.pp)]
    optimizer: list[list[tuple[float, float, int]]] = [[] for _ in range(plan.pp)]
    ends = []
    for k in range(iterations):
        rows = run_timeline(plan, costs, early_send, release)
        last = [row[-1][1] if row else release[r] for r, row in enumerate(rows)]
        barrier = max(last)
        step_at = last if post_validation else [barrier] * plan.pp
        for r, row in enumerate(rows):
            timeline[r] += row
            iteration_of[r] += [k] * len(row)
            optimizer[r].append((step_at[r], step_at[r] + opt[r], k))
        release = [step_at[r] + opt[r] for r in range(plan.pp)]
        ends.append(max(release))
    per_iteration = (ends[-1] - ends[0]) / (iterations - 1) if iterations > 1 else ends[0]
    return IterationsResult(iterations=iterations, post_validation=post_validation, iteration_end=ends,
                            time_per_iteration=per_iteration, result=measure(plan, costs, timeline),
                            iteration_of=iteration_of, optimizer=optimizer)

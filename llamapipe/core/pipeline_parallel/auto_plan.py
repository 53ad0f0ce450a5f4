"""`auto`'s planner: the best zero-bubble plan for measured costs under a memory cap, judged by what the
runtime pays per iteration.

Why: a synchronous optimizer step makes every iteration cost the plan's makespan (the ramps at both
ends included); with optimizer post-validation (zero-bubble paper, Qi et al., arXiv 2401.10241, section 4)
iterations overlap, and the cost is the longest stage span, first F to last W of one rank, which is the
objective of the paper's heuristic and ILP (appendix G, eq. 3) and the `cost` of its bubble rate (section
5.3). Candidates: the paper's heuristic over its hyperparameter grid (`zb_heuristic`), the list scheduler
of builders_zb, and the fixed plans that fit the cap (ZB-H1, 1F1B, ZB-H2 unit-cost and fitted for one
chunk; ZB-V for two), so `auto` is never worse than any of them at the same memory. `zb-h2` fitted to
measured costs (`zb_h2_fitted`) chooses among some of the same candidates, under ZB-H2's own cap.
Under a cap below what 1F1B (ZB-V with two chunks) holds itself, the candidates planned under the default cap (2p)
with every chunk's activations offloaded (PipeOffload, `offload_plan.with_offload`) are tried too, within the real
cap; one is taken only when it beats the best plan without offload by `OFFLOAD_MARGIN` (the copies cost no time in
the simulator, and on a GPU they overlap compute, but not quite for free).
"""
from __future__ import annotations

import dataclasses

from llamapipe.core.pipeline_parallel import builders
from llamapipe.core.pipeline_parallel.builders_zb import greedy_plan
from llamapipe.core.pipeline_parallel.offload_plan import with_offload
from llamapipe.core.pipeline_parallel.schedule_ir import Plan
from llamapipe.core.pipeline_parallel.simulator import Costs, Result, simulate
from llamapipe.core.pipeline_parallel.zb_heuristic import heuristic_plans

_EPS = 1e-9
OFFLOAD_MARGIN = 1.05       # an offload plan must be this much faster (objective) than the best plan without


def objective(result: Result, post_validation: bool) -> tuple[float, float]:
    """What an iteration costs the runtime, then a tie-break: (longest stage span, makespan) with
    post-validation, (makespan, longest stage span) without."""
    span = max(result.span, default=0.0)
    return (span, result.makespan) if post_validation else (result.makespan, span)


def _better(score: tuple[float, float], than: tuple[float, float]) -> bool:
    """Lexicographically smaller, up to float noise."""
    return score[0] < than[0] - _EPS or (abs(score[0] - than[0]) <= _EPS and score[1] < than[1] - _EPS)


def candidates(pp: int, vpp: int, m: int, costs: Costs, mem_limit: float) -> list[Plan]:
    """Every plan `auto` chooses from (some may exceed `mem_limit`; `plan_auto` drops those)."""
    if vpp == 2:
        return [greedy_plan("auto", pp, 2, m, "v", costs, mem_limit), builders.zbv(pp, m)]
    assert vpp == 1, "auto plans one chunk per rank, or two in V placement"
    plans = heuristic_plans("auto", pp, m, costs, mem_limit)
    plans.append(greedy_plan("auto", pp, 1, m, "interleaved", costs, mem_limit))
    if mem_limit != 2 * pp - 1:     # with the next three, what `zb-h2` chooses from (zb_h2_fitted)
        plans.append(greedy_plan("zb-h2", pp, 1, m, "interleaved", costs, 2 * pp - 1))
    return plans + [builders.zb_h2(pp, m), builders.zb_h1(pp, m), builders.one_f_one_b(pp, m)]


def plan_auto(pp: int, vpp: int, m: int, costs: Costs | None = None, mem_limit: float | None = None, *,
              post_validation: bool = False) -> Plan:
    """The candidate within `mem_limit` activation units per rank (default 2p) with the smallest
    `objective`: makespan for a synchronous step, longest stage span with post-validation."""
    costs = costs or Costs()
    limit = 2 * pp if mem_limit is None else mem_limit
    best = _best(candidates(pp, vpp, m, costs, limit), costs, limit, post_validation)
    assert best is not None, "the list scheduler always keeps within the cap"
    reference = builders.one_f_one_b(pp, m) if vpp == 1 else builders.zbv(pp, m)
    if limit < max(simulate(reference, costs).peak_memory) - _EPS:   # below 1F1B's (ZB-V's) own memory
        free = candidates(pp, vpp, m, costs, 2 * pp)
        best_off = _best([with_offload(plan, vpp, costs) for plan in free], costs, limit, post_validation)
        if best_off is not None and best_off[0][0] * OFFLOAD_MARGIN < best[0][0]:
            return dataclasses.replace(best_off[1], name="auto+offload")
    return dataclasses.replace(best[1], name="auto")


def _best(plans: list[Plan], costs: Costs, limit: float, post_validation: bool) -> tuple | None:
    """(objective, plan) of the plan within `limit` with the smallest `objective`, or None when none fits."""
    best: tuple | None = None
    seen: list[tuple] = []
    for plan in plans:
        if plan.actions in seen:
            continue
        seen.append(plan.actions)
        result = simulate(plan, costs)
        if max(result.peak_memory) > limit + _EPS:
            continue
        score = objective(result, post_validation)
        if best is None or _better(score, best[0]):
            best = (score, plan)
    return best


def _fastest(name: str, candidates: list[Plan], costs: Costs, limit: float) -> Plan:
    """The candidate with the smallest simulated makespan under `costs` among those within `limit`."""
    best = None
    for plan in candidates:
        result = simulate(plan, costs)
        if max(result.peak_memory) <= limit + 1e-9 and (best is None or result.makespan < best[0] - 1e-9):
            best = (result.makespan, plan)
    return dataclasses.replace(best[1], name=name)


def zb_h2_fitted(pp: int, m: int, costs: Costs, *, post_validation: bool = False) -> Plan:
    """ZB-H2 for measured costs: the paper's heuristic run on `costs` under ZB-H2's cap of 2p-1
    microbatches, or the unit-cost ZB-H2, ZB-H1 or 1F1B if one of those simulates faster. The unit-cost
    plan relies on F = B = W; with B about 2W it can be slower than 1F1B (1.05x at p=2, m=8). Under
    post-validation iterations overlap, so it plans for the longest stage span within the same cap, as
    `auto` does (the candidates above are among auto's there)."""
    builders.check_sizes("zb-h2", pp, 1, m)
    limit = 2 * pp - 1
    if post_validation:
        return dataclasses.replace(plan_auto(pp, 1, m, costs, limit, post_validation=True), name="zb-h2")
    candidates = [greedy_plan("zb-h2", pp, 1, m, "interleaved", costs, limit), builders.zb_h2(pp, m),
                  builders.zb_h1(pp, m), builders.one_f_one_b(pp, m)]
    return _fastest("zb-h2", candidates, costs, limit)

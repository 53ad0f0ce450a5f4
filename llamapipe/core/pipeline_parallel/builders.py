"""Pipeline schedule builders: pure functions that return a `Plan` (no torch.distributed).

Why: one executor runs every schedule, so a schedule is only an ordering of F/B/W actions per rank.
Fixed-order schedules live here: GPipe (Huang et al., arXiv 1811.06965), 1F1B and interleaved 1F1B
(Narayanan et al., arXiv 2104.04473, Megatron's order), ZB-H1 (Qi et al., arXiv 2401.10241,
figure 3) and ZB-V (Qi et al., arXiv 2405.15362; the handcrafted order of sail-sg/zero-bubble-pipeline-
parallelism and torch.distributed.pipelining's ScheduleZBVZeroBubble). ZB-H2 comes from the zero-bubble
greedy heuristic in builders_zb.py, at unit costs (fitted to measured costs: `auto_plan.zb_h2_fitted`).
`schedule_specs.build` turns a --pipeline-schedule name into one of these.
"""
from __future__ import annotations

from llamapipe.core.config import ConfigError
from llamapipe.core.pipeline_parallel.builders_zb import zb_h2
from llamapipe.core.pipeline_parallel.schedule_ir import PASSES, Action, Plan

__all__ = ["gpipe", "one_f_one_b", "interleaved", "zb_h1", "zb_h2", "zbv"]


def check_sizes(name: str, pp: int, vpp: int, m: int) -> None:
    if pp < 1 or vpp < 1 or m < 1:
        raise ConfigError(f"pipeline_schedule {name} needs pipeline size ({pp}), model chunks ({vpp}) "
                          f"and microbatches ({m}) of at least 1", "pipeline_schedule")


def gpipe(pp: int, m: int) -> Plan:
    """All forwards, then all fused backwards; peak memory m microbatches on every rank."""
    check_sizes("gpipe", pp, 1, m)
    rank_actions = tuple(Action("F", 0, mb) for mb in range(m)) + tuple(Action("BW", 0, mb) for mb in range(m))
    return Plan("gpipe", pp, 1, m, "interleaved", (rank_actions,) * pp)


def one_f_one_b(pp: int, m: int) -> Plan:
    """Megatron's non-interleaved 1F1B: pp-rank-1 warmup forwards, steady F/BW pairs, cooldown BWs."""
    check_sizes("1f1b", pp, 1, m)
    actions = []
    for rank in range(pp):
        warmup = min(pp - rank - 1, m)
        acts = [Action("F", 0, mb) for mb in range(warmup)]
        for k in range(m - warmup):
            acts += [Action("F", 0, warmup + k), Action("BW", 0, k)]
        acts += [Action("BW", 0, mb) for mb in range(m - warmup, m)]
        actions.append(tuple(acts))
    return Plan("1f1b", pp, 1, m, "interleaved", tuple(actions))


def _interleaved_table(vpp: int, m: int, group: int) -> list[tuple[int, int]]:
    """(microbatch, chunk) of the k-th forward on every rank: groups of `group` microbatches run through
    chunk 0, then chunk 1, ... (Megatron's get_schedule_table)."""
    return [(first + i, chunk) for first in range(0, m, group) for chunk in range(vpp) for i in range(group)]


def interleaved(pp: int, vpp: int, m: int, group: int | None = None) -> Plan:
    """Megatron's interleaved 1F1B over vpp model chunks per rank (placement: stage v on rank v % pp), its
    microbatches in groups of `group` per virtual stage (--microbatch-group-size-per-virtual-pipeline-stage,
    default pp).

    Warmup on rank r is 2*(pp-r-1) + (vpp-1)*group forwards, then F/BW pairs, then the remaining BWs;
    backwards walk the same table with chunks reversed. The order needs m % group == 0 (a short last
    group deadlocks), so other m are built for the next multiple of the group and the phantom microbatches
    dropped: removing whole microbatches keeps a plan's dependency graph acyclic and its streams in order.
    A group below pp deadlocks for most sizes (pp 4 with groups of 1 or 2: a forward waits on a rank that waits
    on it), so it is refused.
    """
    check_sizes("interleaved", pp, vpp, m)
    group = pp if group is None else group
    if group < pp:
        raise ConfigError(f"pipeline_schedule interleaved needs microbatch groups of at least the pipeline size "
                          f"{pp}, got {group}", "pipeline_schedule")
    padded = -(-m // group) * group
    table = _interleaved_table(vpp, padded, group)
    total = len(table)
    fwd = [Action("F", chunk, mb) for mb, chunk in table]
    bwd = [Action("BW", vpp - 1 - chunk, mb) for mb, chunk in table]
    actions = []
    for rank in range(pp):
        warmup = min(2 * (pp - rank - 1) + (vpp - 1) * group, total)
        acts = fwd[:warmup]
        for k in range(total - warmup):
            acts += [fwd[warmup + k], bwd[k]]
        acts += bwd[total - warmup:]
        actions.append(tuple(a for a in acts if a.microbatch < m))
    return Plan("interleaved", pp, vpp, m, "interleaved", tuple(actions))


def zb_h1(pp: int, m: int) -> Plan:
    """ZB-H1: 1F1B with B and W split; rank r delays its W's by r microbatches, so the cooldown's
    backward chain runs at B speed and the W's fill the bubbles. Bubble (p-1)(F+B-W) instead of
    1F1B's (p-1)(F+B+W); in-flight forwards, hence peak memory p*M_B, as in 1F1B."""
    check_sizes("zb-h1", pp, 1, m)
    actions = []
    for rank in range(pp):
        next_f = min(pp - rank, m)
        acts = [Action("F", 0, mb) for mb in range(next_f)]
        for k in range(m):
            acts.append(Action("B", 0, k))
            if k >= rank:
                acts.append(Action("W", 0, k - rank))
            if next_f < m:
                acts.append(Action("F", 0, next_f))
                next_f += 1
        acts += [Action("W", 0, mb) for mb in range(max(m - rank, 0), m)]
        actions.append(tuple(acts))
    return Plan("zb-h1", pp, 1, m, "interleaved", tuple(actions))


def zbv(pp: int, m: int) -> Plan:
    """ZB-V: two chunks per rank in V placement (chunk 0 = stage r, chunk 1 = stage 2p-1-r), B/W split,
    peak memory 2p chunk units (1F1B's). Rank r: 2(p-r)-1 chunk-0 F's, r pairs (F chunk 1, F chunk 0),
    p-r rounds F B W on chunk 1, then steady rounds F B W on chunk 0 and chunk 1, and a cooldown of r
    B pairs and p-r chunk-0 B W before the remaining W's. Each steady round holds B right after the F
    that feeds it, so the V stays full whatever the F:B:W ratio, unlike a list schedule made at unit
    costs. The order needs m >= 2p-1: smaller m are built for 2p-1 and the phantom microbatches dropped
    (as in interleaved)."""
    check_sizes("zbv", pp, 2, m)
    n = max(2 * pp - 1, m)
    actions = []
    for rank in range(pp):
        acts: list[Action] = []
        done = {kind: [0, 0] for kind in PASSES}

        def add(kind: str, chunk: int) -> None:
            acts.append(Action(kind, chunk, done[kind][chunk]))
            done[kind][chunk] += 1
        for chunk in [0] * (2 * (pp - rank) - 1) + [1, 0] * rank:
            add("F", chunk)
        for _ in range(pp - rank):
            add("F", 1), add("B", 1), add("W", 1)
        while done["F"][1] < done["F"][0] or done["F"][0] < n:
            if done["F"][0] < n:
                add("F", 0)
            add("B", 0), add("W", 0), add("F", 1), add("B", 1), add("W", 1)
        for _ in range(rank):
            add("B", 0), add("B", 1)
        for _ in range(pp - rank):
            add("B", 0), add("W", 0)
        for chunk in (1, 0):
            while done["W"][chunk] < done["B"][chunk]:
                add("W", chunk)
        actions.append(tuple(a for a in acts if a.microbatch < m))
    return Plan("zbv", pp, 2, m, "v", tuple(actions))

"""Grouped interleaved 1F1B and 1F1B-V: the zero-bubble fork's memory-spreading orders with a fused backward.

Why: both keep 1F1B's fused BW (no weight-gradient store) but lower or spread the activation memory of
interleaving; the fork (sail-sg/zero-bubble-pipeline-parallelism, PipeOffload, arXiv 2503.01328) runs them
as `--interleave-group-size N` and `--enable-1f1b-v`.

- Megatron's `--microbatch-group-size-per-virtual-pipeline-stage N` is `builders.interleaved(..., group=N)`:
  groups of N microbatches run through chunk 0, chunk 1, ...; N = pp is the interleaved order of today.
- The fork's grouped interleave (scheduler/group_interleaved_1f1b.py, GroupBuildingBlockScheduler) repeats a
  building block on a slot grid: F, B, W one slot each, B one slot after its successor stage's, W right
  after B (fused here into BW). Chunk c of a group starts 3*k*N slots after chunk c-1, where
  k = ceil(ceil(p/2) / N) groups (its unit-cost minimum group ceil(p/2)); a larger N delays B less and keeps
  fewer forwards in flight per chunk. A rank's order is its actions sorted by slot (the fork's shift and
  squeeze move whole rows or close gaps, which keeps each rank's order), which respects every dependency.
- 1F1B-V (scheduler/v1f1b.py): the V placement with the fork's 6-slot block pattern (`create_whole_pattern`:
  chunk-0 F's one slot apart down the ranks, chunk-1 F's back up, then BW's of chunk 1 and chunk 0), B and W
  fused. The fork's warmup pass (moving warmup forwards earlier without raising the peak) is not applied:
  the executor runs the order eagerly, which closes the warmup gaps.
Short last groups are built as phantom microbatches and dropped, which keeps a plan acyclic (builders.py).
"""
from __future__ import annotations

import math

from llamapipe.core.config import ConfigError
from llamapipe.core.pipeline_parallel.builders import check_sizes
from llamapipe.core.pipeline_parallel.schedule_ir import Action, Plan

__all__ = ["group_interleaved", "fork_min_group", "one_f_one_b_v", "v1f1b_pattern"]


def fork_min_group(pp: int) -> int:
    """The fork's smallest group at unit costs, ceil(p/2): chunk c+1 of a microbatch never starts before
    chunk c left the last rank."""
    return (pp + 1) // 2


def check_group(name: str, group: int, least: int) -> None:
    """One sentence naming the schedule when a microbatch group size cannot be built."""
    if group < least:
        raise ConfigError(f"pipeline_schedule {name} needs microbatch groups of at least {least}, got {group}",
                          "pipeline_schedule")


def _group_slots(pp: int, vpp: int, group: int, rank: int) -> list[tuple[int, str, int, int]]:
    """(slot, kind, chunk, microbatch in group) of one building block on `rank`, as the fork places them."""
    min_k = -(-fork_min_group(pp) // group)
    period = vpp // math.gcd(vpp, min_k)

    def start(c: int, g: int) -> int:
        return 3 * min_k * group * c + 3 * g + 3 * group * (c // period)
    last_f = start(vpp - 1, 0) + rank
    first_b = last_f + 3 * (pp - 1 - rank) + 1
    slots = [(start(c, g) + rank, "F", c, g) for c in range(vpp) for g in range(group)]
    slots += [(first_b + start(c, g), "BW", vpp - 1 - c, g) for c in range(vpp) for g in range(group)]
    return slots


def group_interleaved(pp: int, vpp: int, m: int, group: int) -> Plan:
    """The fork's grouped interleaved 1F1B (--interleave-group-size `group`), BW fused; the fork caps the
    group at the pipeline size."""
    check_sizes("group-interleaved", pp, vpp, m)
    check_group("group-interleaved", group, 1)
    group = min(group, pp)
    block = 3 * group * vpp                     # slots of one group's F, B and W on every chunk
    actions = []
    for rank in range(pp):
        timed = sorted((slot + block * first // group, kind, chunk, first + g)
                       for first in range(0, m, group) for slot, kind, chunk, g in _group_slots(pp, vpp, group, rank))
        actions.append(tuple(Action(kind, chunk, mb) for _, kind, chunk, mb in timed if mb < m))
    return Plan("group-interleaved", pp, vpp, m, "interleaved", tuple(actions))


def v1f1b_pattern(pp: int) -> list[list[int]]:
    """The fork's `create_whole_pattern`, unreduced: per rank the slots of (F chunk 0, F chunk 1, B chunk 1,
    B chunk 0, W chunk 1, W chunk 0) of microbatch 0; a microbatch later is 6 slots later."""
    pattern = [[0] * 6 for _ in range(pp)]
    now = 0
    for i in range(pp):
        now += 1
        pattern[i][0] = now
    for i in range(pp):
        now += 1
        pattern[pp - 1 - i][1] = now
    now += 1 + (3 if pp % 3 == 0 else 0)
    cyc = (3 - (pp + 2) % 3) % 3
    for column, ranks in ((2, range(pp)), (3, range(pp - 1, -1, -1))):
        for i in ranks:
            pattern[i][column], pattern[i][column + 2] = now, now + 1
            cyc, now = cyc + 1, now + 2
            if cyc == 3:
                cyc, now = 0, now + 3
    return pattern


def one_f_one_b_v(pp: int, m: int) -> Plan:
    """1F1B-V: two chunks per rank on the V placement, fused BW, the fork's block order."""
    check_sizes("1f1b-v", pp, 2, m)
    kinds = (("F", 0), ("F", 1), ("BW", 1), ("BW", 0))
    actions = []
    for slots in v1f1b_pattern(pp):
        timed = sorted((slot + 6 * mb, kind, chunk, mb) for mb in range(m) for slot, (kind, chunk) in zip(slots, kinds))
        actions.append(tuple(Action(kind, chunk, mb) for _, kind, chunk, mb in timed))
    return Plan("1f1b-v", pp, 2, m, "v", tuple(actions))

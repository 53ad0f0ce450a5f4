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
  squeeze move whole rows or close gaps, which keeps each rank's order), which respects every dependency; the
  orders equal the fork's (checked against its code for p = 2..8, v = 2..4, every group).
- 1F1B-V (scheduler/v1f1b.py): the V placement with the fork's 6-slot block pattern (`create_whole_pattern`:
  chunk-0 F's one slot apart down the ranks, chunk-1 F's back up, then BW's of chunk 1 and chunk 0), B and W
  fused, and the fork's warmup squeeze (forwards moved earlier without raising the block's peak); the orders
  equal the fork's `schedule_by_pattern` (checked against its code for p = 2..8).
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


# where the k-th F/B of a kind on a rank may go, after the k-th of (rank offset, kind) (the fork's dependencies; at the
# V's turn, the same rank's kind); B and b wait for the fused W of the stage before them
_AFTER = {"F": ((-1, "F"), None), "f": ((1, "f"), "F"), "B": ((-1, "W"), "f"), "b": ((1, "w"), "W"),
          "W": (None, "B"), "w": (None, "b")}


def _grid(pp: int, m: int) -> list[list[str]]:
    """The fork's repeated block after `clear_invalid_index`: per rank a row of slots holding F f B b W w (F and B
    of chunk 0 and 1: F f, b B; W w the W right after B b), m copies each, microbatch 0 at 6 + its block slot."""
    rows = [[" "] * (6 * (4 * pp + m + 2)) for _ in range(pp)]
    for rank, slots in enumerate(v1f1b_pattern(pp)):
        for char, slot in zip("FfBbWw", slots):
            for mb in range(m):
                rows[rank][6 + slot + 6 * mb] = char
    return rows


def _earliest(rows: list[list[str]], loc: dict, rank: int, char: str, k: int) -> int:
    """The first slot (before the current one) where the k-th `char` of `rank` may run: after its own previous one
    and the action it depends on, on a free slot (two free slots for a B, which its W follows)."""
    pos = loc.get((rank, char, k - 1), -1)
    other, same = _AFTER[char]
    pp = len(rows)
    if other is not None and 0 <= rank + other[0] < pp:
        pos = max(pos, loc.get((rank + other[0], other[1], k), -1))
    elif same is not None:
        pos = max(pos, loc.get((rank, same, k), -1))
    return pos + 1


def _squeeze_warmup(rows: list[list[str]]) -> None:
    """The fork's `process_warmup_without_increasing_peak_mem`: column by column, move each B/W to the first free
    slot its dependencies allow, and each F as early as that without raising any rank above the block's peak."""
    mem = [[0] * len(row) for row in rows]
    for row, held in zip(rows, mem):
        cur = 0
        for i, char in enumerate(row):
            cur += (char in "Ff") - (char in "Ww")
            held[i] = cur
    peak, loc, count = max(max(held) for held in mem), {}, {}
    for i in range(len(rows[0])):
        for rank, row in enumerate(rows):
            char = row[i]
            if char == " ":
                continue
            k = count[rank, char] = count.get((rank, char), -1) + 1
            pos = _earliest(rows, loc, rank, char, k)
            while pos < i and (row[pos] != " " or (char in "Bb" and row[pos + 1] != " ")):
                pos += 1
            if pos < i and char in "Ff":
                place = i
                while place > pos and mem[rank][place - 1] < peak:
                    place -= 1
                while place < i and row[place] != " ":
                    place += 1
                pos = place
            if pos < i:
                row[pos], row[i] = char, " "
                for j in range(pos, i):
                    mem[rank][j] += (char in "Ff") - (char in "Ww")
            loc[rank, char, k] = pos


def one_f_one_b_v(pp: int, m: int) -> Plan:
    """1F1B-V: two chunks per rank on the V placement, fused BW, the fork's block order with its warmup squeeze."""
    check_sizes("1f1b-v", pp, 2, m)
    rows = _grid(pp, m)
    _squeeze_warmup(rows)
    kinds = {"F": ("F", 0), "f": ("F", 1), "B": ("BW", 1), "b": ("BW", 0)}
    actions = []
    for row in rows:
        done: dict = {}
        acts = []
        for char in row:
            if char in kinds:
                acts.append(Action(*kinds[char], done.get(char, 0)))
                done[char] = done.get(char, 0) + 1
        actions.append(tuple(acts))
    return Plan("1f1b-v", pp, 2, m, "v", tuple(actions))

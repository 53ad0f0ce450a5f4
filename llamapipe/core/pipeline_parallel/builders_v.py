"""V-Half and V-Min: V-placement schedules with half and a third of 1F1B's activation memory.

Why: Qi et al., "Pipeline Parallelism with Controllable Memory" (arXiv 2405.15362, section 4) build a
schedule by repeating one *building block*: every microbatch runs the same F/B pattern, shifted by
6 slots (F and B of two chunks, plus two W's), and the block's *lifespan* (F to B of a chunk, summed
over the chunks of a rank) fixes the peak activation memory. On the V placement (chunk 0 = stage r,
chunk 1 = stage 2p-1-r) two blocks are memory-optimal at unit costs:

- V-Min: chunk-0 forwards one slot apart, lifespan about 4p slots, peak about p/3 of 1F1B's
  (paper: (p+4)//3 whole-stage microbatches, 1F1B p), bubble about 1F1B's at F = B = W;
- V-Half: forwards two slots apart, lifespan about 6p slots, peak about p/2 of 1F1B's (paper:
  (p+2)//2), the slack absorbs unequal F/B/W times, so it stays at 1F1B's speed or better.

A rank's order is its actions sorted by slot; each W takes the first free slot after its B (oldest B
first), the two slots a block leaves empty. The slot times respect every dependency, so the order
cannot deadlock; the executor then runs it eagerly, which closes the gaps of the warmup and cooldown
(the paper's "squeeze"). Any m >= 1 works: a block depends only on earlier slots of its microbatch.
"""
from __future__ import annotations

from collections import deque

from llamapipe.core.config import ConfigError
from llamapipe.core.pipeline_parallel.schedule_ir import Action, Plan

__all__ = ["v_half", "v_min", "v_half_offsets", "v_min_offsets", "PERIOD"]

PERIOD = 6                          # slots per microbatch and rank: F, B of two chunks and two W's
_SLOTS = (("F", 0), ("F", 1), ("B", 1), ("B", 0))   # what the four offsets of a rank's block start


def v_min_offsets(pp: int) -> list[tuple[int, int, int, int]]:
    """Slot of (F chunk 0, F chunk 1, B chunk 1, B chunk 0) of microbatch 0 on each rank for V-Min:
    consecutive ranks' chunk-0 forwards one slot apart; the shift (2 when 3 | p) keeps a rank's four slots
    distinct modulo the period."""
    shift = 2 if pp % 3 == 0 else 0
    return [(r, 2 * pp - r - 1, 2 * pp + shift + r, 4 * pp + shift - r - 1) for r in range(pp)]


def v_half_offsets(pp: int) -> list[tuple[int, int, int, int]]:
    """The same for V-Half: chunk-0 forwards two slots apart, shift 3 when 2 | p."""
    shift = 3 if pp % 2 == 0 else 0
    return [(2 * r, 3 * pp - r - 2, 3 * pp + shift + 2 * r - 1, 6 * pp + shift - r - 2) for r in range(pp)]


def _rank_order(offsets: tuple[int, ...], m: int) -> tuple[Action, ...]:
    """One rank's actions in slot order, each W in the first free slot after its B."""
    assert len({o % PERIOD for o in offsets}) == len(offsets), f"block slots collide: {offsets}"
    timed = sorted((offset + PERIOD * mb, kind, chunk, mb)
                   for mb in range(m) for offset, (kind, chunk) in zip(offsets, _SLOTS))
    actions: list[Action] = []
    pending: deque = deque()
    previous = None
    for slot, kind, chunk, mb in timed:
        free = 0 if previous is None else slot - previous - 1
        for _ in range(min(free, len(pending))):
            actions.append(Action("W", *pending.popleft()))
        actions.append(Action(kind, chunk, mb))
        if kind == "B":
            pending.append((chunk, mb))
        previous = slot
    actions += [Action("W", *item) for item in pending]
    return tuple(actions)


def _from_blocks(name: str, offsets: list[tuple[int, int, int, int]], pp: int, m: int) -> Plan:
    if pp < 1 or m < 1:
        raise ConfigError(f"pipeline_schedule {name} needs pipeline size ({pp}) and microbatches ({m}) "
                          "of at least 1", "pipeline_schedule")
    return Plan(name, pp, 2, m, "v", tuple(_rank_order(rank_offsets, m) for rank_offsets in offsets))


def v_half(pp: int, m: int) -> Plan:
    """V-Half: two chunks per rank on the V placement, B/W split, about half of 1F1B's peak memory."""
    return _from_blocks("v-half", v_half_offsets(pp), pp, m)


def v_min(pp: int, m: int) -> Plan:
    """V-Min: two chunks per rank on the V placement, B/W split, about a third of 1F1B's peak memory."""
    return _from_blocks("v-min", v_min_offsets(pp), pp, m)

"""Zero-bubble schedules found by list scheduling: ZB-H2 and one of `auto`'s candidates (auto_plan.py).

Why: the zero-bubble paper (Qi et al., arXiv 2401.10241, section 3.1; its own heuristic is in
zb_heuristic.py) builds schedules greedily from
F/B/W costs and a memory cap: as many F's as memory allows in the warmup, then B first (it is on the
critical path), then F, and W only to fill a bubble at least as long as W, or to free memory when the
cap blocks an F. Its handcrafted ZB-H2 is that heuristic at unit costs with cap (2p-1)*M_B; on V placement it is one
of `auto`'s candidates (the fixed ZB-V order is in builders.py).

The scheduler simulates time: the rank with the earliest clock picks next, so every other rank's
clock is later and the arrivals it sees are final. Each stage runs F's and B's in microbatch order,
so messages on every stream arrive in the order they are consumed. A rank is looked at again only when
it or a neighbour (the only producers of its inputs) emitted, or its clock reached an input's arrival,
which keeps p=32, m=256 at about a second (`auto_plan` runs this next to the paper's own heuristic).
"""
from __future__ import annotations

import functools
import math
from collections import deque
from dataclasses import dataclass, field

from llamapipe.core.config import ConfigError
from llamapipe.core.pipeline_parallel.schedule_ir import (
    Action,
    Plan,
    needs,
    rank_chunk_of,
    sends,
    stage_of,
)
from llamapipe.core.pipeline_parallel.simulator import Costs

_EPS = 1e-9


@dataclass
class _Rank:
    next_f: list[int]
    next_b: list[int]
    clock: float = 0.0
    mem: float = 0.0
    pending_w: deque = field(default_factory=deque)
    actions: list[Action] = field(default_factory=list)


class _Greedy:
    def __init__(self, pp: int, vpp: int, m: int, placement: str, costs: Costs, mem_limit: float,
                 b_order: list[int] | None = None):
        self.pp, self.vpp, self.m, self.placement = pp, vpp, m, placement
        self.b_order = b_order or list(range(m))    # the units in the order each stage runs their B's
        self.costs, self.mem_limit = costs, mem_limit
        self.last = pp * vpp - 1
        self.ranks = [_Rank([0] * vpp, [0] * vpp) for _ in range(pp)]
        self.sent: dict = {}        # (payload, src stage, mb) -> when it was sent
        # per-rank caches, valid until the rank or a neighbour (the only producers of its inputs) emits: the
        # next F/B candidates, and until when a rank that could not act cannot (its next known arrival)
        self._cands: list[dict | None] = [None] * pp
        self._stuck_until: list[float] = [-math.inf] * pp

    def _arrival(self, rank: int, stage: int, kind: str, mb: int) -> float | None:
        """When the input of F/B (stage, mb) is on `rank`; None while its producer has not run."""
        hop = needs(kind, stage, self.last + 1)
        if hop is None:
            return 0.0
        end = self.sent.get((hop.payload, hop.src, mb))
        if end is None:
            return None
        return end + (self.costs.comm if rank_chunk_of(hop.src, self.pp, self.placement)[0] != rank else 0.0)

    def _candidates(self, rank: int, kind: str) -> list[tuple[float | None, int, int, int, bool]]:
        """(arrival, mb, -stage, chunk, fits in memory) of the next F or B of each chunk on `rank`."""
        st, out = self.ranks[rank], []
        for chunk in range(self.vpp):
            if kind == "F":
                mb = st.next_f[chunk]
                if mb >= self.m:
                    continue
            elif st.next_b[chunk] >= self.m or self.b_order[st.next_b[chunk]] >= st.next_f[chunk]:
                continue
            else:
                mb = self.b_order[st.next_b[chunk]]
            fits = True
            if kind == "F":
                later_chunks = self.vpp - 1 - chunk   # keep room so a started microbatch can reach the loss
                fits = st.mem + self.costs.act_mem * (1 + later_chunks) <= self.mem_limit + _EPS
            stage = stage_of(rank, chunk, self.pp, self.placement)
            out.append((self._arrival(rank, stage, kind, mb), mb, -stage, chunk, fits))
        return out

    def _emit(self, rank: int, action: Action) -> None:
        st, costs = self.ranks[rank], self.costs
        for near in {(rank - 1) % self.pp, rank, (rank + 1) % self.pp}:
            self._cands[near], self._stuck_until[near] = None, -math.inf
        st.clock += costs.duration(action.kind)
        st.mem += costs.mem_delta(action.kind)
        st.actions.append(action)
        stage, mb = stage_of(rank, action.chunk, self.pp, self.placement), action.microbatch
        hop = sends(action.kind, stage, self.last + 1)
        if hop is not None:
            self.sent[(hop.payload, stage, mb)] = st.clock
        if action.kind == "F":
            st.next_f[action.chunk] += 1
        elif action.kind == "B":
            st.next_b[action.chunk] += 1
            st.pending_w.append((action.chunk, mb))

    def _try_act(self, rank: int) -> bool:
        """Run one action on `rank` at its clock if the heuristic wants one now."""
        st = self.ranks[rank]
        if st.clock < self._stuck_until[rank] - _EPS:
            return False
        cands = self._cached(rank)
        for kind in ("B", "F"):
            ready = sorted(c[1:4] for c in cands[kind] if c[4] and c[0] is not None and c[0] <= st.clock + _EPS)
            if ready:
                self._emit(rank, Action(kind, ready[0][2], ready[0][0]))
                return True
        # W fills a gap it fits in (or one of unknown length), or frees memory when the cap holds back an F
        blocked = any(not c[4] and c[0] is not None and c[0] <= st.clock + _EPS for c in cands["F"])
        if st.pending_w and (blocked or self._next_arrival(rank) - st.clock >= self.costs.w - _EPS):
            chunk, mb = st.pending_w.popleft()
            self._emit(rank, Action("W", chunk, mb))
            return True
        # a later clock only shrinks the gap, so nothing changes before an input arrives
        self._stuck_until[rank] = min((c[0] for kind in ("B", "F") for c in cands[kind] if c[0] is not None),
                                      default=math.inf)
        return False

    def _cached(self, rank: int) -> dict:
        if self._cands[rank] is None:
            self._cands[rank] = {kind: self._candidates(rank, kind) for kind in ("B", "F")}
        return self._cands[rank]

    def _next_arrival(self, rank: int) -> float:
        cands = self._cached(rank)
        return min((c[0] for kind in ("B", "F") for c in cands[kind] if c[4] and c[0] is not None),
                   default=math.inf)

    def _done(self, st: _Rank) -> bool:
        return min(st.next_b) >= self.m and not st.pending_w

    def run(self, name: str) -> Plan:
        active = list(range(self.pp))
        while active:
            now = min(self.ranks[r].clock for r in active)
            waiting = [r for r in active if self.ranks[r].clock <= now + _EPS]
            acted = next((r for r in waiting if self._try_act(r)), None)
            if acted is not None:
                if self._done(self.ranks[acted]):
                    active.remove(acted)
                continue
            # nothing can start at `now`: jump to the next arrival or the next rank's decision
            later = [self.ranks[r].clock for r in active if r not in waiting]
            wake = min([self._next_arrival(r) for r in waiting] + later)
            assert wake < math.inf, f"greedy schedule is stuck at time {now} (memory limit {self.mem_limit})"
            for r in waiting:
                self.ranks[r].clock = wake
        actions = tuple(tuple(st.actions) for st in self.ranks)
        return Plan(name, self.pp, self.vpp, self.m, self.placement, actions)


def greedy_plan(name: str, pp: int, vpp: int, m: int, placement: str, costs: Costs,
                mem_limit: float = math.inf, b_order: list[int] | None = None) -> Plan:
    """List-schedule F/B/W under `costs` and a per-rank activation-memory cap; each stage runs its B's in
    `b_order` (default: microbatch order; Seq1F1B: each sequence's pieces reversed, builders_seq.py), a B only
    after its own F."""
    if pp < 1 or m < 1:
        raise ConfigError(f"pipeline_schedule {name} needs pipeline size ({pp}) and microbatches ({m}) "
                          "of at least 1", "pipeline_schedule")
    need = vpp * costs.act_mem
    if mem_limit < need - _EPS:
        raise ConfigError(f"pipeline_memory_limit {mem_limit:g} is below the {need:g} activation units one "
                          f"microbatch needs on all {vpp} model chunks of a rank", "pipeline_memory_limit")
    return _Greedy(pp, vpp, m, placement, costs, mem_limit, b_order).run(name)


@functools.lru_cache(maxsize=16)
def zb_h2(pp: int, m: int) -> Plan:
    """ZB-H2: zero bubble at F=B=W with peak memory (2p-1)*M_B (extra warmup F's, W's in the tail)."""
    return greedy_plan("zb-h2", pp, 1, m, "interleaved", Costs(), mem_limit=2 * pp - 1)


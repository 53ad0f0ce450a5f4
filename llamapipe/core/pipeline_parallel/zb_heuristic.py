"""The zero-bubble paper's scheduling heuristic, one model chunk per rank (Qi et al., arXiv 2401.10241, 3.1).

Why a second heuristic next to builders_zb's list scheduler: the paper's builds the schedule microbatch by
microbatch across all stages at once, which keeps the pipeline a parallelogram (F's in a wave down the
stages, then the B's back up) and so reaches its published ZB-1p/ZB-2p bubble rates; `auto_plan` runs
both and keeps the better plan. The steps, as the paper gives them:

- Warm-up: every stage runs F0; then, from the last stage up, a stage adds as many F's as memory allows
  while the first B has not arrived (hyperparameter `delay_first_b`: also start one F that ends after it),
  each stage keeping fewer than the stage before it. Then B0 runs up the pipeline.
- Steady: per microbatch, each stage runs one F (stage i never has fewer F's than stage i+1), then its B.
  A W fills a gap before an F or B input when it fits; a shorter gap gets a W too when this stage's total
  bubble would otherwise exceed the largest stage's (`w_in_small_gaps`: also when it would not). W's also
  free memory when the cap blocks an F. `skip_f`: a stage two or more F's ahead of the next one skips its
  F when that costs no more bubble than the largest stage already has.
- When a stage has no F or B left it runs its remaining W's.
The paper grid-searches the hyperparameters; `heuristic_plans` returns one plan per combination.
"""
from __future__ import annotations

import itertools

from llamapipe.core.pipeline_parallel.schedule_ir import PASSES, PRODUCER, Action, Plan, needs
from llamapipe.core.pipeline_parallel.simulator import Costs

_EPS = 1e-9


class _NoFit(Exception):
    """The cap cannot hold the next F even after every pending W ran."""


class _Heuristic:
    def __init__(self, pp: int, m: int, costs: Costs, mem_limit: float, delay_first_b: bool, skip_f: bool,
                 w_in_small_gaps: bool):
        self.pp, self.m, self.costs, self.limit = pp, m, costs, mem_limit
        self.delay_first_b, self.skip_f, self.w_in_small_gaps = delay_first_b, skip_f, w_in_small_gaps
        self.count = {kind: [0] * pp for kind in PASSES}
        self.clock, self.mem, self.bubble = [0.0] * pp, [0.0] * pp, [0.0] * pp
        self.end = {kind: [[0.0] * m for _ in range(pp)] for kind in PRODUCER.values()}
        self.actions: list[list[Action]] = [[] for _ in range(pp)]

    def _arrival(self, stage: int, kind: str, mb: int) -> float:
        """When the input of `kind` `mb` on `stage` is there (0 for the loader's data, the loss, or a W)."""
        hop = needs(kind, stage, self.pp)
        return 0.0 if hop is None else self.end[PRODUCER[hop.payload]][hop.src][mb] + self.costs.comm

    def _put(self, stage: int, kind: str) -> None:
        mb, duration = self.count[kind][stage], self.costs.duration(kind)
        start = max(self.clock[stage], self._arrival(stage, kind, mb))
        if self.count["F"][stage]:      # idle before the first F is the pipeline's fill, not a bubble
            self.bubble[stage] += start - self.clock[stage]
        self.clock[stage] = start + duration
        if kind != "W":
            self.end[kind][stage][mb] = self.clock[stage]
        self.mem[stage] += self.costs.mem_delta(kind)
        self.count[kind][stage] += 1
        self.actions[stage].append(Action(kind, 0, mb))

    def _pending_w(self, stage: int) -> int:
        return self.count["B"][stage] - self.count["W"][stage]

    def _make_room(self, stage: int) -> None:
        while self.mem[stage] + self.costs.act_mem > self.limit + _EPS:
            if not self._pending_w(stage):
                raise _NoFit
            self._put(stage, "W")

    def _fill_gap(self, stage: int, arrival: float) -> None:
        """W's into the idle time before an input arrives at `arrival`."""
        while self._pending_w(stage) and self.clock[stage] + self.costs.w <= arrival + _EPS:
            self._put(stage, "W")
        gap = arrival - self.clock[stage]
        if self._pending_w(stage) and gap > _EPS and (self.w_in_small_gaps or
                                                      gap > max(self.bubble) - self.bubble[stage]):
            self._put(stage, "W")

    def _warmup(self) -> None:
        costs, extra = self.costs, [0] * self.pp
        for stage in range(self.pp):
            self._put(stage, "F")
        b_done = self.end["F"][self.pp - 1][0] + costs.b        # first B's end on the stage below
        for stage in range(self.pp - 2, -1, -1):
            mem, clock, arrival = self.mem[stage], self.clock[stage], b_done + costs.comm
            while (self.count["F"][stage] + extra[stage] < self.m and mem + costs.act_mem <= self.limit + _EPS
                   and (clock < arrival - _EPS if self.delay_first_b else clock + costs.f <= arrival + _EPS)):
                mem, clock, extra[stage] = mem + costs.act_mem, clock + costs.f, extra[stage] + 1
            b_done = max(clock, arrival) + costs.b
        for stage in range(1, self.pp):
            while 0 < extra[stage] >= extra[stage - 1] and self.count["F"][stage] + extra[stage] < self.m:
                extra[stage] -= 1
        for stage in range(self.pp):
            for _ in range(extra[stage]):
                self._put(stage, "F")
        for stage in range(self.pp - 1, -1, -1):
            self._put(stage, "B")

    def _skips_f(self, stage: int) -> bool:
        """Whether a stage two F's ahead of the next one leaves its F out this round (`skip_f`)."""
        costs, nf = self.costs, self.count["F"]
        if not self.skip_f or stage + 1 >= self.pp or nf[stage] < nf[stage + 1] + 2:
            return False
        next_b = self.clock[stage + 1] + costs.f + costs.b + costs.comm     # earliest arrival of the next B
        if self.clock[stage] >= next_b:
            return True
        freed, w_time, mem = 0, 0.0, self.mem[stage] + costs.act_mem
        while mem > self.limit + _EPS and freed < self._pending_w(stage):
            freed, w_time, mem = freed + 1, w_time + costs.w, mem - costs.w_mem
        if self.clock[stage] + costs.f + w_time <= next_b + _EPS:
            return False
        return next_b - self.clock[stage] <= max(self.bubble) - self.bubble[stage] + _EPS

    def _steady(self, mb: int) -> None:
        want = [self.count["F"][s] < self.m and not self._skips_f(s) for s in range(self.pp)]
        for stage in range(self.pp - 2, -1, -1):
            want[stage] = want[stage] and want[stage + 1]
        for stage in range(self.pp):
            if want[stage]:
                self._make_room(stage)
                if stage > 0:
                    self._fill_gap(stage, self._arrival(stage, "F", self.count["F"][stage]))
                self._put(stage, "F")
        for stage in range(self.pp - 1, -1, -1):
            if stage < self.pp - 1:
                self._fill_gap(stage, self._arrival(stage, "B", mb))
            if stage == 0 and self.count["F"][0] == self.m:
                while self._pending_w(stage):
                    self._put(stage, "W")
            self._put(stage, "B")

    def run(self, name: str) -> Plan:
        self._warmup()
        for mb in range(1, self.m):
            self._steady(mb)
        for stage in range(self.pp):
            while self._pending_w(stage):
                self._put(stage, "W")
        return Plan(name, self.pp, 1, self.m, "interleaved", tuple(tuple(a) for a in self.actions))


def heuristic_plans(name: str, pp: int, m: int, costs: Costs, mem_limit: float) -> list[Plan]:
    """One plan per hyperparameter combination of the paper's grid search (the distinct ones), leaving
    out those that cannot keep within `mem_limit` activation units per rank."""
    plans: list[Plan] = []
    for flags in itertools.product((False, True), repeat=3):
        try:
            plan = _Heuristic(pp, m, costs, mem_limit, *flags).run(name)
        except _NoFit:
            continue
        if plan not in plans:
            plans.append(plan)
    return plans

"""Verify a pipeline plan and simulate it: makespan, bubble rate, peak activation memory, timeline.

Why: schedules are data (docs/design.md section 3), so every builder is checked here before any process runs
it. The cost and memory model is the zero-bubble paper's (Qi et al., arXiv 2401.10241, section 2 and
Table 1): an F of one microbatch on one chunk takes `f` and adds M_B activation units; its B takes `b`
and frees M_B - M_W, keeping the M_W that the weight gradient needs; its W takes `w` and frees M_W.
A p2p hop between two ranks costs `comm`; a hand-off between chunks of the same rank is free.

Execution model (the executor's): each rank runs its list strictly in order; an action starts once its
inputs have arrived; sends never block. A plan that can never finish is a deadlock. `run_timeline` takes
each rank's release time, so `simulator_iterations` chains iterations with it.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from llamapipe.core.pipeline_parallel.schedule_ir import KIND_SPECS, KINDS, PASSES, PRODUCER, Action, Plan, needs, sends


class PlanError(ValueError):
    """A plan is malformed, out of order, or deadlocks; the message names the rank and the action."""


@dataclass(frozen=True)
class Costs:
    """Per-chunk action times and activation memory (units: one microbatch's activations on one chunk)."""
    f: float = 1.0
    b: float = 1.0
    w: float = 1.0
    comm: float = 0.0
    act_mem: float = 1.0   # M_B: held from F until B
    w_mem: float = 0.5     # M_W: the part still held from B until W (0 <= M_W <= M_B)

    def __post_init__(self) -> None:
        if self.f <= 0 or self.b <= 0 or self.w < 0 or self.comm < 0:
            raise ValueError(f"costs F={self.f}, B={self.b} must be positive and W={self.w}, "
                             f"COMM={self.comm} non-negative")
        if not 0 <= self.w_mem <= self.act_mem or self.act_mem <= 0:
            raise ValueError(f"memory model needs 0 <= w_mem ({self.w_mem}) <= act_mem ({self.act_mem}) "
                             f"and act_mem > 0")
        # lookup tables: the simulator and the greedy builder ask these for every action
        object.__setattr__(self, "_duration", {"F": self.f, "B": self.b, "W": self.w, "BW": self.b + self.w})
        object.__setattr__(self, "_mem_delta", {"F": self.act_mem, "B": self.w_mem - self.act_mem,
                                                "W": -self.w_mem, "BW": -self.act_mem})

    def duration(self, kind: str) -> float:
        return self._duration[kind]

    def mem_delta(self, kind: str) -> float:
        return self._mem_delta[kind]


@dataclass
class Result:
    """What `simulate` measures. Bubble rate follows the zero-bubble paper: (span - work) / span of the
    rank with the longest span, where span is first start to last end on that rank and work the sum of
    its action times; makespan_bubble_rate is the idle share of all ranks over the whole makespan."""
    makespan: float
    busy: list[float]
    span: list[float]
    bubble_rate: float
    makespan_bubble_rate: float
    peak_memory: list[float]
    timeline: list[list[tuple[float, float, Action]]] = field(repr=False)


def _check_ranges(plan: Plan) -> None:
    if len(plan.actions) != plan.pp:
        raise PlanError(f"plan has {len(plan.actions)} action lists for pp={plan.pp}")
    for rank, acts in enumerate(plan.actions):
        for i, a in enumerate(acts):
            if a.kind not in KINDS or not 0 <= a.chunk < plan.vpp or not 0 <= a.microbatch < plan.num_microbatches:
                raise PlanError(f"rank {rank} action #{i} {a}: kind, chunk or microbatch out of range "
                                f"(vpp={plan.vpp}, microbatches={plan.num_microbatches})")


def _check_rank_order(plan: Plan, rank: int) -> None:
    """Each (chunk, mb) gets F, B, W once and in that order; same-rank stage hand-offs in order too."""
    done: dict[str, set] = {part: set() for part in PASSES}
    for i, a in enumerate(plan.actions[rank]):
        key, where = (a.chunk, a.microbatch), f"rank {rank} action #{i} {a}"
        for part in KIND_SPECS[a.kind].parts:
            if key in done[part]:
                raise PlanError(f"{where}: duplicated {part} for chunk {a.chunk} microbatch {a.microbatch}")
            before = PASSES[PASSES.index(part) - 1] if part != PASSES[0] else None
            if before is not None and key not in done[before]:
                raise PlanError(f"{where}: {part} before its {before}")
            done[part].add(key)
        hop = needs(a.kind, plan.stage_of(rank, a.chunk), plan.num_stages)
        if hop is not None:
            src_rank, src_chunk = plan.rank_chunk_of(hop.src)
            producer = PRODUCER[hop.payload]
            if src_rank == rank and (src_chunk, a.microbatch) not in done[producer]:
                neighbour = "previous" if hop.payload == "act" else "next"
                raise PlanError(f"{where}: {producer} before the {neighbour} stage's {producer} on the same rank")
    for part in PASSES:
        for chunk in range(plan.vpp):
            for mb in range(plan.num_microbatches):
                if (chunk, mb) not in done[part]:
                    raise PlanError(f"rank {rank}: missing {part} for chunk {chunk} microbatch {mb}")


def _stage_order(plan: Plan, stage: int, payload: str) -> list[tuple[int, Action]]:
    """The actions of `stage` that send or consume `payload`, in its rank's order."""
    rank, chunk = plan.rank_chunk_of(stage)
    return [(i, a) for i, a in enumerate(plan.actions[rank]) if a.chunk == chunk and KIND_SPECS[a.kind].payload == payload]


def _check_streams(plan: Plan) -> None:
    """Messages on one stream (activations s->s+1, gradients s+1->s) are consumed in the order sent."""
    for stage in range(plan.num_stages - 1):
        for payload, (src, dst) in (("act", (stage, stage + 1)), ("grad", (stage + 1, stage))):
            sent, received = _stage_order(plan, src, payload), _stage_order(plan, dst, payload)
            for (_, s), (i, r) in zip(sent, received):
                if s.microbatch != r.microbatch:
                    rank, src_rank = plan.rank_chunk_of(dst)[0], plan.rank_chunk_of(src)[0]
                    raise PlanError(f"rank {rank} action #{i} {r}: receives microbatch {r.microbatch} but rank "
                                    f"{src_rank} sends microbatch {s.microbatch} first on that stream")


def verify(plan: Plan) -> None:
    """Static checks: ranges, F/B/W exactly once and in order, per-stream message order."""
    _check_ranges(plan)
    for rank in range(plan.pp):
        _check_rank_order(plan, rank)
    _check_streams(plan)


def _arrival(plan: Plan, rank: int, a: Action, costs: Costs, sent: dict) -> float | None:
    """Time the inputs of `a` are on `rank`, or None while the producer has not run. `sent` maps
    (payload, src stage, microbatch) to the time the producer sent it."""
    hop = needs(a.kind, plan.stage_of(rank, a.chunk), plan.num_stages)
    if hop is None:
        return 0.0   # own earlier action (checked statically) or data from the loader
    end = sent.get((hop.payload, hop.src, a.microbatch))
    if end is None:
        return None
    return end + (costs.comm if plan.rank_chunk_of(hop.src)[0] != rank else 0.0)


def _deadlock_message(plan: Plan, pos: list[int]) -> str:
    stuck = []
    for rank, i in enumerate(pos):
        if i < len(plan.actions[rank]):
            a = plan.actions[rank][i]
            hop = needs(a.kind, plan.stage_of(rank, a.chunk), plan.num_stages)
            producer = PRODUCER[hop.payload]
            stuck.append(f"rank {rank} action #{i} {a} waits for {producer} of stage {hop.src} microbatch "
                         f"{a.microbatch} from rank {plan.rank_chunk_of(hop.src)[0]}")
    return "deadlock: " + "; ".join(stuck)


def run_timeline(plan: Plan, costs: Costs, early_send: bool = True,
                 release: list[float] | None = None) -> list[list[tuple[float, float, Action]]]:
    """Start and end of every action of a verified plan; rank r starts no earlier than `release[r]` (default 0).
    Event order does not matter: each start is max(rank clock, input arrival)."""
    pos, clock = [0] * plan.pp, list(release) if release is not None else [0.0] * plan.pp
    sent: dict = {}
    timeline: list[list] = [[] for _ in range(plan.pp)]
    progressed = True
    while progressed:
        progressed = False
        for rank, acts in enumerate(plan.actions):
            while pos[rank] < len(acts):
                a = acts[pos[rank]]
                ready = _arrival(plan, rank, a, costs, sent)
                if ready is None:
                    break
                start = max(clock[rank], ready)
                clock[rank] = end = start + costs.duration(a.kind)
                hop = sends(a.kind, plan.stage_of(rank, a.chunk), plan.num_stages)
                if hop is not None:       # the executor sends a BW's input gradient before its W part
                    parts = KIND_SPECS[a.kind].parts
                    upto = parts[:parts.index(PRODUCER[hop.payload]) + 1]
                    sent[(hop.payload, hop.src, a.microbatch)] = (
                        start + sum(costs.duration(part) for part in upto) if early_send else end)
                timeline[rank].append((start, end, a))
                pos[rank] += 1
                progressed = True
    if any(p < len(acts) for p, acts in zip(pos, plan.actions)):
        raise PlanError(_deadlock_message(plan, pos))
    return timeline


def peak_memory(plan: Plan, costs: Costs) -> list[float]:
    """Per-rank peak activation memory over the plan, starting from zero."""
    peaks = []
    for acts in plan.actions:
        level = peak = 0.0
        for a in acts:
            level += costs.mem_delta(a.kind)
            peak = max(peak, level)
        peaks.append(peak)
    return peaks


def simulate(plan: Plan, costs: Costs | None = None, *, early_send: bool = True) -> Result:
    """Verify `plan`, then run it under `costs`; raises PlanError naming the rank and action.

    `early_send` models the executor: a BW sends its input gradient after its B part, then runs W.
    With False a BW sends at its end, as in Megatron-LM and the zero-bubble paper's 1F1B baseline."""
    costs = costs or Costs()
    verify(plan)
    return measure(plan, costs, run_timeline(plan, costs, early_send))


def measure(plan: Plan, costs: Costs, timeline: list[list[tuple[float, float, Action]]]) -> Result:
    """Makespan, spans, bubble rates and peak memory of a simulated `timeline` of `plan`."""
    busy = [sum(e - s for s, e, _ in row) for row in timeline]
    span = [row[-1][1] - row[0][0] if row else 0.0 for row in timeline]
    makespan = max((row[-1][1] for row in timeline if row), default=0.0)
    max_span = max(span)
    bubble = (max_span - max(busy)) / max_span if max_span else 0.0
    total = makespan * plan.pp
    return Result(makespan=makespan, busy=busy, span=span, bubble_rate=bubble,
                  makespan_bubble_rate=1 - sum(busy) / total if total else 0.0,
                  peak_memory=peak_memory(plan, costs), timeline=timeline)

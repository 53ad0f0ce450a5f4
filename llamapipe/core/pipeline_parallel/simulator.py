"""Verify a pipeline plan and simulate it: makespan, bubble rate, peak activation memory, timeline.

Why: schedules are data (docs/design.md section 3), so every builder is checked here before any process runs
it. The cost and memory model is the zero-bubble paper's (Qi et al., arXiv 2401.10241, section 2 and
Table 1): an F of one microbatch on one chunk takes `f` and adds M_B activation units; its B takes `b`
and frees M_B - M_W, keeping the M_W that the weight gradient needs; its W takes `w` and frees M_W.
A p2p hop between two ranks costs `comm`; a hand-off between chunks of the same rank is free.
The output layer with its loss costs `head_f`/`head_b` and holds `head_mem` (logits) from forward to
backward: on the last stage's F/B, or in a vocabulary-parallel plan (arXiv 2411.05288) split evenly over
the S/T actions of every rank. A collective (T's softmax statistics, the last stage's summed input
gradient) is there `comm` after every rank's producing action ended.
Offload (PipeOffload, arXiv 2503.01328): an O moves `offload_share` of its unit's M_B to host memory and an R
brings it back; an OW moves the M_W a deferred W holds and its RW brings that back; each takes `offload` on its
rank's timeline (0: the copies overlap compute on their own
stream, as on a GPU; on a CPU they are memcpy on the compute cores).

Execution model (the executor's): each rank runs its list strictly in order; an action starts once its
inputs have arrived; sends never block. A plan that can never finish is a deadlock. `run_timeline` takes
each rank's release time, so `simulator_iterations` chains iterations with it.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace

from llamapipe.core.pipeline_parallel.schedule_ir import (ALL, KIND_SPECS, PRODUCER, VOCAB_PASSES, Action, Plan,
                                                          needs, sends, vocab_needs)
from llamapipe.core.pipeline_parallel.plan_checks import PlanError, verify
from llamapipe.core.pipeline_parallel.timeline_fast import fast_timeline


@dataclass(frozen=True)
class Costs:
    """Per-chunk action times and activation memory (units: one microbatch's activations on one chunk)."""
    f: float = 1.0
    b: float = 1.0
    w: float = 1.0
    comm: float = 0.0
    act_mem: float = 1.0   # M_B: held from F until B
    w_mem: float = 0.5     # M_W: the part still held from B until W (0 <= M_W <= M_B)
    head_f: float = 0.0    # output layer + loss forward over the whole vocabulary (on top of the last stage's f)
    head_b: float = 0.0    # its backward (input and weight gradient)
    head_mem: float = 0.0  # its logits, held from its forward to its backward
    offload: float = 0.0   # one O (device to host) or R (host to device) on its rank's timeline
    offload_share: float = 1.0   # the share of M_B an O moves to host memory (what the store can take)

    def __post_init__(self) -> None:
        if not 0 <= self.offload_share <= 1:
            raise ValueError(f"offload_share {self.offload_share} must be within [0, 1]")
        if self.f <= 0 or self.b <= 0 or min(self.w, self.comm, self.head_f, self.head_b, self.head_mem,
                                             self.offload) < 0:
            raise ValueError(f"costs F={self.f}, B={self.b} must be positive and W={self.w}, "
                             f"COMM={self.comm} and the head's costs non-negative")
        if not 0 <= self.w_mem <= self.act_mem or self.act_mem <= 0:
            raise ValueError(f"memory model needs 0 <= w_mem ({self.w_mem}) <= act_mem ({self.act_mem}) "
                             f"and act_mem > 0")
        # lookup tables: the simulator and the greedy builder ask these for every action
        moved = self.act_mem * self.offload_share
        object.__setattr__(self, "_duration", {"F": self.f, "B": self.b, "W": self.w, "BW": self.b + self.w,
                                               "O": self.offload, "R": self.offload,
                                               "OW": self.offload, "RW": self.offload})
        object.__setattr__(self, "_mem_delta", {"F": self.act_mem, "B": self.w_mem - self.act_mem,
                                                "W": -self.w_mem, "BW": -self.act_mem, "O": -moved, "R": moved,
                                                "OW": -self.w_mem, "RW": self.w_mem})

    def duration(self, kind: str) -> float:
        return self._duration[kind]

    def pieces(self, k: int) -> "Costs":
        """A Seq1F1B piece's costs (seq_split.py, FLOPs-balanced pieces): 1/K of a microbatch's time, message and
        activations (the output layer's head_* costs as given)."""
        if k == 1:
            return self
        return replace(self, f=self.f / k, b=self.b / k, w=self.w / k, comm=self.comm / k, act_mem=self.act_mem / k,
                       w_mem=self.w_mem / k)

    def mem_delta(self, kind: str) -> float:
        return self._mem_delta[kind]

    def part_durations(self, plan: Plan, rank: int, a: Action) -> list[float]:
        """Time of each pass of `a` on `rank`, with the output layer's share where it runs."""
        if a.kind in VOCAB_PASSES:
            return [(self.head_f if a.kind == "S" else self.head_b) / plan.pp]
        parts = KIND_SPECS[a.kind].parts
        if (self.head_f or self.head_b) and not plan.vocab and plan.stage_of(rank, a.chunk) == plan.num_stages - 1:
            head = {"F": self.head_f, "B": self.head_b}
            return [self._duration[part] + head.get(part, 0.0) for part in parts]
        return [self._duration[part] for part in parts]

    def action_mem_delta(self, plan: Plan, rank: int, a: Action) -> float:
        """Activation memory `a` adds (negative: frees) on `rank`, the output layer's logits included."""
        if a.kind in VOCAB_PASSES:
            return self.head_mem / plan.pp * (1 if a.kind == "S" else -1)
        last = plan.stage_of(rank, a.chunk) == plan.num_stages - 1 and not plan.vocab
        head = {"F": self.head_mem, "B": -self.head_mem, "BW": -self.head_mem}.get(a.kind, 0.0) if last else 0.0
        return self.mem_delta(a.kind) + head


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


def arrival(plan: Plan, rank: int, a: Action, costs: Costs, sent: dict) -> float | None:
    """Time the inputs of `a` are on `rank`, or None while the producer has not run. `sent` maps
    (payload, src stage, microbatch) to the time the producer sent it, and (part, rank, microbatch) to
    when a pass that a vocabulary dependency waits for ended there."""
    stage = plan.stage_of(rank, a.chunk)
    hop = needs(a.kind, stage, plan.num_stages)
    ready = 0.0   # own earlier action (checked statically) or data from the loader
    if hop is not None:
        end = sent.get((hop.payload, hop.src, a.microbatch))
        if end is None:
            return None
        ready = end + (costs.comm if plan.rank_chunk_of(hop.src)[0] != rank else 0.0)
    dep = vocab_needs(a.kind, stage, plan.num_stages) if plan.vocab else None
    if dep is not None:
        where = [(r, 0) for r in range(plan.pp)] if dep.stage == ALL else [plan.rank_chunk_of(dep.stage)]
        ends = [sent.get((dep.part, r, chunk, a.microbatch)) for r, chunk in where]
        ranks = [r for r, _ in where]
        if None in ends:
            return None
        remote = any(r != rank for r in ranks)
        ready = max(ready, max(ends) + (costs.comm if remote else 0.0))
    return ready


def _deadlock_message(plan: Plan, pos: list[int]) -> str:
    stuck = []
    for rank, i in enumerate(pos):
        if i < len(plan.actions[rank]):
            a = plan.actions[rank][i]
            hop = needs(a.kind, plan.stage_of(rank, a.chunk), plan.num_stages)
            if hop is None:
                dep = vocab_needs(a.kind, plan.stage_of(rank, a.chunk), plan.num_stages)
                where = "every rank" if dep.stage == ALL else f"rank {plan.rank_chunk_of(dep.stage)[0]}"
                stuck.append(f"rank {rank} action #{i} {a} waits for {dep.part} of microbatch {a.microbatch} "
                             f"on {where}")
                continue
            producer = PRODUCER[hop.payload]
            stuck.append(f"rank {rank} action #{i} {a} waits for {producer} of stage {hop.src} microbatch "
                         f"{a.microbatch} from rank {plan.rank_chunk_of(hop.src)[0]}")
    return "deadlock: " + "; ".join(stuck)


def advance(plan: Plan, costs: Costs, rank: int, a: Action, start: float, sent: dict, early_send: bool) -> float:
    """Run `a` on `rank` from `start`: record in `sent` what it produces and when; returns its end."""
    parts, times = KIND_SPECS[a.kind].parts, costs.part_durations(plan, rank, a)
    end = start + sum(times)
    hop = sends(a.kind, plan.stage_of(rank, a.chunk), plan.num_stages)
    if hop is not None:       # the executor sends a BW's input gradient before its W part
        upto = parts.index(PRODUCER[hop.payload]) + 1
        sent[(hop.payload, hop.src, a.microbatch)] = start + sum(times[:upto]) if early_send else end
    if plan.vocab:            # what vocabulary dependencies wait for: ends of F, S, T per rank and chunk
        sent[(parts[0], rank, a.chunk, a.microbatch)] = start + times[0]
    return end


def run_timeline(plan: Plan, costs: Costs, early_send: bool = True,
                 release: list[float] | None = None) -> list[list[tuple[float, float, Action]]]:
    """Start and end of every action of a verified plan; rank r starts no earlier than `release[r]` (default 0).
    Event order does not matter: each start is max(rank clock, input arrival). Plans without vocabulary
    parallelism run from a table built once per plan (`timeline_fast`: the same numbers, faster)."""
    if plan.vocab:
        return reference_timeline(plan, costs, early_send, release)
    timeline, pos = fast_timeline(plan, costs, early_send, release)
    if any(p < len(acts) for p, acts in zip(pos, plan.actions)):
        raise PlanError(_deadlock_message(plan, pos))
    return timeline


def reference_timeline(plan: Plan, costs: Costs, early_send: bool = True,
                       release: list[float] | None = None) -> list[list[tuple[float, float, Action]]]:
    """`run_timeline` action by action, asking the plan for each message: the path of vocabulary-parallel plans,
    and the reference the fast table is tested against."""
    pos, clock = [0] * plan.pp, list(release) if release is not None else [0.0] * plan.pp
    sent: dict = {}
    timeline: list[list] = [[] for _ in range(plan.pp)]
    progressed = True
    while progressed:
        progressed = False
        for rank, acts in enumerate(plan.actions):
            while pos[rank] < len(acts):
                a = acts[pos[rank]]
                ready = arrival(plan, rank, a, costs, sent)
                if ready is None:
                    break
                start = max(clock[rank], ready)
                clock[rank] = end = advance(plan, costs, rank, a, start, sent, early_send)
                timeline[rank].append((start, end, a))
                pos[rank] += 1
                progressed = True
    if any(p < len(acts) for p, acts in zip(pos, plan.actions)):
        raise PlanError(_deadlock_message(plan, pos))
    return timeline


def peak_memory(plan: Plan, costs: Costs) -> list[float]:
    """Per-rank peak activation memory over the plan, starting from zero."""
    peaks = []
    for rank, acts in enumerate(plan.actions):
        level = peak = 0.0
        for a in acts:
            level += costs.action_mem_delta(plan, rank, a)
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

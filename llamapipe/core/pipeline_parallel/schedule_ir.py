"""Pipeline schedules as data: the plan IR shared by builders, simulator, visualiser and executor.

A plan is, for each pipeline rank, an ordered tuple of `Action(kind, chunk, microbatch)`. `chunk` is
the *local* model-chunk index on that rank (0..vpp-1); the placement maps (rank, chunk) to the virtual
stage it holds. Virtual stage v (0..pp*vpp-1) owns a contiguous range of layers, stage 0 the embedding
and the last stage the head and loss.

Kinds (`KIND_SPECS`, the one action vocabulary): F forward; B input-gradient backward; W weight-gradient
backward; BW = B and W fused. Which message an action consumes and which it sends follows from its kind
alone (`needs`, `sends`): the executor's p2p, the simulator, the builders and the heuristic all ask these.
A plan with `vocab=True` (vocabulary parallelism, arXiv 2411.05288) adds S and T on every rank (chunk 0):
S is the output layer's forward on this rank's vocabulary shard for one microbatch, T its backward. Their
dependencies (`vocab_needs`) reach every rank: the last stage's hidden state goes to every S, T waits for
the softmax statistics of every rank's S (the one collective), and the last stage's backward waits for
every rank's T (its input-gradient partials, summed).
Offload (PipeOffload, arXiv 2503.01328): O copies the activations the forward of (chunk, microbatch) saved for its
backward from the device to host memory, R copies them back; neither sends a message. A builder pass
(`offload_plan.with_offload`) places them: O right after the F, R one backward before the B. OW and RW do the
same for what a deferred weight gradient holds between its B and its W (the layer inputs and output gradients
that W multiplies; zero-bubble schedules): OW right after the B, RW before the W.
Placements: "interleaved" (Megatron, arXiv 2104.04473): stage v on rank v % pp, chunk v // pp.
"v" (ZB-V, arXiv 2401.10241): chunk 0 of rank r is stage r, chunk 1 is stage 2*pp-1-r.
Seq1F1B (`seq_splits` K > 1): the plan's microbatches are sequence pieces, K per microbatch; the pieces of one
sequence run their forwards in order and their backwards in reverse on every stage (`simulator` checks it).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple, Optional

PLACEMENTS = ("interleaved", "v")


@dataclass(frozen=True)
class KindSpec:
    """What one action kind does: the passes it runs and how data flows through it between stages."""
    name: str
    parts: tuple            # the passes it runs, in order (BW runs B then W)
    flow: int               # +1: consumes stage-1's output, sends to stage+1; -1: gradients the other way; 0: local
    payload: Optional[str]  # what travels: "act" (forward output) or "grad" (input gradient); None when flow is 0
    vocab: Optional["Dep"] = None   # S/T: what it waits for across the pipeline (see `vocab_needs`)


LAST = -1   # Dep.stage: the last virtual stage
ALL = -2    # Dep.stage: that pass on every pipeline rank (a reduction over the pipeline group)


class Dep(NamedTuple):
    """A vocabulary-parallel dependency: `payload` is produced by `part` on `stage` (or on every rank)."""
    payload: str     # "hidden" (p2p from the last stage), "stats" (all-gather), "vgrad" (p2p partials, summed)
    part: str
    stage: int       # LAST or ALL


KIND_SPECS: dict[str, KindSpec] = {spec.name: spec for spec in (
    KindSpec("F", ("F",), +1, "act"),
    KindSpec("B", ("B",), -1, "grad"),
    KindSpec("W", ("W",), 0, None),
    KindSpec("BW", ("B", "W"), -1, "grad"),
    KindSpec("S", ("S",), 0, None, Dep("hidden", "F", LAST)),
    KindSpec("T", ("T",), 0, None, Dep("stats", "S", ALL)),
    KindSpec("O", ("O",), 0, None),
    KindSpec("R", ("R",), 0, None),
    KindSpec("OW", ("OW",), 0, None),
    KindSpec("RW", ("RW",), 0, None),
)}
KINDS = tuple(KIND_SPECS)
PASSES = ("F", "B", "W")                                  # what every (chunk, microbatch) gets exactly once
VOCAB_PASSES = ("S", "T")                                 # what every microbatch gets once per rank (vocab plans)
OFFLOAD_PASSES = ("O", "R", "OW", "RW")                   # at most once per (chunk, microbatch), see OFFLOAD_ORDER
OFFLOAD_ORDER = {"O": ("F", "B"), "R": ("O", "B"),        # kind: (the pass it follows, the pass it precedes)
                 "OW": ("B", "W"), "RW": ("OW", "W")}
OFFLOAD_PAIRS = {"O": "R", "OW": "RW"}                    # every offload has its reload
BACKWARD_KINDS = tuple(k for k, spec in KIND_SPECS.items() if "B" in spec.parts)   # compute an input gradient
PRODUCER = {"act": "F", "grad": "B"}                     # the pass whose result each payload is


class Hop(NamedTuple):
    """One message between virtual stages: `payload` from `src` to `dst` (the consumer)."""
    payload: str
    src: int
    dst: int


def needs(kind: str, stage: int, num_stages: int) -> Optional[Hop]:
    """The message an action of `kind` on virtual `stage` consumes, or None (data loader, own earlier pass)."""
    spec = KIND_SPECS[kind]
    src = stage - spec.flow
    return Hop(spec.payload, src, stage) if spec.flow and 0 <= src < num_stages else None


def sends(kind: str, stage: int, num_stages: int) -> Optional[Hop]:
    """The message an action of `kind` on virtual `stage` produces, or None (first/last stage, W)."""
    spec = KIND_SPECS[kind]
    dst = stage + spec.flow
    return Hop(spec.payload, stage, dst) if spec.flow and 0 <= dst < num_stages else None


def vocab_needs(kind: str, stage: int, num_stages: int) -> Optional[Dep]:
    """The vocabulary dependency of an action of `kind` on virtual `stage` in a vocab plan, or None.
    Stage LAST is resolved to the last stage's index; ALL stays ALL."""
    spec = KIND_SPECS[kind]
    dep = spec.vocab
    if dep is None and "B" in spec.parts and stage == num_stages - 1:
        dep = Dep("vgrad", "T", ALL)      # the output layer's input gradient, summed over every rank's T
    if dep is not None and dep.stage == LAST:
        dep = dep._replace(stage=num_stages - 1)
    return dep


class Action(NamedTuple):
    kind: str        # one of KINDS
    chunk: int       # local model chunk on this rank
    microbatch: int

    def __str__(self) -> str:
        return f"{self.kind}{self.microbatch}" + (f"c{self.chunk}" if self.chunk else "")


def stage_of(rank: int, chunk: int, pp: int, placement: str = "interleaved") -> int:
    """Virtual stage held by local `chunk` on pipeline `rank`."""
    if placement == "interleaved":
        return chunk * pp + rank
    assert placement == "v" and chunk in (0, 1), "V placement holds exactly two chunks per rank"
    return rank if chunk == 0 else 2 * pp - 1 - rank


def rank_chunk_of(stage: int, pp: int, placement: str = "interleaved") -> tuple[int, int]:
    """(pipeline rank, local chunk) holding virtual `stage`."""
    if placement == "interleaved":
        return stage % pp, stage // pp
    assert placement == "v" and 0 <= stage < 2 * pp
    return (stage, 0) if stage < pp else (2 * pp - 1 - stage, 1)


@dataclass(frozen=True)
class Plan:
    """A complete schedule: `actions[rank]` is that rank's ordered action list."""
    name: str
    pp: int
    vpp: int
    num_microbatches: int
    placement: str
    actions: tuple  # tuple[tuple[Action, ...], ...], one per pipeline rank
    vocab: bool = False   # vocabulary parallelism: S/T on every rank, the last stage's F computes no loss
    seq_splits: int = 1   # Seq1F1B: unit u is piece u % K of microbatch u // K (core/pipeline_parallel/seq_split.py)

    def __post_init__(self) -> None:
        assert self.placement in PLACEMENTS, self.placement
        assert len(self.actions) == self.pp, "one action list per pipeline rank"

    @property
    def num_stages(self) -> int:
        return self.pp * self.vpp

    def stage_of(self, rank: int, chunk: int) -> int:
        return stage_of(rank, chunk, self.pp, self.placement)

    def rank_chunk_of(self, stage: int) -> tuple[int, int]:
        return rank_chunk_of(stage, self.pp, self.placement)

    def to_json(self) -> dict:
        """Plain data, e.g. to broadcast an `auto` plan from one rank to all."""
        return {"name": self.name, "pp": self.pp, "vpp": self.vpp, "num_microbatches": self.num_microbatches,
                "placement": self.placement, "actions": [[list(a) for a in rank] for rank in self.actions],
                "vocab": self.vocab, "seq_splits": self.seq_splits}

    @classmethod
    def from_json(cls, data: dict) -> "Plan":
        actions = tuple(tuple(Action(str(k), int(c), int(m)) for k, c, m in rank) for rank in data["actions"])
        return cls(data["name"], data["pp"], data["vpp"], data["num_microbatches"], data["placement"], actions,
                   bool(data.get("vocab", False)), int(data.get("seq_splits", 1)))


def unit_label(plan: Plan, unit: int) -> str:
    """A unit's name in pictures and text: its microbatch, or "m.i" for piece i of microbatch m (Seq1F1B)."""
    k = plan.seq_splits
    return f"{unit // k}.{unit % k}" if k > 1 else str(unit)


def action_label(plan: Plan, action: Action) -> str:
    """`str(action)` with the unit named by `unit_label`."""
    return f"{action.kind}{unit_label(plan, action.microbatch)}" + (f"c{action.chunk}" if action.chunk else "")


def splits_backward(plan: Plan) -> bool:
    """Whether `plan` runs B and W as separate actions (a zero-bubble plan)."""
    return any(a.kind == "W" for acts in plan.actions for a in acts)

"""Schedules as text: torch.distributed.pipelining's CSV action format to and from our plan IR.

Why: torchtitan takes a schedule as a file (`parallelism.pipeline_parallel_schedule_csv`, read by torch's
`_PipelineScheduleRuntime._load_csv`), and our schedules already are data, so the two can be exchanged. The format
(torch's `_Action` strings): one row per pipeline rank, one cell per action, `<stage><kind><microbatch>` with the
*global* (virtual) stage index, kinds F (forward), I (input-gradient backward, our B), W (weight gradient) and
B (full backward, our BW); `(<a>;<b>)OVERLAP_F_B` is two actions run together (DualPipe's F&B pair: here a then
b); empty cells are idle steps. Files with communication already lowered into them (SEND_F, RECV_F, SEND_B,
RECV_B) and FSDP's UNSHARD, RESHARD and REDUCE_GRAD are read too: those cells are left out, as our executor
derives messages from the plan and reduces gradients itself. Which rank holds a stage is read off the file and
must be one of our placements (Megatron's interleaved: stage % pp; or the V with two stages per rank).
A loaded plan is verified by the simulator (every F, B, W once and in order, streams in order, no deadlock);
a bad file is one `PlanError` line naming the file, the rank and the action (its cell as written). The text is
parsed here; reading and writing the file is the application's (training/schedule_file.py).
"""
from __future__ import annotations

import csv
import io
import re
from typing import Optional

from llamapipe.core.pipeline_parallel.schedule_ir import Action, Plan, rank_chunk_of, splits_backward
from llamapipe.core.pipeline_parallel.simulator import Costs, PlanError, Result, simulate

TO_TORCH = {"F": "F", "B": "I", "W": "W", "BW": "B"}
FROM_TORCH = {theirs: ours for ours, theirs in TO_TORCH.items()}
SKIPPED = ("SEND_F", "RECV_F", "SEND_B", "RECV_B", "UNSHARD", "RESHARD", "REDUCE_GRAD")
_CELL = re.compile(r"(\d+)(F|I|B|W|UNSHARD|RESHARD|REDUCE_GRAD|SEND_F|RECV_F|SEND_B|RECV_B)(\d*)")
_OVERLAP = re.compile(r"\((.*)\)OVERLAP_F_B")


def to_csv(plan: Plan) -> str:
    """`plan` in torch's compute-only CSV format: what `_PipelineScheduleRuntime._load_csv` reads."""
    if plan.vocab:
        raise ValueError(f"plan {plan.name} has vocabulary-parallel S/T actions, which torch's format cannot hold")
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    for rank, actions in enumerate(plan.actions):
        writer.writerow([f"{plan.stage_of(rank, a.chunk)}{TO_TORCH[a.kind]}{a.microbatch}" for a in actions])
    return out.getvalue()


def _parse_cell(text: str, where: str) -> list[tuple[int, str, int]]:
    """(stage, our kind, microbatch) of the compute actions in one cell; [] for an idle or communication cell."""
    text = text.strip()
    overlap = _OVERLAP.fullmatch(text)
    if overlap:
        return [item for part in overlap[1].split(";") for item in _parse_cell(part, where)]
    match = _CELL.fullmatch(text)
    if not text or (match and match[2] in SKIPPED):
        return []
    if not match or not match[3]:
        raise PlanError(f"{where} {text!r} is not an action: torch's format is <stage><F|I|B|W><microbatch>, "
                        "e.g. 2F0, or (a;b)OVERLAP_F_B")
    return [(int(match[1]), FROM_TORCH[match[2]], int(match[3]))]


def _placement(stage_rank: dict[int, int], pp: int, label: str) -> tuple[str, int]:
    """(placement, chunks per rank) that puts every stage on the rank the file runs it on."""
    num_stages = max(stage_rank) + 1
    missing = sorted(set(range(num_stages)) - set(stage_rank))
    if missing or num_stages % pp:
        raise PlanError(f"{label}: its stages are {sorted(stage_rank)}; a plan needs stages 0..{num_stages - 1} "
                        f"with the same number on each of its {pp} ranks")
    vpp = num_stages // pp
    for placement in ("interleaved", "v"):
        if placement == "v" and vpp != 2:
            continue
        if all(rank_chunk_of(stage, pp, placement)[0] == rank for stage, rank in stage_rank.items()):
            return placement, vpp
    stage, rank = next((s, r) for s, r in sorted(stage_rank.items()) if rank_chunk_of(s, pp, "interleaved")[0] != r)
    raise PlanError(f"{label}: rank {rank} runs stage {stage}, which fits neither Megatron's interleaved placement "
                    "(stage % ranks) nor the V placement (two stages per rank)")


def from_csv(text: str, *, name: str = "file", label: str = "schedule file") -> Plan:
    """The plan a torch CSV schedule describes, verified by the simulator; PlanError naming `label`, the rank and
    the action (as written in the file) for anything wrong with it."""
    rows = [row for row in csv.reader(io.StringIO(text))]
    while rows and not any(cell.strip() for cell in rows[-1]):
        rows.pop()
    if not rows:
        raise PlanError(f"{label}: no actions")
    parsed, cells, stage_rank = [], [], {}
    for rank, row in enumerate(rows):
        parsed.append([]), cells.append([])
        for col, cell in enumerate(row):
            for stage, kind, mb in _parse_cell(cell, f"{label}: rank {rank} action {col + 1}"):
                if stage_rank.setdefault(stage, rank) != rank:
                    raise PlanError(f"{label}: rank {rank} action {col + 1} {cell.strip()!r} runs stage {stage}, "
                                    f"which rank {stage_rank[stage]} runs too")
                parsed[rank].append((stage, kind, mb)), cells[rank].append(cell.strip())
    if not stage_rank:
        raise PlanError(f"{label}: no compute actions")
    pp = len(rows)
    placement, vpp = _placement(stage_rank, pp, label)
    m = 1 + max(mb for acts in parsed for _, _, mb in acts)
    actions = tuple(tuple(Action(kind, rank_chunk_of(stage, pp, placement)[1], mb) for stage, kind, mb in acts)
                    for acts in parsed)
    plan = Plan(name, pp, vpp, m, placement, actions)
    verify(plan, label, cells)
    return plan


def verify(plan: Plan, label: str, cells: Optional[list] = None, costs: Costs = Costs()) -> Result:
    """Simulate `plan` (order, streams, deadlock); a PlanError names `label` and, when `cells` gives the file's
    text of each action, the cells the simulator names."""
    try:
        return simulate(plan, costs)
    except PlanError as err:
        text = str(err)
        if cells is not None:
            text = re.sub(r"rank (\d+) action #(\d+) (\S+?):?(?= |$)",
                          lambda g: f"rank {g[1]} action {int(g[2]) + 1} {cells[int(g[1])][int(g[2])]!r}", text)
        raise PlanError(f"{label}: {text}") from None


def describe(plan: Plan, costs: Costs = Costs()) -> str:
    """One line on a loaded plan: its shape and what the simulator finds at `costs`."""
    result = simulate(plan, costs)
    split = "B/W split" if splits_backward(plan) else "fused backward"
    return (f"pp {plan.pp}, {plan.vpp} model chunk{'s' if plan.vpp > 1 else ''} per rank ({plan.placement} placement), "
            f"{plan.num_microbatches} microbatches, {split}; simulated at unit costs: bubble "
            f"{result.bubble_rate:.1%}, peak {max(result.peak_memory):g} microbatch-chunks of activations")


__all__ = ["to_csv", "from_csv", "verify", "describe"]

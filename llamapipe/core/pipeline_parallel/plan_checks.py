"""Static checks of a pipeline plan (`verify`): every action in range, F/B/W once each and in order on its
rank, offload and vocabulary passes in their places, each message stream consumed in the order it is produced,
and a Seq1F1B plan's piece order. The simulator runs only plans that pass (`simulator.simulate`).
"""
from __future__ import annotations

from llamapipe.core.pipeline_parallel.schedule_ir import (ALL, KIND_SPECS, KINDS, OFFLOAD_ORDER, OFFLOAD_PAIRS,
                                                          OFFLOAD_PASSES, PASSES, PRODUCER, VOCAB_PASSES, Action,
                                                          Plan, needs, sends, vocab_needs)


class PlanError(ValueError):
    """A plan is malformed, out of order, or deadlocks; the message names the rank and the action."""


def _check_ranges(plan: Plan) -> None:
    if len(plan.actions) != plan.pp:
        raise PlanError(f"plan has {len(plan.actions)} action lists for pp={plan.pp}")
    for rank, acts in enumerate(plan.actions):
        for i, a in enumerate(acts):
            if a.kind not in KINDS or not 0 <= a.chunk < plan.vpp or not 0 <= a.microbatch < plan.num_microbatches:
                raise PlanError(f"rank {rank} action #{i} {a}: kind, chunk or microbatch out of range "
                                f"(vpp={plan.vpp}, microbatches={plan.num_microbatches})")
            if a.kind in VOCAB_PASSES and (not plan.vocab or a.chunk):
                raise PlanError(f"rank {rank} action #{i} {a}: {a.kind} needs a vocabulary-parallel plan and chunk 0")


def _check_rank_order(plan: Plan, rank: int) -> None:
    """Each (chunk, mb) gets F, B, W once and in that order; same-rank stage hand-offs in order too."""
    done: dict[str, set] = {part: set() for part in PASSES}
    for i, a in enumerate(plan.actions[rank]):
        key, where = (a.chunk, a.microbatch), f"rank {rank} action #{i} {a}"
        for part in KIND_SPECS[a.kind].parts:
            if part not in done:
                continue          # S/T: _check_vocab_order
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
    if plan.vocab:
        _check_vocab_order(plan, rank)
    _check_offload_order(plan, rank)


def _check_offload_order(plan: Plan, rank: int) -> None:
    """Each offload kind once, after the pass it follows and before the one it precedes (`OFFLOAD_ORDER`: an O
    between F and B, its R between O and B, an OW between B and W, its RW between OW and W); every O has its R."""
    done: dict[str, set] = {part: set() for part in PASSES + OFFLOAD_PASSES}
    for i, a in enumerate(plan.actions[rank]):
        key, where = (a.chunk, a.microbatch), f"rank {rank} action #{i} {a}"
        if a.kind in OFFLOAD_PASSES:
            after, before = OFFLOAD_ORDER[a.kind]
            if key in done[a.kind]:
                raise PlanError(f"{where}: duplicated {a.kind} for chunk {a.chunk} microbatch {a.microbatch}")
            if key not in done[after] or key in done[before]:
                raise PlanError(f"{where}: {a.kind} must come after its {after} and before its {before}")
        for part in KIND_SPECS[a.kind].parts:
            if part in done:
                done[part].add(key)
    for out, back in OFFLOAD_PAIRS.items():
        missing = done[out] - done[back]
        if missing:
            chunk, mb = min(missing)
            raise PlanError(f"rank {rank}: {out} of chunk {chunk} microbatch {mb} has no {back} before its "
                            f"{OFFLOAD_ORDER[back][1]}")


def _check_vocab_order(plan: Plan, rank: int) -> None:
    """S then T once per microbatch, each after what it waits for when that runs on this same rank."""
    done: set = set()
    for i, a in enumerate(plan.actions[rank]):
        stage = plan.stage_of(rank, a.chunk)
        dep = vocab_needs(a.kind, stage, plan.num_stages)
        if dep is not None:
            local = dep.stage == ALL or plan.rank_chunk_of(dep.stage)[0] == rank
            chunk = 0 if dep.stage == ALL else plan.rank_chunk_of(dep.stage)[1]
            if local and (dep.part, chunk, a.microbatch) not in done:
                raise PlanError(f"rank {rank} action #{i} {a}: before its {dep.part} of microbatch {a.microbatch} "
                                f"on the same rank")
        for part in KIND_SPECS[a.kind].parts:
            if part in VOCAB_PASSES and (part, 0, a.microbatch) in done:
                raise PlanError(f"rank {rank} action #{i} {a}: duplicated {part} for microbatch {a.microbatch}")
            done.add((part, a.chunk, a.microbatch))
    for part in VOCAB_PASSES:
        for mb in range(plan.num_microbatches):
            if (part, 0, mb) not in done:
                raise PlanError(f"rank {rank}: missing {part} for microbatch {mb}")


def _check_collectives(plan: Plan) -> None:
    """Every rank runs its S (an all-gather) and its T (partials summed on the last stage) in one order:
    collectives are matched by order, so any other order would mix microbatches or hang."""
    for kind in VOCAB_PASSES:
        orders = [[a.microbatch for a in acts if a.kind == kind] for acts in plan.actions]
        for rank, order in enumerate(orders[1:], 1):
            if order != orders[0]:
                at = next(i for i, (x, y) in enumerate(zip(order, orders[0])) if x != y)
                raise PlanError(f"rank {rank} runs {kind} of microbatch {order[at]} as its {kind} #{at} but rank 0 "
                                f"runs microbatch {orders[0][at]}: collectives must run in one order on every rank")


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


def _check_piece_order(plan: Plan, rank: int) -> None:
    """Seq1F1B: on every stage piece i's F after piece i-1's F (it attends to that piece's cached keys) and
    piece i's B after piece i+1's B (that backward gives it the gradient of its keys and values)."""
    k, done = plan.seq_splits, {"F": set(), "B": set()}
    for i, a in enumerate(plan.actions[rank]):
        part = KIND_SPECS[a.kind].parts[0]
        if part not in done:
            continue
        piece = a.microbatch % k
        other = a.microbatch - 1 if part == "F" else a.microbatch + 1
        if (piece > 0 if part == "F" else piece < k - 1) and (a.chunk, other) not in done[part]:
            which = "previous" if part == "F" else "next"
            raise PlanError(f"rank {rank} action #{i} {a}: {part} of sequence piece {piece} before the {part} of "
                            f"its {which} piece (unit {other})")
        done[part].add((a.chunk, a.microbatch))


def verify(plan: Plan) -> None:
    """Static checks: ranges, F/B/W exactly once and in order, per-stream message order, and a Seq1F1B plan's
    piece order."""
    _check_ranges(plan)
    for rank in range(plan.pp):
        _check_rank_order(plan, rank)
        if plan.seq_splits > 1:
            _check_piece_order(plan, rank)
    _check_streams(plan)
    if plan.vocab:
        _check_collectives(plan)

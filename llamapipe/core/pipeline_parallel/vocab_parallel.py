"""Vocabulary parallelism over the pipeline as a plan transform (Yeung et al., arXiv 2411.05288).

Why: the last stage holds the output layer and its softmax cross-entropy (and the first the embedding), so it
does more work and holds more memory than the others, and every zero-bubble schedule waits for it. Splitting
the output layer by vocabulary over all pipeline ranks turns it into two passes per microbatch on every rank:
S (this rank's logits shard, its max, sum of exponentials and target logit) and T (softmax gradient, the
partial input gradient for the last stage and the shard's weight gradient). The softmax statistics of all
ranks' S are the only synchronisation (`schedule_ir.vocab_needs`).

`with_vocab_parallel(plan, costs)` inserts S/T into any schedule's plan, so every schedule gets the feature
without a builder of its own: it replays the plan under `costs` and puts each rank's next S or T wherever
that rank would otherwise wait (its next action's input has not arrived) or as soon as their inputs are
there, in one microbatch order on every rank, as the paper's Vocab-1 schedule places them in 1F1B.
"""
from __future__ import annotations

import dataclasses
from typing import Optional

from llamapipe.core.pipeline_parallel.schedule_ir import Action, Plan
from llamapipe.core.pipeline_parallel.simulator import Costs, PlanError, advance, arrival

# The output layer's forward and backward relative to one chunk's F when nothing was measured: about one
# decoder layer's worth for a LLaMA-sized vocabulary, backward twice the forward (two GEMMs).
DEFAULT_COSTS = Costs(head_f=1.0, head_b=2.0, head_mem=1.0)


def vocab_costs(costs: Optional[Costs]) -> Costs:
    """`costs` with the default output-layer share when they carry none (e.g. unit costs)."""
    if costs is None:
        return DEFAULT_COSTS
    if costs.head_f or costs.head_b:
        return costs
    return dataclasses.replace(costs, head_f=DEFAULT_COSTS.head_f * costs.f, head_b=DEFAULT_COSTS.head_b * costs.f)


def _next_vocab(plan: Plan, done_s: int, done_t: int) -> list[Action]:
    """This rank's candidate vocabulary actions: its next T (frees logits, unblocks the last stage) first."""
    out = [Action("T", 0, done_t)] if done_t < done_s else []
    return out + ([Action("S", 0, done_s)] if done_s < plan.num_microbatches else [])


def _candidate(plan: Plan, costs: Costs, rank: int, queue: tuple, pos: int, counts: list, clock: float,
               sent: dict) -> Optional[tuple]:
    """(start, order, action) of what `rank` would run next, or None while nothing has its inputs. A vocabulary
    action goes first when it can start as early as the schedule's own next action: S and T of a microbatch
    wait for every rank, so one rank that puts them off stalls the last stage (measured in the simulator:
    1F1B at p = 8, m = 16 takes 138 time units that way against 98 this way)."""
    best = None
    options = [(queue[pos], 1)] if pos < len(queue) else []
    options += [(a, 0) for a in _next_vocab(plan, *counts)]
    for action, order in options:
        ready = arrival(plan, rank, action, costs, sent)
        if ready is not None and (best is None or (max(clock, ready), order) < best[:2]):
            best = (max(clock, ready), order, action)
    return best


def with_vocab_parallel(plan: Plan, costs: Optional[Costs] = None, *, early_send: bool = True) -> Plan:
    """`plan` with S and T of every microbatch on every rank, placed where the rank would idle under `costs`
    (default: `DEFAULT_COSTS`), or as soon as they can start: ties go to T, then S, then the schedule's action."""
    assert not plan.vocab, "the plan already has its vocabulary actions"
    costs = vocab_costs(costs)
    target = dataclasses.replace(plan, vocab=True)
    pos, counts = [0] * plan.pp, [[0, 0] for _ in range(plan.pp)]
    clock, sent = [0.0] * plan.pp, {}
    out: list[list[Action]] = [[] for _ in range(plan.pp)]
    total = sum(len(acts) for acts in plan.actions) + 2 * plan.pp * plan.num_microbatches
    while sum(map(len, out)) < total:
        picks = [(c, rank) for rank in range(plan.pp)
                 for c in [_candidate(target, costs, rank, plan.actions[rank], pos[rank], counts[rank],
                                      clock[rank], sent)] if c is not None]
        if not picks:
            raise PlanError(f"{plan.name}: the vocabulary actions cannot be placed without a deadlock")
        (start, _, action), rank = min(picks, key=lambda p: (p[0][:2], p[1]))
        clock[rank] = advance(target, costs, rank, action, start, sent, early_send)
        out[rank].append(action)
        if action.kind in ("S", "T"):
            counts[rank]["ST".index(action.kind)] += 1
        else:
            pos[rank] += 1
    return dataclasses.replace(target, actions=tuple(map(tuple, out)))

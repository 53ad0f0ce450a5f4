"""Seq1F1B plans (arXiv 2406.03488; the zero-bubble fork's scheduler/seq1f1b.py): every microbatch split into
K sequence pieces (core/pipeline_parallel/seq_split.py) that are the plan's units, unit u = piece u % K of
microbatch u // K. Forwards run the units in order; backwards run each sequence's pieces in reverse (piece i's
backward gives the key/value gradients of pieces 0..i-1), so the backward stream is `backward_order`.

1F1B (the fork's order): rank r warms up with pp - r - 2 + K pieces (the last stage holds K - 1 more pieces than
1F1B's one so the sequence's last piece has run its forward before the first backward, which is that piece's),
then F/BW pairs, then the remaining BWs. ZB-H1: the same with one more warmup piece (ZB-H1's B-then-F steady
state), B and W split and rank r's W's r units behind its B's (arXiv 2401.10241). Interleaved and ZB-V come from
their own builders for m*K units with the backward units relabelled by `backward_order` and the forwards a
relabelled backward needs pulled ahead of it (`relabelled`), kept only when the simulator finds no deadlock.
"""
from __future__ import annotations

import dataclasses

from llamapipe.core.config import ConfigError
from llamapipe.core.pipeline_parallel.schedule_ir import Action, Plan

SEQ_SCHEDULES = ("1f1b", "zb-h1", "interleaved", "zbv")


def backward_order(n: int, k: int) -> list[int]:
    """The units in the order their backwards run: each sequence's K pieces reversed, sequences in order."""
    return [(u // k) * k + k - 1 - u % k for u in range(n)]


def seq_1f1b(pp: int, m: int, k: int) -> Plan:
    n, order = m * k, backward_order(m * k, k)
    actions = []
    for rank in range(pp):
        warmup = min(pp - rank - 2 + k, n)
        acts = [Action("F", 0, u) for u in range(warmup)]
        for i in range(n - warmup):
            acts += [Action("F", 0, warmup + i), Action("BW", 0, order[i])]
        acts += [Action("BW", 0, order[i]) for i in range(n - warmup, n)]
        actions.append(tuple(acts))
    return Plan("1f1b", pp, 1, n, "interleaved", tuple(actions), seq_splits=k)


def seq_zb_h1(pp: int, m: int, k: int) -> Plan:
    n, order = m * k, backward_order(m * k, k)
    actions = []
    for rank in range(pp):
        next_f = min(pp - rank - 1 + k, n)
        acts = [Action("F", 0, u) for u in range(next_f)]
        for i in range(n):
            acts.append(Action("B", 0, order[i]))
            if i >= rank:
                acts.append(Action("W", 0, order[i - rank]))
            if next_f < n:
                acts.append(Action("F", 0, next_f))
                next_f += 1
        acts += [Action("W", 0, order[i]) for i in range(max(n - rank, 0), n)]
        actions.append(tuple(acts))
    return Plan("zb-h1", pp, 1, n, "interleaved", tuple(actions), seq_splits=k)


def relabelled(plan: Plan, k: int) -> Plan:
    """`plan` (built for m*K units) with every backward pass's unit relabelled so that, per chunk, the
    backwards run each sequence's pieces in reverse; forwards stay in unit order."""
    order = backward_order(plan.num_microbatches, k)
    actions = tuple(_forwards_first(tuple(a if a.kind == "F" else a._replace(microbatch=order[a.microbatch])
                                          for a in acts)) for acts in plan.actions)
    return dataclasses.replace(plan, actions=actions, seq_splits=k)


def _forwards_first(acts: tuple) -> tuple:
    """`acts` with every forward that a backward needs on its own chunk moved to just before it (together with
    that chunk's earlier forwards, which keep their order): a relabelled backward may be a later piece's."""
    out, done, moved = [], set(), set()
    for i, a in enumerate(acts):
        if a in moved:
            continue
        if a.kind != "F" and (a.chunk, a.microbatch) not in done:
            for f in acts[i + 1:]:
                if f.kind == "F" and f.chunk == a.chunk and f not in moved and (f.chunk, f.microbatch) not in done:
                    out.append(f)
                    moved.add(f)
                    done.add((f.chunk, f.microbatch))
                    if f.microbatch == a.microbatch:
                        break
        if a.kind == "F":
            done.add((a.chunk, a.microbatch))
        out.append(a)
    return tuple(out)


def no_pipelining(m: int, k: int) -> Plan:
    """One rank: each microbatch's pieces forward in order, then their fused backwards in reverse."""
    acts = []
    for mb in range(m):
        acts += [Action("F", 0, mb * k + i) for i in range(k)]
        acts += [Action("BW", 0, mb * k + i) for i in reversed(range(k))]
    return Plan("no-pipelining", 1, 1, m * k, "interleaved", (tuple(acts),), seq_splits=k)


def build_seq(schedule: str, pp: int, vpp: int, m: int, k: int) -> Plan:
    """The Seq1F1B plan of --pipeline-schedule `schedule` with K = `k` pieces per microbatch."""
    from llamapipe.core.pipeline_parallel import builders, simulator
    if pp == 1:
        return no_pipelining(m, k)
    if schedule == "1f1b":
        return seq_1f1b(pp, m, k)
    if schedule == "zb-h1":
        return seq_zb_h1(pp, m, k)
    if schedule in ("interleaved", "zbv"):
        base = builders.interleaved(pp, vpp, m * k) if schedule == "interleaved" else builders.zbv(pp, m * k)
        plan = relabelled(base, k)
        try:
            simulator.simulate(plan)
        except simulator.PlanError as error:
            raise ConfigError(f"--num-seq-splits {k} with --pipeline-schedule {schedule} at pp {pp} and {m} "
                              f"microbatches gives no valid order ({error})", "num_seq_splits") from None
        return plan
    raise ConfigError(f"--num-seq-splits {k} needs --pipeline-schedule one of {', '.join(SEQ_SCHEDULES)}, "
                      f"got {schedule}", "num_seq_splits")

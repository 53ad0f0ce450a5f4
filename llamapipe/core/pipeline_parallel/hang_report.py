"""A hang explained: from every rank's position (`position.RankPosition.snapshot`), the rank that stopped first and
the chain of waits that follows from it, as one paragraph a person can act on.

Each rank either waits on peers (a message from one pipeline neighbour, its CP ring neighbours, or a collective
whose other members have not joined it) or waits on nobody: it stopped by itself (inside an action, between two,
or before a collective). Edges go from a waiting rank to the ranks it waits on; a collective waits only on the
members that are not in the same collective of the same iteration. The rank that stopped first is at the end
of the chain: one that waits on nobody (the one idle longest when several do; a rank that sent no position at
all counts as stopped, it is gone or frozen). When every rank waits on another, the waits form a cycle: the plan's
messages do not match (a deadlock), and the report names the cycle. Pure Python, no I/O: the watchdog
(training/hang_watch.py) gathers the positions and writes what this returns.
"""
from __future__ import annotations

from typing import Optional

AXES = ("pp", "dp", "cp", "tp")


def where(pos: dict) -> str:
    """`rank 1 (pp 1)`: the rank and its coordinates on the axes the job has."""
    coords = [f"{axis} {pos['coords'][axis]}" for axis in AXES if axis in pos.get("coords", {})]
    return f"rank {pos['rank']}" + (f" ({', '.join(coords)})" if coords else "")


def _same_collective(other: Optional[dict], wait: dict, iteration: int) -> bool:
    return (other is not None and other.get("wait") is not None and other["wait"].get("collective", False)
            and other["wait"]["what"] == wait["what"] and other["iteration"] == iteration)


def waits_on(pos: dict, by_rank: dict[int, dict]) -> list[int]:
    """The ranks `pos` waits on now (empty: it waits on nobody)."""
    wait = pos.get("wait")
    if not wait:
        return []
    peers = [p for p in wait["peers"] if p != pos["rank"]]
    if wait.get("collective"):
        return [p for p in peers if not _same_collective(by_rank.get(p), wait, pos["iteration"])]
    return peers


def _stopped_first(positions: dict[int, dict], missing: list[int], edges: dict[int, list[int]]) -> Optional[int]:
    """The rank at the end of the waits: reachable from the waiting ranks, waiting on nobody, idle longest."""
    reached, todo = set(), [r for r in edges if edges[r]]
    while todo:
        rank = todo.pop()
        for peer in edges.get(rank, ()):
            if peer not in reached:
                reached.add(peer)
                todo.append(peer)
    ends = [r for r in missing if r in reached or not positions]
    if ends:                             # a rank waited on that sent nothing: gone or frozen
        return min(ends)
    candidates = [r for r, p in positions.items() if not edges[r]]
    preferred = [r for r in candidates if r in reached] or candidates
    if not preferred:
        return None
    return max(preferred, key=lambda r: (positions[r]["idle_s"], -r))


def _cycle(edges: dict[int, list[int]]) -> list[int]:
    """A cycle of waits (every rank waits on another): follow the first edge from the lowest rank."""
    seen: list[int] = []
    rank = min(edges)
    while rank not in seen:
        seen.append(rank)
        rank = edges[rank][0]
    return seen[seen.index(rank):]


def _chain(root: int, edges: dict[int, list[int]]) -> list[int]:
    """Every rank that waits on `root`, directly or through others, nearest first."""
    order, frontier = [root], [root]
    while frontier:
        nxt = sorted(r for r, peers in edges.items() if r not in order and any(p in frontier for p in peers))
        order += nxt
        frontier = nxt
    return order[1:]


def _stopped_sentence(pos: dict) -> str:
    last = f" (last done: {pos['last_done']})" if pos.get("last_done") else ""
    if pos.get("current"):
        place = f"in {pos['current']}{last}"
    elif pos.get("wait") and pos["wait"].get("collective"):
        place = f"in {pos['wait']['what']}"
    elif pos["phase"] == "forward-backward":
        place = f"between two actions{last}"
    else:
        place = f"{pos['phase']}{last}"
    return f"{where(pos)} stopped {place} and made no progress for {_seconds(pos['idle_s'])}"


def _seconds(s: float) -> str:
    return f"{s:.0f} s" if s >= 10 else f"{s:.1f} s"


def _wait_sentence(pos: dict, peers: list[int]) -> str:
    wait, names = pos["wait"], " and ".join(f"rank {p}" for p in peers)
    inside = f" in {pos['current']}" if pos.get("current") else ""
    if wait.get("collective"):
        return f"{where(pos)} waits in {wait['what']} for {names}, which did not join it"
    return f"{where(pos)} waits{inside} for {names}'s {wait['what']}"


def explain(positions: list[dict], world_size: int) -> dict:
    """The report: `paragraph` (one paragraph), `stopped` (the rank that stopped first, None for a cycle),
    `chain` (the ranks waiting on it, nearest first), `cycle`, `missing` (ranks that sent no position)."""
    by_rank = {p["rank"]: p for p in positions}
    missing = [r for r in range(world_size) if r not in by_rank]
    edges = {r: waits_on(p, by_rank) for r, p in by_rank.items()}
    iteration = max((p["iteration"] for p in positions), default=0)
    root = _stopped_first(by_rank, missing, edges)
    head = f"hang at iteration {iteration}: "
    if root is None:
        cycle = _cycle(edges)
        parts = [_wait_sentence(by_rank[r], edges[r]) for r in cycle]
        text = (head + "the ranks wait on each other in a cycle (their messages do not match: a deadlock of the "
                "plan, or ranks running different plans): " + "; ".join(parts) + ".")
        return {"paragraph": text, "stopped": None, "chain": cycle, "cycle": cycle, "missing": missing}
    if root in missing:
        first = f"rank {root} sent no position (its process is gone, or frozen so hard its watchdog cannot run)"
    else:
        first = _stopped_sentence(by_rank[root])
    chain = _chain(root, {r: e for r, e in edges.items()} | {m: [] for m in missing})
    parts = [first] + [_wait_sentence(by_rank[r], edges[r]) for r in chain if r in by_rank]
    idle = [r for r in by_rank if r != root and r not in chain]
    if idle:
        parts.append("not waiting on it: " + ", ".join(_stopped_sentence(by_rank[r]) for r in idle))
    elapsed = max((p["step_elapsed_s"] for p in positions), default=0.0)
    text = (head + "; ".join(parts) + f". The step had run {_seconds(elapsed)}. Look at rank {root} first: its log, "
            f"and its stack (py-spy dump of its process).")
    return {"paragraph": text, "stopped": root, "chain": chain, "cycle": None, "missing": missing}

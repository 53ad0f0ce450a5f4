"""Where each case's time goes, for benchmarks/bench_peers.py --timers (issue 48: "where a peer is faster, say where
its time goes").

Ours: `--timing-log-level 2 --timing-log-option all` prints, every iteration, a block of per-rank timers
(llamapipe/training/timers_log.py): forward-compute, backward-compute, backward-weight-compute, the recv timers,
and each rank's compute / communication / idle split. `parse_blocks` reads them from the run's output and
`per_rank` averages the timed iterations (after the warm-up). `auto_choice` keeps the lines where `auto` says what
it chose (layout and plan).

Peers: the worker records each rank's main-thread CPU seconds per iteration (`time.thread_time`; gloo waits block,
so they do not count): busy = CPU / wall, the rest is waiting, for a message or a core.
"""
from __future__ import annotations

import re
import statistics

_HEAD = "times across ranks (ms):"
_LINE = re.compile(r"^\s+([a-z0-9-]+) \.+: (.*)$")
_RANK = re.compile(r"rank (\d+): ([0-9.]+)")
FLAGS = ["--timing-log-level", "2", "--timing-log-option", "all"]
SHOWN = ("forward-compute", "backward-compute", "backward-weight-compute", "compute", "communication", "idle")


def parse_blocks(output: str) -> list[dict[str, list[float]]]:
    """Every timer block in `output`, in order: {timer name: [ms of rank 0, rank 1, ...]}."""
    blocks, current = [], None
    for line in output.splitlines():
        if line.rstrip().endswith(_HEAD):
            current = {}
            blocks.append(current)
            continue
        got = _LINE.match(line) if current is not None else None
        if got:
            current[got.group(1)] = [float(v) for _, v in sorted(_RANK.findall(got.group(2)),
                                                                  key=lambda rv: int(rv[0]))]
        elif current is not None and line.strip() and not line.startswith(" "):
            current = None
    return blocks


def per_rank(blocks: list[dict], warmup: int) -> list[dict[str, float]]:
    """The mean over the blocks after the first `warmup` of each timer, per rank: [{name: ms}, ...]."""
    timed = blocks[warmup:]
    if not timed:
        return []
    ranks = len(next(iter(timed[0].values())))
    return [{name: statistics.fmean(b[name][r] for b in timed if name in b) for name in timed[0]}
            for r in range(ranks)]


def auto_choice(output: str) -> list[str]:
    """The lines where `auto` reports its layout and its plan, without the log's timestamp."""
    keys = ("layout auto chose", "auto schedule:")
    return [re.sub(r"^\[[^]]*\]\s*", "", ln).strip() for ln in output.splitlines() if any(k in ln for k in keys)]


def busy_share(cpu_s: list[float], iter_s: list[float], warmup: int) -> float:
    """Main-thread CPU seconds over wall seconds of the timed iterations."""
    return sum(cpu_s[warmup:]) / max(sum(iter_s[warmup:]), 1e-12)


def breakdown_table(rows: list[dict]) -> str:
    """One line per case and rank: ours' timers (ms per iteration), a peer's busy share."""
    lines = ["| V | case | rank | iteration ms | F | B | W | compute | communication | idle | "
             "ours: compute share; peers: CPU / wall |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        for rank, t in enumerate(r.get("timers", [])):
            total = t["compute"] + t["communication"] + t["idle"]
            cells = " | ".join(f"{t.get(n, 0.0):,.0f}" for n in SHOWN)
            lines.append(f"| {r['vocab']} | {r['case']} | {rank} | {total:,.0f} | {cells} | "
                         f"{t['compute'] / max(total, 1e-12):.0%} |")
        for rank, share in enumerate(r.get("busy", [])):
            lines.append(f"| {r['vocab']} | {r['case']} | {rank} | {1e3 * r['iter_s']:,.0f} | | | | | | | "
                         f"{share:.0%} |")
    return "\n".join(lines)

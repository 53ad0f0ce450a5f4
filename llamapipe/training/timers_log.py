"""--timing-log-level and --timing-log-option: the per-rank timers reported every --log-interval.

Every rank keeps its own `core/pipeline_parallel/step_timers.StepTimers` sums; at the end of a logging interval
all ranks gather them (one all-gather of a few floats per interval, no barrier in the step) and global rank 0
writes:

- in the iteration's console line, JSONL record and TensorBoard: the measured bubble (idle share of the
  iterations) of the worst rank and the mean, and per pipeline rank (`bubble_pp<r>`, the worst of its replicas);
  JSONL also gets every rank's compute / communication / idle milliseconds per iteration under "timers";
- a Megatron-style block, `(min, max) time across ranks (ms):` with one dotted line per timer (averaged per
  iteration over the interval), as `--timing-log-option` says (max, minmax or all); level 1 has
  forward-backward, optimizer and the rank split, level 2 adds the per-phase timers.

Under --log-straggler the same gather (each rank adds its plan's expected cost) feeds `training/straggler.py`;
at --timing-log-level 0 the timers then run at level 1 for it alone, and neither the block nor the bubble is
reported.
"""
from __future__ import annotations

from typing import Optional

from llamapipe.core.logger import get_logger
from llamapipe.core.parallel_state import ParallelState, RankGrid
from llamapipe.core.pipeline_parallel.step_timers import SPLIT, StepTimers, bubble, gather_intervals
from llamapipe.training.straggler import StragglerDetector

log = get_logger()


def build_timers(level: int, straggler: bool = False, device: str = "cpu") -> Optional[StepTimers]:
    """The job's timers for --timing-log-level `level` (None at 0 without --log-straggler: nothing is timed,
    nothing costs); for the straggler on CPU ranks the actions are timed in CPU time too."""
    if level == 0 and not straggler:
        return None
    return StepTimers(max(level, 1), cpu_clock=straggler and device == "cpu")


class TimersLog:
    """Gathers the ranks' interval sums and turns them into record fields and the console block."""

    def __init__(self, timers: StepTimers, ps: ParallelState, option: str = "minmax", *, report: bool = True,
                 straggler: Optional[StragglerDetector] = None, expected: float = 0.0) -> None:
        self.timers, self.ps, self.option = timers, ps, option
        self.report, self.straggler, self.expected = report, straggler, expected
        self.reports: list[dict] = []        # what each interval gave, for the end-of-run line

    def interval_fields(self) -> dict:
        """Collective over the world: the record fields of the interval that ends now (rank 0 logs the block)."""
        ranks = gather_intervals(dict(self.timers.interval(), expected=self.expected))
        if not ranks or ranks[0]["iterations"] == 0:
            return {}
        fields = self.straggler.fields(ranks) if self.straggler is not None else {}
        return {**self._timer_fields(ranks), **fields} if self.report else fields

    def _timer_fields(self, ranks: list[dict]) -> dict:
        """The bubble fields and the per-rank split (rank 0 logs the block)."""
        bubbles = [bubble(r) for r in ranks]
        worst = max(range(len(ranks)), key=lambda r: bubbles[r])
        fields = {"bubble_max": bubbles[worst], "bubble_mean": sum(bubbles) / len(bubbles),
                  "bubble_max_rank": worst}
        for rank, pp_rank in enumerate(self._pp_ranks(len(ranks))):
            key = f"bubble_pp{pp_rank}"
            fields[key] = max(fields.get(key, 0.0), bubbles[rank])
        fields["timers"] = {f"rank{r}": {k: 1e3 * v[k] / v["iterations"] for k in ("iteration", *SPLIT)}
                            for r, v in enumerate(ranks)}
        self.reports.append(fields)
        if self.ps.rank == 0:
            log.info(self.block(ranks))
        return fields

    def _pp_ranks(self, world: int) -> list[int]:
        """The pipeline rank of every global rank (from the job's rank grid)."""
        return [coords["pp"] for coords in rank_coords(self.ps, world)]


    def block(self, ranks: list[dict]) -> str:
        """Megatron's timer block over the ranks' per-iteration milliseconds, then the rank split."""
        per_iter = [{n: 1e3 * r[n] / r["iterations"] for n in self.timers.names} for r in ranks]
        names = [n for n in self.timers.names if n != "iteration" and any(r[n] for r in per_iter)]
        head = {"max": "max time across ranks (ms):", "minmax": "(min, max) time across ranks (ms):",
                "all": "times across ranks (ms):"}[self.option]
        lines = [head]
        for name in names:
            values = [r[name] for r in per_iter]
            dots = "." * max(48 - len(name), 3)
            if self.option == "max":
                lines.append(f"    {name} {dots}: {max(values):.2f}")
            elif self.option == "minmax":
                lines.append(f"    {name} {dots}: ({min(values):.2f}, {max(values):.2f})")
            else:
                lines.append(f"    {name} {dots}: " + ", ".join(f"rank {i}: {v:.2f}" for i, v in enumerate(values)))
        lines.append("per-rank time per iteration (ms): " + "; ".join(
            f"rank {i}: compute {r['compute']:.1f}, communication {r['communication']:.1f}, idle {r['idle']:.1f} "
            f"(bubble {100 * r['idle'] / r['iteration'] if r['iteration'] else 0.0:.1f}%)"
            for i, r in enumerate(per_iter)))
        return "\n".join(lines)

    def summary(self) -> Optional[str]:
        """The run's measured bubble over its logged intervals (None when nothing was logged)."""
        if not self.reports:
            return None
        worst = max(r["bubble_max"] for r in self.reports)
        mean = sum(r["bubble_max"] for r in self.reports) / len(self.reports)
        return (f"measured pipeline bubble: worst rank {100 * mean:.1f}% of the iteration on average over "
                f"{len(self.reports)} logging intervals (highest {100 * worst:.1f}%)")


def rank_coords(ps: ParallelState, world: int) -> list[dict[str, int]]:
    """Every global rank's coordinates on the job's rank grid."""
    others = {axis: n for axis, n in ps.sizes.items() if axis not in ("tp", "pp", "dp")}
    grid = RankGrid(world, ps.tp_size, ps.pp_size, ps.order, **others)
    return [grid.coords(r) for r in range(world)]


def replica_keys(ps: ParallelState, world: int) -> list[tuple]:
    """Per global rank, its coordinates but the data-parallel one: equal for the replicas of one stage."""
    return [tuple(sorted((k, v) for k, v in c.items() if k != "dp")) for c in rank_coords(ps, world)]

"""Draw a simulated pipeline timeline: ASCII for terminals and logs, PNG/SVG with matplotlib, and a
per-rank table of where the time goes.

Why: a schedule is easiest to judge by eye, in the style of the figures of the Megatron interleaving
paper (arXiv 2104.04473) and the zero-bubble paper (arXiv 2401.10241): one row per pipeline rank,
F/B/W in distinct colours, darker for later model chunks, microbatch number in each box.

Several iterations (`simulator_iterations`) are drawn on one time axis, so with optimizer post-validation
the next iteration's ramp visibly fills the last one's tail: in ASCII odd iterations are lower case, in
the picture they are hatched, and optimizer steps are gold boxes.

Two bubble figures are shown, each named, because they answer different questions: the share of the
picture that is idle (idle rank-time / (ranks x makespan), ramps at both ends included) is what a user
sees and pays; the zero-bubble paper's bubble rate ((span - busy) / span of the longest stage) is what
its tables report and leaves the ramps out.
"""
from __future__ import annotations

import math

from llamapipe.core.pipeline_parallel.schedule_ir import Plan
from llamapipe.core.pipeline_parallel.simulator import Result
from llamapipe.core.pipeline_parallel.simulator_iterations import IterationsResult

# light to dark per chunk: F blue, B green, W orange, BW teal (B and W fused)
_COLOURS = {
    "F": ("#9ecae1", "#4292c6", "#2171b5", "#08519c"),
    "B": ("#a1d99b", "#41ab5d", "#238b45", "#006d2c"),
    "W": ("#fdd0a2", "#fd8d3c", "#e6550d", "#a63603"),
    "BW": ("#99d8c9", "#41ae76", "#238b45", "#005824"),
}
_OPTIMIZER = "#fec44f"


def ascii_timeline(plan: Plan, result: Result, iteration_of: list[list[int]] | None = None) -> str:
    """One line per rank; the time slot is the shortest action, idle slots are '.', an action's
    later slots are '='. Labels are the IR's: kind, microbatch, then 'c<chunk>' for chunks > 0; with
    `iteration_of` (from `simulate_iterations`), lower case in odd iterations."""
    rows = [row for row in result.timeline]
    durations = [e - s for row in rows for s, e, _ in row if e > s]
    if not durations:
        return "\n".join(f"rank {r}: (empty)" for r in range(plan.pp))
    slot = min(durations)
    width = max(len(str(a)) for row in rows for _, _, a in row) + 1
    n_slots = math.ceil(result.makespan / slot - 1e-9)
    lines = []
    for rank, row in enumerate(rows):
        cells = ["." * (width - 1) + " "] * n_slots
        for i, (start, end, action) in enumerate(row):
            first = round(start / slot)
            last = max(first + 1, round(end / slot))
            odd = iteration_of is not None and iteration_of[rank][i] % 2
            cells[first] = (str(action).lower() if odd else str(action)).ljust(width)
            for i in range(first + 1, min(last, n_slots)):
                cells[i] = "=" * (width - 1) + " "
        lines.append(f"rank {rank}: " + "".join(cells).rstrip())
    return "\n".join(lines)


def bubble_text(result: Result) -> str:
    """Both bubble figures, named, for titles and reports."""
    return (f"idle in picture {100 * result.makespan_bubble_rate:.1f}% (idle rank-time / (ranks x makespan)); "
            f"paper's bubble rate {100 * result.bubble_rate:.1f}% (per stage: (span - busy) / span)")


def iterations_text(iters: IterationsResult) -> str:
    """The steady-state time per iteration and how it was measured, for reports."""
    mode = "post-validation (each rank steps and goes on alone)" if iters.post_validation else \
        "synchronous optimizer step (barrier after every iteration)"
    ends = ", ".join(f"{end:.2f}" for end in iters.iteration_end)
    how = "(end of last - end of first) / (iterations - 1)" if iters.iterations > 1 else "one iteration"
    return (f"{iters.iterations} iterations, {mode}: time per iteration {iters.time_per_iteration:.2f} "
            f"({how}); iterations end at {ends}")


def rank_table(plan: Plan, result: Result) -> str:
    """Per rank: busy + idle in span = span, span + idle at the ends = makespan; the last row sums the
    ranks, so its idle columns over ranks x makespan give the picture's idle share."""
    header = (f"{'rank':>5} {'busy':>8} {'+ idle in span':>15} {'= span':>8} {'+ idle at ends':>15} "
              f"{'= makespan':>11} {'peak mem':>9}")
    lines = [header]
    inside = [s - b for s, b in zip(result.span, result.busy)]
    ends = [result.makespan - s for s in result.span]
    for r in range(plan.pp):
        lines.append(f"{r:>5} {result.busy[r]:>8.2f} {inside[r]:>15.2f} {result.span[r]:>8.2f} {ends[r]:>15.2f} "
                     f"{result.makespan:>11.2f} {result.peak_memory[r]:>9.2f}")
    lines.append(f"{'all':>5} {sum(result.busy):>8.2f} {sum(inside):>15.2f} {sum(result.span):>8.2f} "
                 f"{sum(ends):>15.2f} {plan.pp * result.makespan:>11.2f}")
    return "\n".join(lines)


def _draw_optimizer_steps(ax, iterations: IterationsResult) -> float:
    """Gold boxes for the optimizer steps of positive length; returns the last one's end."""
    last = 0.0
    for rank, steps in enumerate(iterations.optimizer):
        for start, end, _ in steps:
            if end > start:
                ax.broken_barh([(start, end - start)], (rank - 0.4, 0.8), facecolors=_OPTIMIZER,
                               edgecolors="black", linewidth=0.4)
            last = max(last, end)
    return last


def plot_timeline(plan: Plan, result: Result, path: str, title: str | None = None,
                  iterations: IterationsResult | None = None) -> None:
    """Write the timeline to `path` (format from the suffix, e.g. .png or .svg); with `iterations`
    (whose `result` is `result`), odd iterations hatched and the optimizer steps drawn."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    makespan = max(result.makespan, 1e-9)
    shortest = min((e - s for row in result.timeline for s, e, _ in row if e > s), default=makespan)
    fig_w = min(max(6.0, 0.25 * makespan / shortest + 2.0), 18.0)   # about a quarter inch per short box
    fig, ax = plt.subplots(figsize=(fig_w, 0.45 * plan.pp + 1.1), dpi=100)
    box_points = 72 * 0.8 * fig_w * shortest / makespan   # axes take about 80% of the figure width
    font = max(4.0, min(8.0, 0.45 * box_points))
    for rank, row in enumerate(result.timeline):
        for i, (start, end, a) in enumerate(row):
            colour = _COLOURS[a.kind][min(a.chunk, 3)]
            odd = iterations is not None and iterations.iteration_of[rank][i] % 2
            ax.broken_barh([(start, end - start)], (rank - 0.4, 0.8), facecolors=colour,
                           edgecolors="black", linewidth=0.4, hatch="///" if odd else None)
            ax.text((start + end) / 2, rank, str(a.microbatch), ha="center", va="center", fontsize=font,
                    color="white" if a.chunk else "black")
    if iterations is not None:
        makespan = max(makespan, _draw_optimizer_steps(ax, iterations))
    ax.set_xlim(0, makespan)
    ax.set_ylim(plan.pp - 0.5, -0.5)
    ax.set_yticks(range(plan.pp), [f"rank {r}" for r in range(plan.pp)], fontsize=8)
    ax.set_xlabel("time", fontsize=8)
    ax.tick_params(axis="x", labelsize=7)
    kinds = sorted({a.kind for row in plan.actions for a in row}, key=["F", "B", "W", "BW"].index)
    handles = [Patch(facecolor=_COLOURS[k][c], edgecolor="black", label=f"{k} chunk {c}" if plan.vpp > 1 else k)
               for k in kinds for c in range(min(plan.vpp, 4))]
    if iterations is not None:
        handles += [Patch(facecolor="white", edgecolor="black", hatch="///", label="odd iteration"),
                    Patch(facecolor=_OPTIMIZER, edgecolor="black", label="optimizer step")]
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=7, frameon=False)
    text = bubble_text(result) if iterations is None else iterations_text(iterations)
    ax.set_title(title or f"{plan.name}: pp={plan.pp} vpp={plan.vpp} microbatches={plan.num_microbatches}\n"
                 f"{text}", fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)

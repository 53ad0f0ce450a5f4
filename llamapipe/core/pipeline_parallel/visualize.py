"""Draw a simulated pipeline timeline: ASCII for terminals and logs, a matplotlib figure (plot-schedule writes
it as PNG/SVG), and a per-rank table of where the time goes.

Why: a schedule is easiest to judge by eye, in the style of the figures of the Megatron interleaving
paper (arXiv 2104.04473) and the zero-bubble paper (arXiv 2401.10241): one row per pipeline rank,
F/B/W in distinct colours, darker for later model chunks, microbatch number in each box; the vocabulary-
parallel output layer's S and T (arXiv 2411.05288) in purple and pink.

Several iterations (`simulator_iterations`) are drawn on one time axis, so with optimizer post-validation
the next iteration's ramp visibly fills the last one's tail: in ASCII odd iterations are lower case, in
the picture they carry a hatched strip below their numbers, and optimizer steps are gold boxes.

The picture draws one collection per look (kind, chunk shade, odd iteration), not one artist per action,
and puts a microbatch number only where it fits, so p = 32 with 256 microbatches draws in seconds.

Two bubble figures are shown, each named, because they answer different questions: the share of the
picture that is idle (idle rank-time / (ranks x makespan), ramps at both ends included) is what a user
sees and pays; the zero-bubble paper's bubble rate ((span - busy) / span of the longest stage) is what
its tables report and leaves the ramps out.
"""
from __future__ import annotations

import math

from llamapipe.core.pipeline_parallel.schedule_ir import KINDS, OFFLOAD_PASSES, Plan, action_label, unit_label
from llamapipe.core.pipeline_parallel.simulator import Result
from llamapipe.core.pipeline_parallel.simulator_iterations import IterationsResult

# light to dark per chunk: F blue, B green, W orange, BW teal (B and W fused)
_COLOURS = {
    "F": ("#9ecae1", "#4292c6", "#2171b5", "#08519c"),
    "B": ("#a1d99b", "#41ab5d", "#238b45", "#006d2c"),
    "W": ("#fdd0a2", "#fd8d3c", "#e6550d", "#a63603"),
    "BW": ("#99d8c9", "#41ae76", "#238b45", "#005824"),
    "S": ("#9e9ac8",) * 4,    # vocabulary-parallel output layer: forward purple, backward pink (chunk 0 only)
    "T": ("#e377c2",) * 4,
    "O": ("#636363",) * 4,    # offload (device to host) dark grey, reload light grey: thin marks when overlapped
    "R": ("#bdbdbd",) * 4,
    "OW": ("#636363",) * 4,   # the same copies for what a deferred W holds (B to W)
    "RW": ("#bdbdbd",) * 4,
}
_MARK = 0.08          # drawn width of an O/R that takes no time on the rank's timeline (copies overlap compute)
_OPTIMIZER = "#fec44f"
_HATCH = "////"
_STRIP_TOP = 0.12     # odd iterations: the hatched strip spans y in [rank + 0.12, rank + 0.4] (lower part)
_MIN_FONT = 5.0       # smaller labels are not readable: leave the box unlabelled
_DIGIT_EM = 0.64      # width of one digit in DejaVu Sans, in ems


def ascii_timeline(plan: Plan, result: Result, iteration_of: list[list[int]] | None = None) -> str:
    """One line per rank; the time slot is the shortest action, idle slots are '.', an action's
    later slots are '='. Labels are the IR's: kind, microbatch, then 'c<chunk>' for chunks > 0; with
    `iteration_of` (from `simulate_iterations`), lower case in odd iterations."""
    rows = [row for row in result.timeline]
    durations = [e - s for row in rows for s, e, _ in row if e > s]
    if not durations:
        return "\n".join(f"rank {r}: (empty)" for r in range(plan.pp))
    slot = min(durations)
    width = max(len(action_label(plan, a)) for row in rows for _, _, a in row) + 1
    n_slots = math.ceil(result.makespan / slot - 1e-9)
    lines = []
    for rank, row in enumerate(rows):
        cells = ["." * (width - 1) + " "] * n_slots
        for i, (start, end, action) in enumerate(row):
            first = round(start / slot)
            last = max(first + 1, round(end / slot))
            odd = iteration_of is not None and iteration_of[rank][i] % 2
            label = action_label(plan, action)
            cells[first] = (label.lower() if odd else label).ljust(width)
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


def _box(rank: int, start: float, end: float, top: float = -0.4, bottom: float = 0.4) -> list:
    return [(start, rank + top), (end, rank + top), (end, rank + bottom), (start, rank + bottom)]


def _styles(result: Result, iterations: IterationsResult | None) -> dict[tuple, list]:
    """The boxes grouped by look, (kind, shade, odd iteration) -> [(rank, start, end, action)], so that
    each look is one collection: drawing costs O(looks), not one autoscaling artist per action."""
    groups: dict[tuple, list] = {}
    for rank, row in enumerate(result.timeline):
        for i, (start, end, a) in enumerate(row):
            odd = bool(iterations is not None and iterations.iteration_of[rank][i] % 2)
            groups.setdefault((a.kind, min(a.chunk, 3), odd), []).append((rank, start, end, a))
    return dict(sorted(groups.items(), key=lambda kv: (KINDS.index(kv[0][0]), kv[0][1], kv[0][2])))


def _draw_boxes(ax, groups: dict[tuple, list], edge: float) -> None:
    """One PolyCollection per look; odd iterations get a hatched strip along the bottom of the box
    only, so the hatch never runs through the microbatch number above it."""
    from matplotlib.collections import PolyCollection
    for (kind, shade, odd), boxes in groups.items():
        if kind in OFFLOAD_PASSES:
            boxes = [(r, s, max(e, s + _MARK), a) for r, s, e, a in boxes]
        ax.add_collection(PolyCollection([_box(r, s, e) for r, s, e, _ in boxes], facecolors=_COLOURS[kind][shade],
                                         edgecolors="black", linewidths=edge), autolim=False)
        if odd:
            ax.add_collection(PolyCollection([_box(r, s, e, _STRIP_TOP) for r, s, e, _ in boxes],
                                             facecolors="none", edgecolors="black", linewidths=0.4,
                                             hatch=_HATCH), autolim=False)


def _draw_optimizer_steps(ax, iterations: IterationsResult) -> tuple[float, bool]:
    """The optimizer steps of positive length, one gold collection; returns the last step's end and
    whether any box was drawn (the legend names only what is drawn)."""
    from matplotlib.collections import PolyCollection
    boxes = [_box(rank, s, e) for rank, steps in enumerate(iterations.optimizer) for s, e, _ in steps if e > s]
    if boxes:
        ax.add_collection(PolyCollection(boxes, facecolors=_OPTIMIZER, edgecolors="black", linewidths=0.4),
                          autolim=False)
    return max((e for steps in iterations.optimizer for _, e, _ in steps), default=0.0), bool(boxes)


def _draw_labels(ax, groups: dict[tuple, list], makespan: float, digits: int, y_offset: float,
                 name=str) -> None:
    """Microbatch numbers where they fit: measured on the laid-out axes, a box is labelled only if the
    widest number of the plan (`digits`, about 0.64 em each in DejaVu Sans) plus a margin fits inside it
    at a readable size, so whether a box has a label depends on its length only, never on its number. `name`
    turns a unit into its label (Seq1F1B pieces: "m.i", `schedule_ir.unit_label`)."""
    points_per_unit = ax.get_window_extent().width * 72 / ax.figure.dpi / makespan
    shortest = min((e - s for boxes in groups.values() for _, s, e, _ in boxes if e > s), default=makespan)
    font = max(_MIN_FONT, min(8.0, 0.45 * shortest * points_per_unit))
    min_length = (digits * _DIGIT_EM * font + 2.0) / points_per_unit
    for (_, shade, _), boxes in groups.items():
        for rank, start, end, a in boxes:
            if end - start >= min_length:
                ax.text((start + end) / 2, rank + y_offset, name(a.microbatch), ha="center", va="center",
                        fontsize=font, color="white" if shade else "black")


def _legend(ax, plan: Plan, groups: dict[tuple, list], optimizer_drawn: bool) -> None:
    """One entry per look drawn, nothing else."""
    from matplotlib.patches import Patch
    looks = sorted({(kind, shade) for kind, shade, _ in groups}, key=lambda k: (KINDS.index(k[0]), k[1]))
    chunk = {c: f" chunk {c}" for c in range(3)} | {3: " chunk 3+" if plan.vpp > 4 else " chunk 3"}
    handles = [Patch(facecolor=_COLOURS[k][c], edgecolor="black", label=k + (chunk[c] if plan.vpp > 1 else ""))
               for k, c in looks]
    if any(odd for _, _, odd in groups):
        handles.append(Patch(facecolor="white", edgecolor="black", hatch=_HATCH, label="odd iteration"))
    if optimizer_drawn:
        handles.append(Patch(facecolor=_OPTIMIZER, edgecolor="black", label="optimizer step"))
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=7, frameon=False)


def timeline_figure(plan: Plan, result: Result, title: str | None = None,
                    iterations: IterationsResult | None = None):
    """The timeline as a matplotlib Figure (no pyplot state); with `iterations` (whose `result` is
    `result`), odd iterations carry a hatched strip and optimizer steps of positive length are drawn."""
    from matplotlib.figure import Figure

    makespan = max(result.makespan, 1e-9)
    groups = _styles(result, iterations)
    shortest = min((e - s for boxes in groups.values() for _, s, e, _ in boxes if e > s), default=makespan)
    fig_w = min(max(6.0, 0.25 * makespan / shortest + 2.0), 18.0)   # about a quarter inch per short box
    fig = Figure(figsize=(fig_w, 0.45 * plan.pp + 1.1), dpi=100)
    ax = fig.add_subplot()
    # boxes under ~4 points wide (axes about 80% of the figure) would be all black edge: draw them bare
    _draw_boxes(ax, groups, 0.4 if 0.8 * 72 * fig_w * shortest / makespan >= 4.0 else 0.0)
    optimizer_drawn = False
    if iterations is not None:
        last, optimizer_drawn = _draw_optimizer_steps(ax, iterations)
        makespan = max(makespan, last)
    ax.set_xlim(0, makespan)
    ax.set_ylim(plan.pp - 0.5, -0.5)
    ax.set_yticks(range(plan.pp), [f"rank {r}" for r in range(plan.pp)], fontsize=8)
    ax.set_xlabel("time", fontsize=8)
    ax.tick_params(axis="x", labelsize=7)
    _legend(ax, plan, groups, optimizer_drawn)
    text = bubble_text(result) if iterations is None else iterations_text(iterations)
    pieces = f" in {plan.seq_splits} sequence pieces (m.i)" if plan.seq_splits > 1 else ""
    ax.set_title(title or f"{plan.name}: pp={plan.pp} vpp={plan.vpp} "
                 f"microbatches={plan.num_microbatches // plan.seq_splits}{pieces}\n"
                 f"{text}", fontsize=8)
    fig.tight_layout()
    if groups:
        hatched = any(odd for _, _, odd in groups)
        _draw_labels(ax, groups, makespan, len(unit_label(plan, plan.num_microbatches - 1)),
                     (-0.4 + _STRIP_TOP) / 2 if hatched else 0.0, lambda unit: unit_label(plan, unit))
    return fig

"""Draw a pipeline trace (--pipeline-trace) beside the simulator's plan, and name the actions that waited.

    llamapipe plot-trace runs/trace.json                        (writes runs/trace.png)
    llamapipe plot-trace runs/trace.json --iteration 12 --out zbv.png --top 20

For one traced iteration (default: the last) and one pipeline (the lowest global rank of each pipeline rank),
the picture has two timelines on the same time axis: what the ranks ran (measured, each action at its measured
start and end) and what the simulator predicts for the same plan with the measured mean costs of the iteration
(F, B, W per chunk, the last stage's extra for the output layer, S and T). The report lists the actions that
waited longest beyond what the plan expected: the measured gap before each action on its rank minus the
simulated gap. A long excess wait on one rank points at a slow link or a late sender upstream; the same action
late on every iteration, at an order the plan did not intend (how users of the zero-bubble fork and of torch's
pipelining found their schedule-order bugs).
"""
from __future__ import annotations

import json
import os
import statistics
import sys
from typing import Optional

from llamapipe.core.pipeline_parallel.schedule_ir import Action, Plan
from llamapipe.core.pipeline_parallel.simulator import Costs, measure, simulate
from llamapipe.core.pipeline_parallel.visualize import bubble_text, timeline_figure
from llamapipe.training.flag_parser import FlagParser

PROG = "llamapipe plot-trace"


def _parse(argv: Optional[list[str]]):
    p = FlagParser(prog=PROG, description="Draw a --pipeline-trace file beside the simulator's plan.")
    p.add_argument("trace", help="the JSON file --pipeline-trace wrote")
    p.add_argument("--iteration", type=int, default=None, help="the traced iteration to draw (default: the last)")
    p.add_argument("--out", default=None, help="picture to write, .png or .svg (default: the trace's name, .png)")
    p.add_argument("--top", type=int, default=10, help="how many of the longest excess waits to list (default 10)")
    return p.parse_args(argv)


def load(path: str) -> dict:
    """The trace's llamapipe data, with its events; one-line errors for a file that is not one."""
    try:
        with open(path, encoding="utf-8") as f:
            trace = json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ValueError(f"{path}: cannot read a JSON trace ({err})") from None
    data = trace.get("otherData", {}).get("llamapipe") if isinstance(trace, dict) else None
    if not isinstance(data, dict) or data.get("format") != 1:
        raise ValueError(f"{path} is not a trace written by --pipeline-trace (no otherData.llamapipe format 1)")
    return dict(data, events=trace.get("traceEvents", []))


def pipeline(data: dict, iteration: Optional[int]) -> tuple[int, Plan, dict[int, int], dict[int, dict]]:
    """(iteration, its plan, pp rank -> the global rank drawn, pp rank -> that rank's step record)."""
    ranks: dict[int, int] = {}
    for rank, info in sorted(data["steps"].items(), key=lambda kv: int(kv[0])):
        if info["steps"]:
            ranks.setdefault(info["pp_rank"], int(rank))
    recorded = sorted({s["iteration"] for r in ranks.values() for s in data["steps"][str(r)]["steps"]})
    if not recorded:
        raise ValueError("the trace holds no training iteration (did the run reach --profile-step-start?)")
    iteration = recorded[-1] if iteration is None else iteration
    if iteration not in recorded:
        raise ValueError(f"--iteration {iteration} is not in the trace; it holds {', '.join(map(str, recorded))}")
    steps = {pp: next(s for s in data["steps"][str(r)]["steps"] if s["iteration"] == iteration)
             for pp, r in ranks.items()}
    plan = Plan.from_json(data["plans"][steps[min(steps)]["plan"]])
    if sorted(ranks) != list(range(plan.pp)):
        raise ValueError(f"the trace has pipeline ranks {sorted(ranks)} of {plan.pp}; draw a trace of every rank "
                         "(--profile-ranks left out)")
    return iteration, plan, ranks, steps


def measured_timeline(data: dict, plan: Plan, ranks: dict[int, int], iteration: int) -> list[list[tuple]]:
    """Per pipeline rank, (start s, end s, Action) of the iteration's actions from the step's common start."""
    start = min(e["ts"] for e in data["events"] if e.get("ph") == "X" and e["args"].get("iteration") == iteration)
    rows: list[list[tuple]] = [[] for _ in range(plan.pp)]
    pp_of = {r: pp for pp, r in ranks.items()}
    for e in data["events"]:
        args = e.get("args", {})
        if e.get("ph") == "X" and "kind" in args and args["iteration"] == iteration and e["pid"] in pp_of:
            action = Action(args["kind"], args["chunk"], args["mb"])
            rows[pp_of[e["pid"]]].append(((e["ts"] - start) / 1e6, (e["ts"] + e["dur"] - start) / 1e6, action))
    return [sorted(row, key=lambda t: t[0]) for row in rows]


def b_share_of_bw(data: dict, iteration: int) -> float:
    """The B part of a fused BW: the executor sends a BW's input gradient between its B and its W, so the
    message's send (an arrow's start inside the action) splits it; half where no BW sends (one stage)."""
    sends: dict[int, list[float]] = {}
    for e in data["events"]:
        if e.get("ph") == "s":
            sends.setdefault(e["pid"], []).append(e["ts"])
    shares = []
    for e in data["events"]:
        args = e.get("args", {})
        if e.get("ph") == "X" and args.get("kind") == "BW" and args.get("iteration") == iteration and e["dur"] > 0:
            inside = [t for t in sends.get(e["pid"], ()) if e["ts"] <= t <= e["ts"] + e["dur"]]
            if inside:
                shares.append((min(inside) - e["ts"]) / e["dur"])
    return statistics.median(shares) if shares else 0.5


def mean_costs(plan: Plan, timeline: list[list[tuple]], b_share: float = 0.5) -> Costs:
    """Per-chunk costs from the measured actions: F, B, W on the stages before the last (the last stage's extra
    is the output layer's share), a fused BW split at `b_share`, S and T the vocabulary-parallel output layer's."""
    last = plan.num_stages - 1
    spans: dict[tuple[str, bool], list[float]] = {}
    for rank, row in enumerate(timeline):
        for s, e, a in row:
            on_last = a.kind not in ("S", "T") and plan.stage_of(rank, a.chunk) == last
            spans.setdefault((a.kind, on_last), []).append(e - s)

    def mean(kind: str, on_last: bool = False) -> float:
        values = spans.get((kind, on_last)) or spans.get((kind, not on_last)) or [0.0]
        return statistics.fmean(values)
    fused = ("BW", False) in spans or ("BW", True) in spans
    f = mean("F")
    b, w = (mean("BW") * b_share, mean("BW") * (1 - b_share)) if fused else (mean("B"), mean("W"))
    if plan.vocab:
        head_f, head_b = mean("S") * plan.pp, mean("T") * plan.pp
    else:
        head_f = max(mean("F", True) - f, 0.0)
        head_b = max((mean("BW", True) - b - w) if fused else (mean("B", True) - b), 0.0)
    return Costs(f=max(f, 1e-9), b=max(b, 1e-9), w=w, head_f=head_f, head_b=head_b)


def excess_waits(plan: Plan, measured: list[list[tuple]], simulated: list[list[tuple]]) -> list[dict]:
    """Every action's gap before it on its rank, measured and planned, largest excess first."""
    planned = {(rank, a): s - (row[i - 1][1] if i else 0.0) for rank, row in enumerate(simulated)
               for i, (s, _, a) in enumerate(row)}
    out = []
    for rank, row in enumerate(measured):
        for i, (s, _, a) in enumerate(row):
            gap = s - (row[i - 1][1] if i else 0.0)
            plan_gap = planned.get((rank, a), 0.0)
            out.append({"pp_rank": rank, "action": f"{a.kind}{a.chunk}.{a.microbatch}", "waited_ms": 1e3 * gap,
                        "planned_ms": 1e3 * plan_gap, "excess_ms": 1e3 * (gap - plan_gap)})
    return sorted(out, key=lambda r: -r["excess_ms"])


def _picture(plan: Plan, measured, sim, costs: Costs, iteration: int, path: str) -> None:
    """Measured above, simulated below, on one time axis, as one image."""
    import numpy as np
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.image import imsave
    end = max(measured.makespan, sim.makespan)
    panels = []
    for result, what in ((measured, f"measured, iteration {iteration}"),
                         (sim, f"simulated with the measured mean costs (F {costs.f * 1e3:.2f} ms, B {costs.b * 1e3:.2f} "
                               f"ms, W {costs.w * 1e3:.2f} ms)")):
        fig = timeline_figure(plan, result, f"{plan.name} pp={plan.pp} vpp={plan.vpp} m={plan.num_microbatches}: "
                              f"{what}; step {result.makespan * 1e3:.1f} ms\n{bubble_text(result)}")
        fig.axes[0].set_xlim(0, end)
        fig.axes[0].set_xlabel("seconds", fontsize=8)
        canvas = FigureCanvasAgg(fig)
        canvas.draw()
        panels.append(np.asarray(canvas.buffer_rgba()))
    width = max(p.shape[1] for p in panels)
    padded = [np.pad(p, ((0, 0), (0, width - p.shape[1]), (0, 0)), constant_values=255) for p in panels]
    imsave(path, np.vstack(padded))


def main(argv: Optional[list[str]] = None) -> int:
    args = _parse(argv)
    out = args.out or os.path.splitext(args.trace)[0] + ".png"
    if not out.endswith((".png", ".svg")):
        return _fail(f"--out {out} must end in .png or .svg")
    try:
        data = load(args.trace)
        iteration, plan, ranks, _ = pipeline(data, args.iteration)
        timeline = measured_timeline(data, plan, ranks, iteration)
        costs = mean_costs(plan, timeline, b_share_of_bw(data, iteration))
        sim = simulate(plan, costs)
        measured = measure(plan, costs, timeline)
    except (ValueError, KeyError) as err:
        return _fail(str(err))
    _picture(plan, measured, sim, costs, iteration, out)
    print(f"{plan.name}, iteration {iteration}: measured step {measured.makespan * 1e3:.1f} ms, simulated "
          f"{sim.makespan * 1e3:.1f} ms ({measured.makespan / sim.makespan:.3f}x); measured {bubble_text(measured)}")
    print(f"the {args.top} actions that waited longest beyond the plan (gap before the action on its rank):")
    for row in excess_waits(plan, timeline, sim.timeline)[:args.top]:
        print(f"  pp rank {row['pp_rank']}  {row['action']:>8}  waited {row['waited_ms']:8.2f} ms  planned "
              f"{row['planned_ms']:8.2f} ms  excess {row['excess_ms']:+8.2f} ms")
    print(f"wrote {out}")
    return 0


def _fail(message: str) -> int:
    sys.stderr.write(f"{PROG}: error: {message}\n")
    return 2


if __name__ == "__main__":
    sys.exit(main())

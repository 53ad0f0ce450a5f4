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

import bisect
import os
import statistics
import sys
from typing import Optional

from llamapipe.core.pipeline_parallel.schedule_ir import Action, Plan
from llamapipe.core.pipeline_parallel.simulator import Costs, measure, simulate
from llamapipe.core.pipeline_parallel.step_timers import bubble
from llamapipe.core.pipeline_parallel.visualize import timeline_figure
from llamapipe.safe_files import UnsafePathError, check_target, replace_with
from llamapipe.tools import trace_file
from llamapipe.tools.trace_file import TraceError
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
    """The trace's llamapipe data, its action events checked and its message sends by pid; `TraceError` in one
    line naming the file for anything that is not such a trace (trace_file.py)."""
    trace = trace_file.read_json(path)
    data = trace.get("otherData", {}) if isinstance(trace, dict) else None
    data = data.get("llamapipe") if isinstance(data, dict) else None
    if not isinstance(data, dict) or data.get("format") != 1:
        raise TraceError(f"{path} is not a trace written by --pipeline-trace (no otherData.llamapipe format 1)")
    trace_file.check_steps(path, data)
    events = trace.get("traceEvents", [])
    return dict(data, path=path, events=trace_file.action_events(path, events), sends=trace_file.send_times(events),
                busy=trace_file.busy_outside_actions(events))


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
    plan = trace_file.check_plan(data.get("path", "the trace"), data["plans"][steps[min(steps)]["plan"]], len(ranks))
    if sorted(ranks) != list(range(plan.pp)):
        raise ValueError(f"the trace has pipeline ranks {sorted(ranks)} of {plan.pp}; draw a trace of every rank "
                         "(--profile-ranks left out)")
    return iteration, plan, ranks, steps


def measured_timeline(data: dict, plan: Plan, ranks: dict[int, int], iteration: int) -> list[list[tuple]]:
    """Per pipeline rank, (start s, end s, Action) of the iteration's actions from the step's common start."""
    pp_of = {r: pp for pp, r in ranks.items()}
    events = [e for e in data["events"] if e["args"]["iteration"] == iteration and e["pid"] in pp_of]
    if not events:
        raise ValueError(f"iteration {iteration} has no actions of the pipeline drawn in the trace")
    start = min(e["ts"] for e in events)
    rows: list[list[tuple]] = [[] for _ in range(plan.pp)]
    for e in events:
        args = e["args"]
        if not (0 <= args["chunk"] < plan.vpp and 0 <= args["mb"] < plan.num_microbatches):
            raise ValueError(f"an action {args['kind']}{args['chunk']}.{args['mb']} is outside its plan's "
                             f"{plan.vpp} chunk(s) and {plan.num_microbatches} microbatches")
        action = Action(args["kind"], args["chunk"], args["mb"])
        rows[pp_of[e["pid"]]].append(((e["ts"] - start) / 1e6, (e["ts"] + e["dur"] - start) / 1e6, action))
    return [sorted(row, key=lambda t: t[0]) for row in rows]


def b_share_of_bw(data: dict, iteration: int) -> float:
    """The B part of a fused BW: the executor sends a BW's input gradient between its B and its W, so the
    message's send (an arrow's start inside the action) splits it; half where no BW sends (one stage). Each BW
    looks up its first send by bisection in its rank's sorted sends: n log n over the trace."""
    shares = []
    for e in data["events"]:
        args = e["args"]
        if args["kind"] == "BW" and args["iteration"] == iteration and e["dur"] > 0:
            sends = data["sends"].get(e["pid"], ())
            i = bisect.bisect_left(sends, e["ts"])
            if i < len(sends) and sends[i] <= e["ts"] + e["dur"]:
                shares.append((sends[i] - e["ts"]) / e["dur"])
    return statistics.median(shares) if shares else 0.5


def rank_bubbles(timeline: list[list[tuple]], makespan: float, extra: Optional[list[float]] = None) -> list[float]:
    """Per pipeline rank, the measured bubble as the training log has it (`step_timers.bubble`: the idle share
    of the iteration, idle = iteration - compute - communication), the iteration being the step from its common
    start to its last action's end; `extra`: per rank, its busy time outside the plan's actions."""
    extra = extra or [0.0] * len(timeline)
    return [bubble({"iteration": makespan, "idle": max(makespan - sum(e - s for s, e, _ in row) - more, 0.0)})
            for row, more in zip(timeline, extra)]


def busy_outside(data: dict, ranks: dict[int, int], iteration: int, makespan: float) -> list[float]:
    """Per pipeline rank, the seconds of communication and phases inside the iteration's window."""
    drawn = set(ranks.values())
    start = min(e["ts"] for e in data["events"] if e["args"]["iteration"] == iteration and e["pid"] in drawn)
    end = start + makespan * 1e6
    return [sum(max(min(b, end) - max(a, start), 0.0) for a, b in data["busy"].get(ranks[pp], ())) / 1e6
            for pp in sorted(ranks)]


def bubble_line(timeline: list[list[tuple]], makespan: float, extra: Optional[list[float]] = None) -> str:
    """The one bubble figure plot-trace shows: the worst rank's, as the log's bubble_max, and the mean."""
    bubbles = rank_bubbles(timeline, makespan, extra)
    worst = max(range(len(bubbles)), key=lambda r: bubbles[r])
    return (f"bubble {100 * bubbles[worst]:.1f}% max (pp rank {worst}), {100 * statistics.fmean(bubbles):.1f}% "
            "mean (idle share of the iteration per rank, as the training log's bubble_max)")


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


def _picture(plan: Plan, measured, sim, costs: Costs, iteration: int, path: str, extra: list[float]) -> None:
    """Measured above, simulated below, on one time axis, as one image written whole at `path` or not at all."""
    import numpy as np
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.image import imsave
    end = max(measured.makespan, sim.makespan)
    panels = []
    for result, what, more in ((measured, f"measured, iteration {iteration}", extra),
                         (sim, f"simulated with the measured mean costs (F {costs.f * 1e3:.2f} ms, B {costs.b * 1e3:.2f} "
                               f"ms, W {costs.w * 1e3:.2f} ms)", None)):
        fig = timeline_figure(plan, result, f"{plan.name} pp={plan.pp} vpp={plan.vpp} m={plan.num_microbatches}: "
                              f"{what}; step {result.makespan * 1e3:.1f} ms\n"
                              f"{bubble_line(result.timeline, result.makespan, more)}")
        fig.axes[0].set_xlim(0, end)
        fig.axes[0].set_xlabel("seconds", fontsize=8)
        canvas = FigureCanvasAgg(fig)
        canvas.draw()
        panels.append(np.asarray(canvas.buffer_rgba()))
    width = max(p.shape[1] for p in panels)
    padded = [np.pad(p, ((0, 0), (0, width - p.shape[1]), (0, 0)), constant_values=255) for p in panels]
    replace_with(path, lambda tmp: imsave(tmp, np.vstack(padded), format=os.path.splitext(path)[1][1:]))


def check_out(out: str) -> None:
    """Refuse an --out plot-trace cannot write: a bad suffix, a missing or read-only folder, a link or directory."""
    if not out.endswith((".png", ".svg")):
        raise ValueError(f"--out {out} must end in .png or .svg")
    folder = os.path.dirname(out) or "."
    if not os.path.isdir(folder):
        raise ValueError(f"--out {out}: the folder {folder} does not exist")
    check_target(out)       # a planted link is refused, not written through (as plot-schedule and profile)
    if not os.access(folder, os.W_OK | os.X_OK):
        raise ValueError(f"--out {out}: the folder {folder} is not writable")


def main(argv: Optional[list[str]] = None) -> int:
    args = _parse(argv)
    out = args.out or os.path.splitext(args.trace)[0] + ".png"
    try:
        check_out(out)
        data = load(args.trace)
        iteration, plan, ranks, _ = pipeline(data, args.iteration)
        timeline = measured_timeline(data, plan, ranks, iteration)
        costs = mean_costs(plan, timeline, b_share_of_bw(data, iteration))
        sim = simulate(plan, costs)
        measured = measure(plan, costs, timeline)
        extra = busy_outside(data, ranks, iteration, measured.makespan)
        _picture(plan, measured, sim, costs, iteration, out, extra)
    except (TraceError, UnsafePathError) as err:
        return _fail(str(err))
    except OSError as err:
        return _fail(f"--out {out}: cannot write it ({err.strerror or err})")
    except (ValueError, KeyError, TypeError, AssertionError, IndexError, ZeroDivisionError) as err:
        return _fail(f"{args.trace}: cannot draw this trace ({str(err) or type(err).__name__})")
    print(f"{plan.name}, iteration {iteration}: measured step {measured.makespan * 1e3:.1f} ms, simulated "
          f"{sim.makespan * 1e3:.1f} ms ({measured.makespan / sim.makespan:.3f}x); measured "
          f"{bubble_line(timeline, measured.makespan, extra)}")
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

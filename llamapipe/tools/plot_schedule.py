"""Build a pipeline schedule, simulate it, print its timeline and numbers, and draw it.

    python scripts/plot_schedule.py --schedule zb-h1 --pp 4 --microbatches 8 --out zb-h1.png
    python scripts/plot_schedule.py --schedule auto --pp 4 --microbatches 16 --costs 1,1.5,0.8,0.1 --json
"""
import sys


import argparse
import json

from llamapipe.core.config import SCHEDULES
from llamapipe.core.pipeline_parallel.builders import build
from llamapipe.core.pipeline_parallel.simulator import Costs, simulate
from llamapipe.core.pipeline_parallel.visualize import ascii_timeline, plot_timeline

PROG = "plot_schedule.py"


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:   # one plain line instead of usage + message
        sys.exit(_fail(message))


def _fail(message: str) -> int:
    print(f"{PROG}: error: {message}", file=sys.stderr)
    return 2


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = _Parser(prog=PROG, description="Simulate and draw a pipeline schedule.")
    p.add_argument("--schedule", required=True, choices=SCHEDULES)
    p.add_argument("--pp", type=int, required=True, help="pipeline-parallel size")
    p.add_argument("--vpp", type=int, default=None, help="model chunks per rank (default 2 for interleaved "
                                                         "and zbv, else 1)")
    p.add_argument("--microbatches", type=int, required=True)
    p.add_argument("--costs", default="1,1,1,0", help="F,B,W[,COMM] times of one chunk (default 1,1,1,0)")
    p.add_argument("--mem-limit", type=float, default=None,
                   help="auto: activation memory cap per rank in microbatch-chunk units (default 2*pp)")
    p.add_argument("--out", default="timeline.png", help="picture to write, .png or .svg (default timeline.png)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the text report")
    return p.parse_args(argv)


def _costs(text: str) -> Costs:
    try:
        values = [float(v) for v in text.split(",")]
    except ValueError:
        values = []
    if len(values) not in (3, 4):
        raise ValueError(f"--costs {text} must be three or four comma-separated numbers F,B,W[,COMM]")
    return Costs(*values)


def _report(plan, result) -> str:
    lines = [ascii_timeline(plan, result), "",
             f"{'rank':>4} {'busy':>8} {'span':>8} {'idle':>8} {'peak mem':>9}"]
    for r in range(plan.pp):
        lines.append(f"{r:>4} {result.busy[r]:>8.2f} {result.span[r]:>8.2f} "
                     f"{result.makespan - result.busy[r]:>8.2f} {result.peak_memory[r]:>9.2f}")
    lines += [f"makespan {result.makespan:.2f}", f"bubble rate {100 * result.bubble_rate:.2f}% "
              f"(makespan bubble rate {100 * result.makespan_bubble_rate:.2f}%)"]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    vpp = args.vpp if args.vpp is not None else (2 if args.schedule in ("interleaved", "zbv") else 1)
    if not args.out.endswith((".png", ".svg")):
        return _fail(f"--out {args.out} must end in .png or .svg")
    try:
        costs = _costs(args.costs)
        plan = build(args.schedule, args.pp, vpp, args.microbatches, costs=costs, mem_limit=args.mem_limit)
    except ValueError as e:
        return _fail(str(e))
    result = simulate(plan, costs)
    plot_timeline(plan, result, args.out)
    if args.json:
        print(json.dumps({"schedule": args.schedule, "pp": args.pp, "vpp": vpp, "microbatches": args.microbatches,
                          "makespan": result.makespan, "bubble_rate": result.bubble_rate,
                          "makespan_bubble_rate": result.makespan_bubble_rate,
                          "peak_activation_memory": result.peak_memory}))
    else:
        print(_report(plan, result))
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

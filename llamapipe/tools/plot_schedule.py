"""Build a pipeline schedule, simulate it, print its timeline and numbers, and draw it.

    llamapipe plot-schedule --schedule zb-h1 --pp 4 --microbatches 8            (writes runs/schedule_zb-h1.png)
    llamapipe plot-schedule --schedule auto --pp 4 --microbatches 16 --costs 1,1.5,0.8,0.1 --json
    llamapipe plot-schedule --schedule zbv --pp 2 --microbatches 8 --iterations 3 --post-validation
    llamapipe plot-schedule --schedule v-half --pp 4 --microbatches 8 --export-csv v_half.csv
    llamapipe plot-schedule --schedule-file v_half.csv            (a torch.distributed.pipelining CSV schedule)

With --iterations K it runs K chained iterations (`simulator_iterations`): a barrier after each, or with
--post-validation each rank going on to the next iteration as soon as it has stepped, so iterations
interleave; it prints the steady-state time per iteration, and the table and picture cover every iteration.
--export-csv writes the plan in torch.distributed.pipelining's CSV format (what torchtitan's
pipeline_parallel_schedule_csv and `_PipelineScheduleRuntime._load_csv` read); --schedule-file reads one
(`training.schedule_file`), verifies it and draws it instead of a named schedule.
With --json and no --out it draws nothing. `auto` is planned for what that costs
(`auto_plan`): the makespan, or with --post-validation the longest stage span.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys

from llamapipe.training.flag_parser import FlagParser
from llamapipe.core.pipeline_parallel.schedule_specs import SCHEDULES, SPECS, build, build_seq
from llamapipe.core.pipeline_parallel.schedule_ir import Plan
from llamapipe.core.pipeline_parallel.offload_plan import with_offload
from llamapipe.core.pipeline_parallel.simulator import Costs, Result, simulate
from llamapipe.core.pipeline_parallel.simulator_iterations import IterationsResult, simulate_iterations
from llamapipe.core.pipeline_parallel.vocab_parallel import vocab_costs
from llamapipe.core.pipeline_parallel.visualize import (
    ascii_timeline,
    bubble_text,
    iterations_text,
    rank_table,
    timeline_figure,
)
from llamapipe.training.flag_names import flag_message
from llamapipe.training.schedule_file import read_schedule_file, write_schedule_file
from llamapipe.safe_files import check_target

PROG = "llamapipe plot-schedule"


def _fail(message: str) -> int:
    print(f"{PROG}: error: {message}", file=sys.stderr)
    return 2


def _schedule_name(text: str) -> str:
    """A schedule of the table, or a grouped one with its group size (interleaved:8)."""
    try:
        return SPECS[text].name
    except KeyError:
        raise argparse.ArgumentTypeError(f"{text} is not a schedule; choose one of {', '.join(SCHEDULES)}, or "
                                         "interleaved:N / group-interleaved:N") from None


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = FlagParser(prog=PROG, description="Simulate and draw a pipeline schedule.")
    which = p.add_mutually_exclusive_group(required=True)
    which.add_argument("--schedule", type=_schedule_name, metavar="NAME",
                       help=f"one of {', '.join(SCHEDULES)}; interleaved:N or group-interleaved:N with microbatch "
                            "groups of N")
    which.add_argument("--schedule-file", default=None,
                       help="a torch.distributed.pipelining CSV schedule to verify and draw (sets pp, chunks, m)")
    p.add_argument("--export-csv", default=None, metavar="FILE",
                   help="also write the plan as a torch.distributed.pipelining CSV schedule")
    p.add_argument("--pp", type=int, default=None, help="pipeline-parallel size (required with --schedule)")
    p.add_argument("--vpp", type=int, default=None, help="model chunks per rank (default 2 for interleaved "
                                                         "and zbv, else 1)")
    p.add_argument("--microbatches", type=int, default=None, help="microbatches (required with --schedule)")
    p.add_argument("--num-seq-splits", type=int, default=1, metavar="K",
                   help="Seq1F1B: every microbatch in K sequence pieces (boxes m.i); each piece costs 1/K of --costs")
    p.add_argument("--costs", default="1,1,1,0", help="F,B,W[,COMM] times of one chunk (default 1,1,1,0)")
    p.add_argument("--mem-limit", type=float, default=None,
                   help="auto: activation memory cap per rank in microbatch-chunk units (default 2*pp)")
    p.add_argument("--iterations", type=int, default=1, help="chained iterations to simulate and draw (default 1)")
    p.add_argument("--post-validation", action="store_true",
                   help="optimizer post-validation: each rank starts the next iteration once it has stepped, "
                        "without a barrier (and auto plans for the longest stage span)")
    p.add_argument("--optimizer-step", type=float, default=0.0, help="time of one optimizer step (default 0)")
    p.add_argument("--out", default=None, help="picture to write, .png or .svg (default runs/schedule_SCHEDULE.png)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the text report")
    p.add_argument("--offload-chunk-num", type=int, default=0, metavar="N",
                   help="PipeOffload: add O/R actions for the local chunks below N (as --cpu-offload does)")
    p.add_argument("--offload-time", type=float, default=0.0,
                   help="with --offload-chunk-num: one copy's time as a share of F + B + W (default 0: overlapped)")
    p.add_argument("--offload-weight-grad-inputs", action="store_true",
                   help="with --offload-chunk-num: OW/RW actions for what deferred weight gradients hold (B to W)")
    p.add_argument("--vocab-parallel", action="store_true",
                   help="split the output layer over every rank: its S/T actions (arXiv 2411.05288) in the plan")
    p.add_argument("--head-costs", default=None, help="HF,HB: the output layer's forward and backward time over "
                   "the whole vocabulary, on the last stage or split over S/T (default 0,0; 1,2 x F with "
                   "--vocab-parallel)")
    return p.parse_args(argv)


def _costs(text: str) -> Costs:
    try:
        values = [float(v) for v in text.split(",")]
    except ValueError:
        values = []
    if len(values) not in (3, 4):
        raise ValueError(f"--costs {text} must be three or four comma-separated numbers F,B,W[,COMM]")
    return Costs(*values)


def _head_costs(args: argparse.Namespace, costs: Costs) -> Costs:
    if args.head_costs is None:
        return vocab_costs(costs) if args.vocab_parallel else costs
    try:
        head_f, head_b = (float(v) for v in args.head_costs.split(","))
    except ValueError:
        raise ValueError(f"--head-costs {args.head_costs} must be two comma-separated numbers HF,HB") from None
    return dataclasses.replace(costs, head_f=head_f, head_b=head_b)


def _piece_costs(costs: Costs, k: int) -> Costs:
    """A Seq1F1B piece's costs: 1/K of a microbatch's time, message and activations (FLOPs-balanced pieces)."""
    if k < 1:
        raise ValueError(f"--num-seq-splits {k} must be at least 1")
    return costs.pieces(k)


def _build(args: argparse.Namespace, costs: Costs):
    """The plan as the runtime builds it (`auto` for what an iteration costs with or without post-validation),
    or the one in --schedule-file; --export-csv writes it."""
    if args.schedule_file is not None:
        plan = read_schedule_file(args.schedule_file)
    elif args.pp is None or args.microbatches is None:
        raise ValueError(f"--schedule {args.schedule} needs --pp and --microbatches")
    elif args.num_seq_splits > 1:
        vpp = args.vpp if args.vpp is not None else SPECS[args.schedule].default_chunks
        plan = build_seq(args.schedule, args.pp, vpp, args.microbatches, args.num_seq_splits)
    else:
        vpp = args.vpp if args.vpp is not None else SPECS[args.schedule].default_chunks
        plan = build(args.schedule, args.pp, vpp, args.microbatches, costs=costs, mem_limit=args.mem_limit,
                     post_validation=args.post_validation, vocab_parallel=args.vocab_parallel)
    if args.export_csv is not None:
        check_target(args.export_csv)   # a planted link is refused, not written through
        write_schedule_file(plan, args.export_csv)
    if args.offload_chunk_num:          # torch's format has no offload action: the file holds the compute plan
        plan = with_offload(plan, args.offload_chunk_num, costs, args.offload_time,
                            held=args.offload_weight_grad_inputs)
    return plan


def plot_timeline(plan: Plan, result: Result, path: str, title: str | None = None,
                  iterations: IterationsResult | None = None) -> None:
    """Write the timeline to `path` (format from the suffix, .png or .svg); see `visualize.timeline_figure`."""
    timeline_figure(plan, result, title, iterations).savefig(path)


def _report(plan, result, iters) -> str:
    """Timeline and table over every iteration drawn; the makespan and bubble figures of one iteration."""
    lines = [ascii_timeline(plan, iters.result, iters.iteration_of), ""]
    if iters.iterations > 1:
        lines.append(f"per rank over all {iters.iterations} iterations drawn above:")
    alone = "one iteration alone: " if iters.iterations > 1 else ""
    lines += [rank_table(plan, iters.result), "", f"{alone}makespan {result.makespan:.2f}", alone + bubble_text(result)]
    return "\n".join(lines + ([iterations_text(iters)] if iters.iterations > 1 or iters.post_validation else []))


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    draw = args.out is not None or not args.json   # --json alone is for scripts: no picture to wait for
    title = args.schedule or os.path.splitext(os.path.basename(args.schedule_file))[0]
    args.out = args.out or os.path.join("runs", f"schedule_{title}.png")
    if not args.out.endswith((".png", ".svg")):
        return _fail(f"--out {args.out} must end in .png or .svg")
    try:
        costs = _piece_costs(_head_costs(args, _costs(args.costs)), args.num_seq_splits)
        plan = _build(args, costs)
        iters = simulate_iterations(plan, costs, args.iterations, post_validation=args.post_validation,
                                    optimizer_step=args.optimizer_step)
        if draw:
            check_target(args.out)      # a planted link is refused, not written through
    except (ValueError, OSError) as e:
        return _fail(flag_message(e))
    # one iteration from release time 0 is exactly `simulate`'s run: no need to run it twice
    result = iters.result if args.iterations == 1 else simulate(plan, costs)
    if draw:
        os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
        plot_timeline(plan, iters.result, args.out, iterations=iters if args.iterations > 1 else None)
    if args.json:
        data = {"schedule": title, "pp": plan.pp, "vpp": plan.vpp, "microbatches": plan.num_microbatches,
                "makespan": result.makespan, "bubble_rate": result.bubble_rate,
                "makespan_bubble_rate": result.makespan_bubble_rate, "peak_activation_memory": result.peak_memory}
        if args.iterations > 1 or args.post_validation:
            data.update(iterations=args.iterations, post_validation=args.post_validation,
                        time_per_iteration=iters.time_per_iteration, iteration_end=iters.iteration_end)
        print(json.dumps(data))
    else:
        print(_report(plan, result, iters))
        print(f"wrote {args.out}")
        if args.export_csv is not None:
            print(f"wrote {args.export_csv} (torch.distributed.pipelining CSV schedule)")
    return 0


if __name__ == "__main__":
    sys.exit(main())

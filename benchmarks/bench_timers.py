"""The per-rank timers (--timing-log-level): is the measured bubble right, and what do the timers cost?

Modes:
  hook-cost  what the timers add to each action (their hooks and clock reads, a million times in one process):
             times the actions per iteration, over the iteration's time, it bounds the level-1 cost without the
             noise of a whole run;
  synthetic  p = 2 and p = 4 gloo ranks whose F, B and W sleep fixed times (bench_schedules' sleeping chunks) run
             1F1B, interleaved, ZB-H1 and ZB-V with `StepTimers` watching; each rank's measured idle share of the
             step (idle = step wall time - compute - communication, the step being the slowest rank's
             forward-backward) against the simulator's (1 - busy / makespan) for the same plan and costs. The
             timers are right when the two agree within 2 points on every rank.
  overhead   pretrain_llama.py under torchrun, p = 2, a small model, --timing-log-level 0 against 1 (and 2),
             alternating rounds, the median time per iteration of the steady iterations of each run; the
             level-1 cost is their ratio (target: at most 1.01).
Prints a table per mode and writes JSON (--out). Example: python -m benchmarks.bench_timers --modes synthetic
"""
from __future__ import annotations

import argparse
import dataclasses
import itertools
import os
import statistics

import torch

from benchmarks.bench_schedules import SleepChunk, _calibrate_sleep, chunk_costs
from benchmarks.launch import run_distributed
from benchmarks.schedules_real import loss_step, placement
from benchmarks.timer_runs import hook_pass, median_iteration_s, run_modes
from llamapipe.core.pipeline_parallel.schedule_ir import stage_of
from llamapipe.core.pipeline_parallel.schedule_specs import build
from llamapipe.core.pipeline_parallel.simulator import simulate

SCHEDULES = (("1f1b", 1), ("interleaved", 2), ("zb-h1", 1), ("zbv", 2))


def synthetic_worker(rank: int, world: int, m: int, sleep_s: float, rounds: int) -> list[dict]:
    """Each schedule `rounds` times on sleeping chunks with the timers on; per rank: measured vs simulated idle."""
    import torch.distributed as dist
    from llamapipe.core.parallel_state import initialize_model_parallel
    from llamapipe.core.pipeline_parallel.runtime import RuntimeOptions
    from llamapipe.core.pipeline_parallel.schedules import get_forward_backward_func
    from llamapipe.core.pipeline_parallel.step_timers import StepTimers
    ps0, rows = initialize_model_parallel(1, world), []
    x = torch.randn(64, 2, 32)
    _calibrate_sleep()
    for name, vpp in SCHEDULES:
        ps = dataclasses.replace(ps0, vpp_size=vpp)
        stages = [stage_of(ps.pp_rank, c, world, placement(name, vpp)) for c in range(vpp)]
        chunks = [SleepChunk((sleep_s / vpp,) * 3, s == world * vpp - 1) for s in stages]
        data = [itertools.repeat({"input_ids": x}) if s == 0 else None for s in stages]
        timers = StepTimers(1)
        fb = get_forward_backward_func(ps, name, options=RuntimeOptions(observers=(timers,)))
        fb(forward_step_func=loss_step, data_iterator=data, model=chunks, num_microbatches=m)    # warm-up
        measured = []
        for _ in range(rounds):
            timers.interval()
            dist.barrier()
            timers.restart()
            fb(forward_step_func=loss_step, data_iterator=data, model=chunks, num_microbatches=m)
            mine = timers.interval()
            wall = torch.tensor([mine["forward-backward"]], dtype=torch.float64)
            dist.all_reduce(wall, op=dist.ReduceOp.MAX)      # the step: the slowest rank's forward-backward
            busy = mine["compute"] + mine["communication"]
            measured.append(1.0 - busy / float(wall))
        sim = simulate(build(name, world, vpp, m), chunk_costs(vpp, sleep_s, sleep_s, sleep_s))
        rows.append({"schedule": name, "p": world, "m": m, "rank": rank,
                     "measured_idle": statistics.median(measured), "simulated_idle": 1 - sim.busy[rank] / sim.makespan,
                     "spread": [min(measured), max(measured)]})
        rows[-1]["difference_points"] = 100 * (rows[-1]["measured_idle"] - rows[-1]["simulated_idle"])
    return rows


def synthetic(args) -> list[dict]:
    rows = []
    for p in (2, 4):
        per_rank = run_distributed(synthetic_worker, p, args.m, args.sleep_ms / 1e3, args.rounds, timeout=900)
        rows += [r for ranks in zip(*per_rank) for r in ranks]
    return rows


def hook_cost(args) -> list[dict]:
    """What the level-1 and level-2 timers add to one action, measured without noise from other processes: the
    executor's extra clock reads and the observer's hooks, called as the executor calls them for each action
    (one action_done, one message sent and received, one post between actions), a million times."""
    from llamapipe.core.pipeline_parallel.step_timers import StepTimers
    rows = []
    for level in (1, 2):
        timers = StepTimers(level)
        timers.step_begin(None, 0, False)
        rows.append({"level": level, "us_per_action": hook_pass(timers, args.hook_calls)})
    return rows


def _run(level: int, iters: int, extra: list[str]) -> float:
    """Median seconds per iteration over iterations 3.. of one run at --timing-log-level `level`."""
    return median_iteration_s(iters, ["--timing-log-level", str(level), *extra])


def overhead(args) -> list[dict]:
    """Alternating rounds of level 0, 1 and 2; per round the ratio to that round's level 0."""
    rows = []
    for schedule in args.overhead_schedules:
        times = {0: [], 1: [], 2: []}
        for _ in range(args.overhead_rounds):
            for level in (0, 1, 2):
                vpp = ["--num-layers-per-virtual-pipeline-stage", "2"] if schedule in ("zbv", "interleaved") else []
                times[level].append(_run(level, args.overhead_iters, ["--pipeline-schedule", schedule, *vpp]))
        for level in (1, 2):
            ratios = [a / b for a, b in zip(times[level], times[0])]
            rows.append({"schedule": schedule, "level": level, "ratio_median": statistics.median(ratios),
                         "ratio_spread": [min(ratios), max(ratios)],
                         "iter_s_level0": statistics.median(times[0]), "iter_s": statistics.median(times[level])})
    return rows


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--modes", default="hook-cost,synthetic,overhead")
    parser.add_argument("--m", type=int, default=8, help="synthetic: microbatches")
    parser.add_argument("--sleep-ms", type=float, default=20.0, help="synthetic: F = B = W time per stage")
    parser.add_argument("--rounds", type=int, default=5, help="synthetic: timed steps per schedule")
    parser.add_argument("--hook-calls", type=int, default=1_000_000, help="hook-cost: actions timed")
    parser.add_argument("--overhead-rounds", type=int, default=5)
    parser.add_argument("--overhead-iters", type=int, default=12)
    parser.add_argument("--overhead-schedules", nargs="+", default=["1f1b", "zbv"])
    parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "bench_timers.json"))
    args = parser.parse_args(argv)
    return run_modes(args, (("hook-cost", hook_cost), ("synthetic", synthetic), ("overhead", overhead)))

if __name__ == "__main__":
    main()

"""Pipeline schedules side by side: simulated, synthetic (sleeping stages) and real LLaMA compute.

Why: the runtime must be correct for every schedule *and* faster than 1F1B (zero-bubble paper, Qi et
al., arXiv 2401.10241). Modes:
  simulated  the simulator's makespan / bubble / peak memory table for p=4, m=8 and 16;
  planning   how long `auto` takes to plan p=32, m=256 (the zero-bubble paper's 28.3B setting);
  synthetic  p=4 gloo ranks whose F/B/W sleep fixed times while real tensors cross p2p; measured step
             time / simulated makespan shows the runtime's own overhead independently of CPU count;
  real       p=2 ranks, one thread and one core each, a small LlamaModel: every schedule against the
             ideal, the busy ideal and torch.distributed.pipelining, with each rank's compute time and the
             simulated pipeline fill (benchmarks/schedules_real.py);
  overlap    whole training iterations back to back (optimizer step included), with and without
             --enable-optimizer-post-validation: steady-state time per iteration, real p=2 model
             (benchmarks/schedules_overlap.py);
  overlap-synthetic  the same on sleeping stages, p=4, m=16.
Prints one table per mode and writes JSON (--out). Example: python benchmarks/bench_schedules.py --modes simulated
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import itertools
import os
import statistics
import time

import torch
from torch import nn

from llamapipe.core.tensor_parallel import weight_grad_store
from llamapipe.core.pipeline_parallel.schedule_ir import stage_of
from llamapipe.core.pipeline_parallel.schedule_specs import SPECS, build
from llamapipe.core.pipeline_parallel.simulator import Costs, simulate
from benchmarks.schedules_real import SCHEDULES, loss_step, placement, real_worker, summary, timed_rounds  # noqa: E501
from benchmarks.results_io import write_json


def chunk_costs(vpp: int, f: float = 1.0, b: float = 1.0, w: float = 1.0) -> Costs:
    """Per-chunk costs when a stage's work (f, b, w, one unit of memory) is split over vpp chunks."""
    return Costs(f=f / vpp, b=b / vpp, w=w / vpp, act_mem=1.0 / vpp, w_mem=0.5 / vpp)


def planning() -> list[dict]:
    """Seconds `auto` takes to plan the zero-bubble paper's 28.3B setting (Table 9: p=32, m=256) under ZB-2p's cap,
    and the bubble rate it reaches (Table 5: 0.18%); once a test's elapsed-time assertion (issue 39)."""
    from llamapipe.core.pipeline_parallel.auto_plan import plan_auto
    costs = Costs(f=10.402, b=10.248, w=7.698, comm=0.460, w_mem=32 * 6144 / (34 * 6144 + 5 * 48 * 1024))
    start = time.perf_counter()
    plan = plan_auto(32, 1, 256, costs, 64, post_validation=True)
    return [{"p": 32, "m": 256, "plan_s": time.perf_counter() - start,
             "bubble_rate": simulate(plan, costs).bubble_rate}]


def simulated(pp: int = 4, ms: tuple = (8, 16)) -> list[dict]:
    rows = []
    for m, (name, vpp) in itertools.product(ms, SCHEDULES):
        costs = chunk_costs(vpp)
        res = simulate(build(name, pp, vpp, m, costs=costs), costs)
        rows.append({"schedule": name, "vpp": vpp, "m": m, "makespan": res.makespan,
                     "bubble_rate": res.bubble_rate, "peak_memory": max(res.peak_memory)})
    return rows


_OVERSHOOT = [0.0]          # median time.sleep overshoot of this process, set by _calibrate_sleep
_MAX_OVERSHOOT = 0.3e-3     # typical is 0.07-0.12 ms


def _calibrate_sleep() -> None:
    """time.sleep overshoots by 0.1-0.2 ms (timer slack and wake-up), which over ~100 F/B/W per rank
    would be billed to the runtime: set Linux timer slack to 1 ns and subtract the median overshoot left.
    (Spinning to the deadline instead steals the cores that the other ranks' communication needs.)"""
    try:
        import ctypes
        ctypes.CDLL(None).prctl(29, 1, 0, 0, 0)            # PR_SET_TIMERSLACK
    except (OSError, AttributeError):
        pass
    over = []
    for _ in range(30):
        start = time.perf_counter()
        time.sleep(0.005)
        over.append(time.perf_counter() - start - 0.005)
    _OVERSHOOT[0] = min(statistics.median(over), _MAX_OVERSHOOT)   # a slow spell must not cut every sleep


def _sleep(seconds: float) -> None:
    time.sleep(max(seconds - _OVERSHOOT[0], 0.0))


class _Sleep(torch.autograd.Function):
    """Identity whose forward, input backward and deferred weight backward each sleep a fixed time."""

    @staticmethod
    def forward(ctx, x, weight, times):
        ctx.weight, ctx.times = weight, times
        ctx.store = weight_grad_store.current()
        _sleep(times[0])
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        weight, times = ctx.weight, ctx.times
        _sleep(times[1])

        def weight_grad() -> None:
            _sleep(times[2])
            weight.grad = torch.ones_like(weight) if weight.grad is None else weight.grad + 1

        weight_grad_store.defer(ctx.store, weight_grad, (weight,))
        return grad.clone(), None, None


class SleepChunk(nn.Module):
    def __init__(self, times: tuple, post_process: bool) -> None:
        super().__init__()
        self.weight, self.times, self.post_process, self.input_tensor = nn.Parameter(torch.zeros(1)), times, \
            post_process, None

    def set_input_tensor(self, t: torch.Tensor) -> None:
        self.input_tensor = t

    def forward(self, input_ids=None, labels=None) -> torch.Tensor:
        x = input_ids if input_ids is not None else self.input_tensor
        out = _Sleep.apply(x, self.weight, self.times)
        return out.sum(-1).t() if self.post_process else out


def synthetic_worker(rank: int, world: int, m: int, sleep_s: float, steps: int) -> list[dict]:
    """Every schedule on sleeping chunks, timed round-robin: round k runs each schedule once, so a slow
    spell of the machine lands on all schedules alike instead of on one schedule's steps."""
    from llamapipe.core.parallel_state import initialize_model_parallel
    from llamapipe.core.pipeline_parallel.runtime import RuntimeOptions
    from llamapipe.core.pipeline_parallel.schedules import get_forward_backward_func
    from llamapipe.core.pipeline_parallel.p2p_communication import measure_latency
    ps0, rows, fbs, runs = initialize_model_parallel(1, world), [], {}, {}
    x = torch.randn(64, 2, 32)
    _calibrate_sleep()
    comm = measure_latency(ps0.pp_rank, ps0.pp_ranks, ps0.pp_group, nbytes=x.numel() * x.element_size(),
                           device=x.device, rounds=50)
    for name, vpp in SCHEDULES:
        ps = dataclasses.replace(ps0, vpp_size=vpp)
        stages = [stage_of(ps.pp_rank, c, world, placement(name, vpp)) for c in range(vpp)]
        chunks = [SleepChunk((sleep_s / vpp,) * 3, s == world * vpp - 1) for s in stages]
        data = [itertools.repeat({"input_ids": x}) if s == 0 else None for s in stages]
        fbs[name] = get_forward_backward_func(ps, name, options=RuntimeOptions(profile_iters=1))
        runs[name] = functools.partial(fbs[name], forward_step_func=loss_step, data_iterator=data, model=chunks,
                                       num_microbatches=m)
        for _ in range(2 if SPECS[name].profiled else 1):
            runs[name]()               # warm-up (the profiling step first, for auto and zb-h2)
    wall, _, _ = timed_rounds(ps0, runs, steps)
    for name, vpp in SCHEDULES:
        plan = fbs[name].plan if SPECS[name].profiled else build(name, world, vpp, m)
        costs = chunk_costs(vpp, sleep_s, sleep_s, sleep_s)
        predicted = simulate(plan, costs).makespan
        with_comm = simulate(plan, dataclasses.replace(costs, comm=comm)).makespan
        measured = statistics.median(wall[name])
        rows.append({"schedule": name, "vpp": vpp, "m": m, "measured_s": measured, "simulated_s": predicted,
                     "ratio": measured / predicted, "comm_ms": comm * 1e3, "sim_comm_s": with_comm,
                     "ratio_comm": measured / with_comm, "actions_per_rank": max(map(len, plan.actions)),
                     "sleep_overshoot_ms": _OVERSHOOT[0] * 1e3, "rounds_s": wall[name]})
    return rows


def _table(title: str, rows: list[dict]) -> str:
    keys = list(dict.fromkeys(k for r in rows for k in r))

    def fmt(v) -> str:
        if isinstance(v, list):
            return "/".join(fmt(x) for x in v)
        return f"{v:.4g}" if isinstance(v, float) else str(v)
    lines = [title, "  ".join(f"{k:>12}" for k in keys)]
    lines += ["  ".join(f"{fmt(r.get(k)):>12}" for k in keys) for r in rows]
    return "\n".join(lines)


def _overlap_modes(args, modes: list, results: dict) -> None:
    from benchmarks import schedules_overlap
    from benchmarks.launch import run_distributed
    if "overlap" in modes:
        results["overlap"] = run_distributed(schedules_overlap.real_worker, 2, args, timeout=1800)[0]
        results["overlap_summary"] = schedules_overlap.summary(results["overlap"])
        print(_table("overlap (p=2, LlamaModel, whole iterations; iter_s = steady-state seconds per iteration)",
                     [{k: v for k, v in r.items() if k != "rounds_s"} for r in results["overlap"]]))
        print(_table("overlap, ratios", results["overlap_summary"]))
    if "overlap-synthetic" in modes:
        results["overlap_synthetic"] = run_distributed(schedules_overlap.synthetic_worker, 4, args.synthetic_m,
                                                       args.sleep_ms / 1e3, args.overlap_rounds,
                                                       args.overlap_iters, timeout=900)[0]
        print(_table(f"overlap-synthetic (p=4, m={args.synthetic_m}, F=B=W={args.sleep_ms:g} ms)",
                     [{k: v for k, v in r.items() if k != "rounds_s"} for r in results["overlap_synthetic"]]))


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--modes", default="simulated,planning,synthetic,real,overlap,overlap-synthetic",
                        help="comma list of simulated, planning, synthetic, real, overlap, overlap-synthetic")
    parser.add_argument("--overlap-rounds", type=int, default=7, help="overlap modes: timed rounds")
    parser.add_argument("--overlap-iters", type=int, default=6,
                        help="overlap modes: consecutive iterations per round (steady state over the last K-1)")
    parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "bench_schedules.json"))
    parser.add_argument("--steps", type=int, default=9, help="synthetic mode: timed rounds over all schedules "
                        "(after one warm-up step each; two for auto and zb-h2, which profile first)")
    parser.add_argument("--real-rounds", type=int, default=7, help="real mode: timed rounds over all schedules")
    parser.add_argument("--release-host-memory", dest="keep_host_memory", action="store_false",
                        help="real mode: leave glibc malloc's defaults (trim freed memory) as they are")
    parser.add_argument("--no-pin", dest="pin", action="store_false", help="real mode: do not pin rank r to core r")
    parser.add_argument("--sleep-ms", type=float, default=20.0, help="synthetic F = B = W time per stage")
    parser.add_argument("--synthetic-m", type=int, default=16)
    parser.add_argument("--real-m", type=int, nargs="+", default=[4, 8])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--batch", type=int, default=2)
    args = parser.parse_args(argv)
    from benchmarks.launch import run_distributed
    modes, results = args.modes.split(","), {"args": vars(args)}
    if "simulated" in modes:
        results["simulated"] = simulated()
        print(_table("simulated (p=4; F=B=W=1 per stage)", results["simulated"]))
    if "planning" in modes:
        results["planning"] = planning()
        print(_table("planning (auto, the paper's 28.3B setting)", results["planning"]))
    if "synthetic" in modes:
        results["synthetic"] = run_distributed(synthetic_worker, 4, args.synthetic_m, args.sleep_ms / 1e3,
                                               args.steps, timeout=900)[0]
        print(_table(f"synthetic (p=4, m={args.synthetic_m}, F=B=W={args.sleep_ms:g} ms)",
                     [{k: v for k, v in r.items() if k != "rounds_s"} for r in results["synthetic"]]))
    if "real" in modes:
        results["real"] = run_distributed(real_worker, 2, args, timeout=1800)[0]
        results["real_summary"] = summary(results["real"])
        print(_table("real (p=2, LlamaModel, one thread per rank)",
                     [{k: v for k, v in r.items() if k != "rounds_s"} for r in results["real"]]))
        print(_table("real, ratios", results["real_summary"]))
    _overlap_modes(args, modes, results)
    write_json(args.out, results, indent=1)
    return results


if __name__ == "__main__":
    main()

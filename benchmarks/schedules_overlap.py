"""Overlap mode of bench_schedules.py: whole training iterations (forward-backward, gradient finalisation and
the optimizer step) run back to back, with and without --enable-optimizer-post-validation.

A synchronous step ends every iteration with a barrier over the pipeline (the global grad norm), so each
iteration pays the pipeline fill again; with post-validation a rank starts the next iteration as soon as its
own update is done. Measured: the steady-state time per iteration, (end of iteration K - end of iteration 1)
/ (K - 1) on each rank, MAX over the ranks, and each rank's main-thread CPU seconds per iteration (`busy`,
compute plus the runtime's own work: the ideal for this machine). Each round runs K iterations of every
variant in turn (round-robin, so a slow spell of the machine lands on all alike); the pending step is
resolved after the timed window. Clipping is set so that it never triggers (--clip-grad 1e6): the
iteration-to-iteration overlap is what is measured, not rollbacks.
  real       p=2 gloo ranks, one thread and one core each, the small LlamaModel of the real mode: zbv, zb-h2
             and auto with and without post-validation, our 1F1B, torch.distributed.pipelining's
             ScheduleZBVZeroBubble followed by the same synchronous optimizer step;
  synthetic  p=4, m=16, F=B=W sleeping 20 ms per stage: zb-h2 and auto with and without post-validation
             against one rank's work (m (F + B + W)).
"""
from __future__ import annotations

import dataclasses
import itertools
import os
import statistics
import time
from typing import Callable, Optional

import torch
import torch.distributed as dist

from llamapipe.core.config import OptimizerConfig
from llamapipe.core.distributed.grad_reduce import finalize_model_grads
from llamapipe.core.optimizer import build_optimizer

OPT = OptimizerConfig(lr=1e-5, clip_grad=1e6)


class TrainIteration:
    """One training iteration of a schedule on its chunks: zero grads, forward-backward, finalise (divide by the
    token count), optimizer step; under post-validation the step is resolved after the next forward-backward."""

    def __init__(self, chunks: list, ps, forward_backward: Callable[[], list], tokens: float,
                 post_validation: bool) -> None:
        self.chunks, self.ps, self.forward_backward, self.tokens = chunks, ps, forward_backward, tokens
        self.optimizer = build_optimizer([torch.nn.ModuleList(chunks)], OPT, ps)   # unique names per chunk
        self.post_validation, self.pending = post_validation, None

    def __call__(self) -> None:
        opt = self.optimizer
        opt.zero_grad()
        losses = self.forward_backward()
        self.drain()
        finalize_model_grads(self.chunks, self.ps, None, global_tokens=self.tokens)
        if not self.post_validation:
            opt.step()
            return
        loss_sum = float(sum(float(out["loss_sum"]) for out in losses))
        pending = opt.begin_post_validated_step(loss_sum, self.tokens if losses else 0.0)
        if pending.speculated:
            self.pending = pending
        else:
            opt.resolve_post_validated_step(pending)

    def drain(self) -> None:
        if self.pending is not None:
            self.optimizer.resolve_post_validated_step(self.pending)
            self.pending = None


def timed_iterations(ps, runs: dict, rounds: int, k: int) -> tuple[dict, dict]:
    """({name: steady-state seconds per iteration of each round, MAX over ranks}, {name: [median main-thread
    CPU seconds per iteration of each rank]})."""
    steady = torch.zeros(len(runs), rounds, dtype=torch.float64)
    busy = torch.zeros(len(runs), rounds, dtype=torch.float64)
    for r in range(rounds):
        for i, run in enumerate(runs.values()):
            dist.barrier(group=ps.pp_group)
            ends, cpu = [], time.thread_time()
            for _ in range(k):
                run()
                ends.append(time.perf_counter())
            busy[i, r] = (time.thread_time() - cpu) / k
            run.drain()
            steady[i, r] = (ends[-1] - ends[0]) / (k - 1)
    dist.barrier(group=ps.pp_group)
    dist.all_reduce(steady, op=dist.ReduceOp.MAX, group=ps.pp_group)
    medians = torch.tensor([statistics.median(row) for row in busy.tolist()], dtype=torch.float64)
    gathered = [torch.zeros_like(medians) for _ in range(ps.pp_size)]
    dist.all_gather(gathered, medians, group=ps.pp_group)
    return ({n: steady[i].tolist() for i, n in enumerate(runs)},
            {n: [float(g[i]) for g in gathered] for i, n in enumerate(runs)})


def _ours(config, ps0, name: str, vpp: int, m: int, batches: list, tokens: float, pv: bool) -> TrainIteration:
    from benchmarks.schedules_real import llama_chunks, loss_step
    from llamapipe.core.pipeline_parallel.runtime import RuntimeOptions
    from llamapipe.core.pipeline_parallel.schedules import get_forward_backward_func
    ps = dataclasses.replace(ps0, vpp_size=vpp)
    chunks = llama_chunks(config, ps, name, vpp)
    fb = get_forward_backward_func(ps, name, options=RuntimeOptions(profile_iters=1, post_validation=pv))
    run = (lambda: fb(forward_step_func=loss_step, data_iterator=[itertools.cycle(batches) for _ in chunks],
                      model=chunks, num_microbatches=m))
    return TrainIteration(chunks, ps, run, tokens, pv)


def _torch_zbv(config, ps, m: int, batches: list, tokens: float) -> TrainIteration:
    """torch's ScheduleZBVZeroBubble step, then the same synchronous optimizer step on its chunks."""
    from benchmarks.torch_adapter import torch_step
    step = torch_step(config, ps, "torch-zbv", m, torch.cat([b["input_ids"] for b in batches]),
                       torch.cat([b["labels"] for b in batches]))
    return TrainIteration(step.chunks, ps, lambda: [{"loss_sum": x} for x in step()], tokens, False)


def real_worker(rank: int, world: int, args) -> list[dict]:
    from benchmarks.schedules_real import llama_config
    from llamapipe.core.parallel_state import initialize_model_parallel
    torch.set_num_threads(1)
    if args.pin and len(os.sched_getaffinity(0)) >= world:
        os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[rank]})
    ps0, config, rows = initialize_model_parallel(1, world), llama_config(args), []
    for m in args.real_m:
        g = torch.Generator().manual_seed(m)
        batches = [{"input_ids": torch.randint(0, 1024, (args.batch, args.seq), generator=g),
                    "labels": torch.randint(0, 1024, (args.batch, args.seq), generator=g)} for _ in range(m)]
        tokens = float(m * args.batch * args.seq)
        runs = {"1f1b": _ours(config, ps0, "1f1b", 1, m, batches, tokens, False)}
        for name, vpp in (("zbv", 2), ("zb-h2", 1), ("auto", 2)):
            runs[name] = _ours(config, ps0, name, vpp, m, batches, tokens, False)
            runs[name + "+pv"] = _ours(config, ps0, name, vpp, m, batches, tokens, True)
        runs["torch-zbv"] = _torch_zbv(config, ps0, m, batches, tokens)
        for run in runs.values():          # warm-up: auto and zb-h2 profile here and switch
            for _ in range(2):
                run()
            run.drain()
        steady, busy = timed_iterations(ps0, runs, args.overlap_rounds, args.overlap_iters)
        rows += [{"schedule": n, "m": m, "iter_s": statistics.median(s), "busy_s": busy[n], "rounds_s": s}
                 for n, s in steady.items()]
    return rows


def synthetic_worker(rank: int, world: int, m: int, sleep_s: float, rounds: int, k: int) -> list[dict]:
    from benchmarks.bench_schedules import SleepChunk, _calibrate_sleep
    from benchmarks.schedules_real import loss_step
    from llamapipe.core.parallel_state import initialize_model_parallel
    from llamapipe.core.pipeline_parallel.runtime import RuntimeOptions
    from llamapipe.core.pipeline_parallel.schedule_ir import stage_of
    from llamapipe.core.pipeline_parallel.schedule_specs import SPECS
    from llamapipe.core.pipeline_parallel.schedules import get_forward_backward_func
    ps0, x = initialize_model_parallel(1, world), torch.randn(64, 2, 32)
    _calibrate_sleep()
    runs = {}
    for (name, vpp), pv in itertools.product((("zb-h2", 1), ("auto", 2)), (False, True)):
        ps = dataclasses.replace(ps0, vpp_size=vpp)
        stages = [stage_of(ps.pp_rank, c, world, SPECS[name].placement(vpp)) for c in range(vpp)]
        chunks = [SleepChunk((sleep_s / vpp,) * 3, s == world * vpp - 1) for s in stages]
        data = [itertools.repeat({"input_ids": x}) if s == 0 else None for s in stages]
        fb = get_forward_backward_func(ps, name, options=RuntimeOptions(profile_iters=1, post_validation=pv))
        run = (lambda fb=fb, chunks=chunks, data=data: fb(forward_step_func=loss_step, data_iterator=data,
                                                            model=chunks, num_microbatches=m))
        runs[name + ("+pv" if pv else "")] = TrainIteration(chunks, ps, run, 1.0, pv)
    for run in runs.values():
        for _ in range(2):
            run()
        run.drain()
    steady, _ = timed_iterations(ps0, runs, rounds, k)
    work = m * 3 * sleep_s
    return [{"schedule": n, "m": m, "iter_s": statistics.median(s), "one_rank_work_s": work,
             "vs_one_rank_work": statistics.median(s) / work, "rounds_s": s} for n, s in steady.items()]


def summary(rows: list[dict]) -> list[dict]:
    """Per m: each post-validated schedule against its synchronous self, torch's ZB-V and the busiest rank's
    CPU time (medians of per-round ratios: the rounds are interleaved, so pairing cancels slow spells)."""
    out = []
    for m in sorted({r["m"] for r in rows}):
        by = {r["schedule"]: r for r in rows if r["m"] == m}

        def paired(a: str, b: str) -> Optional[float]:
            if a not in by or b not in by:
                return None
            return statistics.median(x / y for x, y in zip(by[a]["rounds_s"], by[b]["rounds_s"]))
        for name, r in by.items():
            out.append({"schedule": name, "m": m, "iter_s": r["iter_s"],
                        "vs_busiest": r["iter_s"] / max(r["busy_s"]),
                        "vs_sync": paired(name, name.removesuffix("+pv")) if name.endswith("+pv") else None,
                        "vs_torch_zbv": paired(name, "torch-zbv"), "vs_our_1f1b": paired(name, "1f1b")})
    return out

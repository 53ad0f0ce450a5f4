"""Pipeline schedules side by side: simulated, synthetic (sleeping stages) and real LLaMA compute.

Why: the runtime must be correct for every schedule *and* faster than 1F1B (zero-bubble paper, Qi et
al., arXiv 2401.10241). Modes:
  simulated  the simulator's makespan / bubble / peak memory table for p=4, m=8 and 16;
  synthetic  p=4 gloo ranks whose F/B/W sleep fixed times while real tensors cross p2p; measured step
             time / simulated makespan shows the runtime's own overhead independently of CPU count;
  real       p=2 ranks, one thread and one core each, a small LlamaModel: step time of every schedule
             (and Megatron's fused-BW 1F1B), the ideal (single-rank step / 2), the busy ideal (both ranks
             run the whole model on half the microbatches at once: the ideal with every core loaded) and
             torch.distributed.pipelining's Schedule1F1B / ScheduleZBVZeroBubble (with its I/W split),
             all timed round-robin in one run.
Prints one table per mode and writes JSON (--out). Example: python benchmarks/bench_schedules.py --modes simulated
"""
from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import os
import statistics
import sys
import time

import torch
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from core.pipeline_parallel import weight_grad_store  # noqa: E402
from core.pipeline_parallel.builders import build  # noqa: E402
from core.pipeline_parallel.schedule_ir import stage_of  # noqa: E402
from core.pipeline_parallel.simulator import Costs, simulate  # noqa: E402

SCHEDULES = [("gpipe", 1), ("1f1b", 1), ("interleaved", 2), ("zb-h1", 1), ("zb-h2", 1), ("zbv", 2), ("auto", 1)]
REAL_SCHEDULES = SCHEDULES[:2] + [("1f1b-fused", 1)] + SCHEDULES[2:]


def _placement(schedule: str, vpp: int) -> str:
    return "v" if schedule in ("zbv", "auto", "torch-zbv") and vpp == 2 else "interleaved"


def chunk_costs(vpp: int, f: float = 1.0, b: float = 1.0, w: float = 1.0) -> Costs:
    """Per-chunk costs when a stage's work (f, b, w, one unit of memory) is split over vpp chunks."""
    return Costs(f=f / vpp, b=b / vpp, w=w / vpp, act_mem=1.0 / vpp, w_mem=0.5 / vpp)


def simulated(pp: int = 4, ms: tuple = (8, 16)) -> list[dict]:
    rows = []
    for m, (name, vpp) in itertools.product(ms, SCHEDULES):
        costs = chunk_costs(vpp)
        res = simulate(build(name, pp, vpp, m, costs=costs), costs)
        rows.append({"schedule": name, "vpp": vpp, "m": m, "makespan": res.makespan,
                     "bubble_rate": res.bubble_rate, "peak_memory": max(res.peak_memory)})
    return rows


_OVERSHOOT = [0.0]          # median time.sleep overshoot of this process, set by _calibrate_sleep


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
    _OVERSHOOT[0] = statistics.median(over)


def _sleep(seconds: float) -> None:
    time.sleep(max(seconds - _OVERSHOOT[0], 0.0))


class _Sleep(torch.autograd.Function):
    """Identity whose forward, input backward and deferred weight backward each sleep a fixed time."""

    @staticmethod
    def forward(ctx, x, weight, times):
        ctx.weight, ctx.times = weight, times
        _sleep(times[0])
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        weight, times = ctx.weight, ctx.times
        _sleep(times[1])

        def weight_grad() -> None:
            _sleep(times[2])
            weight.grad = torch.ones_like(weight) if weight.grad is None else weight.grad + 1

        weight_grad_store.schedule(weight_grad)
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


def _loss_step(data_iterator, model):
    batch = next(data_iterator) if data_iterator is not None else {}
    out = model(**batch)
    return out, lambda o: (o.float().sum(), torch.tensor(o.numel()), {})


def _timed(ps, fn, steps: int) -> float:
    """Median wall time of `steps` calls (after one warm-up), max over the pipeline group."""
    import torch.distributed as dist
    times = []
    for i in range(steps + 1):
        dist.barrier(group=ps.pp_group)
        start = time.perf_counter()
        fn()
        dist.barrier(group=ps.pp_group)
        if i:
            times.append(time.perf_counter() - start)
    t = torch.tensor([statistics.median(times)])
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=ps.pp_group)
    return float(t)


def synthetic_worker(rank: int, world: int, m: int, sleep_s: float, steps: int) -> list[dict]:
    from core.parallel_state import initialize_model_parallel
    from core.pipeline_parallel.schedules import get_forward_backward_func
    from core.pipeline_parallel.p2p_communication import measure_latency
    ps0, rows = initialize_model_parallel(1, world), []
    x = torch.randn(64, 2, 32)
    _calibrate_sleep()
    comm = measure_latency(ps0.pp_rank, ps0.pp_ranks, ps0.pp_group, nbytes=x.numel() * x.element_size(),
                           device=x.device, rounds=50)
    for name, vpp in SCHEDULES:
        ps = dataclasses.replace(ps0, vpp_size=vpp)
        times = (sleep_s / vpp,) * 3
        stages = [stage_of(ps.pp_rank, c, world, _placement(name, vpp)) for c in range(vpp)]
        chunks = [SleepChunk(times, s == world * vpp - 1) for s in stages]
        data = [itertools.repeat({"input_ids": x}) if s == 0 else None for s in stages]
        fb = get_forward_backward_func(ps, name, profile_iters=1)
        step = lambda: fb(forward_step_func=_loss_step, data_iterator=data, model=chunks, num_microbatches=m)  # noqa
        if name in ("auto", "zb-h2"):
            step()                                   # profiling iteration, then the fitted plan is used
        measured = _timed(ps, step, steps)
        plan = fb.plan if name in ("auto", "zb-h2") else build(name, world, vpp, m)
        costs = chunk_costs(vpp, sleep_s, sleep_s, sleep_s)
        predicted = simulate(plan, costs).makespan
        with_comm = simulate(plan, dataclasses.replace(costs, comm=comm)).makespan
        rows.append({"schedule": name, "vpp": vpp, "m": m, "measured_s": measured, "simulated_s": predicted,
                     "ratio": measured / predicted, "comm_ms": comm * 1e3, "sim_comm_s": with_comm,
                     "ratio_comm": measured / with_comm})
    return rows


def _llama_config(args):
    from model.config import LlamaConfig
    return LlamaConfig(num_layers=args.layers, hidden_size=args.hidden, ffn_hidden_size=args.hidden * 11 // 4,
                       num_attention_heads=args.hidden // 32, num_query_groups=args.hidden // 64,
                       vocab_size=1024, max_position_embeddings=args.seq)


def _llama_chunks(config, ps, schedule: str, vpp: int) -> list[nn.Module]:
    from model.llama import LlamaModel
    stages = ps.pp_size * vpp
    per = config.num_layers // stages
    return [LlamaModel(config, ps, layer_range=(s * per, (s + 1) * per), pre_process=s == 0,
                       post_process=s == stages - 1)
            for s in (stage_of(ps.pp_rank, c, ps.pp_size, _placement(schedule, vpp)) for c in range(vpp))]


class _TorchStage(nn.Module):
    """Adapter from our chunk protocol to torch.distributed.pipelining's positional-tensor stages."""

    def __init__(self, chunk: nn.Module) -> None:
        super().__init__()
        self.chunk = chunk

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.chunk.pre_process:
            return self.chunk(input_ids=x)
        self.chunk.set_input_tensor(x)
        return self.chunk()                         # hidden (s, b, h), or logits (b, s, v) on the last stage


class _CapturedWeightGrads:
    """torch's `dw_builder` for our model: torch calls it right after each input backward (I) and runs
    what it returns at the matching W. Our linears queue their weight gradients in `weight_grad_store`,
    so the store captures continuously and each call cuts off the closures of the I that just ran."""

    def __init__(self) -> None:
        self.count = 0

    def start(self) -> None:
        weight_grad_store.begin(("torch-dw", self.count))

    def __call__(self):
        key = weight_grad_store.end()
        self.count += 1
        self.start()
        return lambda: weight_grad_store.run(key)

    def stop(self) -> None:
        assert weight_grad_store.run(weight_grad_store.end()) == 0, "weight gradients left after the step"


def _torch_step(config, ps, name: str, m: int, tokens: torch.Tensor, labels: torch.Tensor):
    """torch.distributed.pipelining's Schedule1F1B, or ScheduleZBVZeroBubble with the real I/W split."""
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleZBVZeroBubble
    vpp = 2 if name == "torch-zbv" else 1
    chunks = _llama_chunks(config, ps, "zbv" if vpp == 2 else "1f1b", vpp)
    dw = _CapturedWeightGrads() if vpp == 2 else None
    stages = [PipelineStage(_TorchStage(c), stage_of(ps.pp_rank, i, ps.pp_size, "v" if vpp == 2 else "interleaved"),
                            ps.pp_size * vpp, torch.device("cpu"), group=ps.pp_group, dw_builder=dw)
              for i, c in enumerate(chunks)]

    def loss_fn(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return logits.float().sum()                 # the same loss as _loss_step (target unused)
    schedule = ScheduleZBVZeroBubble(stages, m, loss_fn=loss_fn) if vpp == 2 else \
        Schedule1F1B(stages[0], m, loss_fn=loss_fn)
    holds_first = any(c.pre_process for c in chunks)
    holds_last = any(c.post_process for c in chunks)

    def step() -> None:
        args = (tokens,) if holds_first else ()
        if dw is not None:
            dw.start()
        try:
            schedule.step(*args, target=labels if holds_last else None)
        finally:
            if dw is not None:
                dw.stop()
    return step


def _timed_rounds(ps, steps: dict, rounds: int) -> dict:
    """Median step time per name, timing the names round-robin so background load hits all alike."""
    import torch.distributed as dist
    times: dict = {name: [] for name in steps}
    for _ in range(rounds):
        for name, step in steps.items():
            dist.barrier(group=ps.pp_group)
            start = time.perf_counter()
            step()
            dist.barrier(group=ps.pp_group)
            times[name].append(time.perf_counter() - start)
    t = torch.tensor([statistics.median(times[name]) for name in steps])
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=ps.pp_group)
    return dict(zip(steps, t.tolist()))


def _our_step(config, ps0, name: str, vpp: int, m: int, batches: list):
    from core.pipeline_parallel import executor
    from core.pipeline_parallel.schedules import cached_plan, get_forward_backward_func
    ps = dataclasses.replace(ps0, vpp_size=vpp)
    chunks = _llama_chunks(config, ps, name, vpp)
    if name == "1f1b-fused":                  # Megatron-LM's 1F1B: a BW sends only after its weight grads
        plan = cached_plan("1f1b", ps.pp_size, 1, m)
        return lambda: executor.run(plan, model_chunks=chunks, forward_step_func=_loss_step,
                                    data_iterator=[iter(batches)], parallel_state=ps, num_microbatches=m,
                                    fused_bw=True)
    fb = get_forward_backward_func(ps, name, profile_iters=1)
    return lambda: fb(forward_step_func=_loss_step, data_iterator=[iter(batches) for _ in chunks], model=chunks,
                      num_microbatches=m)


def _ideal_steps(config, rank: int, world: int, batches: list) -> dict:
    """`single`: rank 0 runs the whole model on every microbatch (the others wait), so ideal = single / p;
    `busy-ideal`: every rank runs the whole model on its 1/p of the microbatches at the same time, with no
    communication: the ideal with every core busy (shared caches and memory bandwidth included)."""
    from model.llama import LlamaModel
    model = LlamaModel(config)

    def run(mine: list) -> None:
        for b in mine:
            model(**b).float().sum().backward()
    return {"single": lambda: run(batches if rank == 0 else []),
            "busy-ideal": lambda: run(batches[rank::world])}


def real_worker(rank: int, world: int, args) -> list[dict]:
    from core.parallel_state import initialize_model_parallel
    torch.set_num_threads(1)
    if args.pin and len(os.sched_getaffinity(0)) >= world:
        os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[rank]})     # one core per rank, no migration
    ps0, config, rows = initialize_model_parallel(1, world), _llama_config(args), []
    for m in args.real_m:
        g = torch.Generator().manual_seed(m)
        batches = [{"input_ids": torch.randint(0, 1024, (args.batch, args.seq), generator=g),
                    "labels": torch.randint(0, 1024, (args.batch, args.seq), generator=g)} for _ in range(m)]
        steps, errors = _ideal_steps(config, rank, world, batches), {}
        steps.update({name: _our_step(config, ps0, name, vpp, m, batches) for name, vpp in REAL_SCHEDULES})
        tokens, labels = torch.cat([b["input_ids"] for b in batches]), torch.cat([b["labels"] for b in batches])
        for name in ("torch-1f1b", "torch-zbv"):
            try:
                steps[name] = _torch_step(config, ps0, name, m, tokens, labels)
                steps[name]()                          # torch infers shapes on its first step
            except Exception as err:  # an API mismatch is a result to report, not a crash
                steps.pop(name)
                errors[name] = f"{type(err).__name__}: {err}"
        for step in steps.values():
            step()                                     # warm-up; `auto` profiles here and switches
        measured = _timed_rounds(ps0, steps, args.real_rounds)
        ideal, busy_ideal = measured.pop("single") / world, measured.pop("busy-ideal")
        rows += [{"schedule": n, "m": m, "step_s": t, "ideal_s": ideal, "busy_ideal_s": busy_ideal}
                 for n, t in measured.items()]
        rows += [{"schedule": n, "m": m, "step_s": None, "ideal_s": ideal, "busy_ideal_s": busy_ideal, "error": e}
                 for n, e in errors.items()]
    return rows


def _table(title: str, rows: list[dict]) -> str:
    keys = list(rows[0]) if rows else []
    fmt = lambda v: f"{v:.4g}" if isinstance(v, float) else str(v)  # noqa: E731
    lines = [title, "  ".join(f"{k:>12}" for k in keys)]
    lines += ["  ".join(f"{fmt(r.get(k)):>12}" for k in keys) for r in rows]
    return "\n".join(lines)


def _summary(real: list[dict]) -> list[dict]:
    """Ratios per m: each schedule vs our 1F1B, vs the ideal, and torch's schedules vs ours."""
    out = []
    for m in sorted({r["m"] for r in real}):
        rows = {r["schedule"]: r for r in real if r["m"] == m}
        base = rows["1f1b"]["step_s"]
        for name, r in rows.items():
            if r["step_s"] is None:
                continue
            out.append({"schedule": name, "m": m, "vs_our_1f1b": r["step_s"] / base,
                        "vs_ideal": r["step_s"] / r["ideal_s"], "vs_busy_ideal": r["step_s"] / r["busy_ideal_s"]})
    return out


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--modes", default="simulated,synthetic,real", help="comma list of simulated, synthetic, real")
    parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "bench_schedules.json"))
    parser.add_argument("--steps", type=int, default=3, help="timed steps per schedule (after one warm-up)")
    parser.add_argument("--real-rounds", type=int, default=7, help="real mode: timed rounds over all schedules")
    parser.add_argument("--no-pin", dest="pin", action="store_false", help="real mode: do not pin rank r to core r")
    parser.add_argument("--sleep-ms", type=float, default=20.0, help="synthetic F = B = W time per stage")
    parser.add_argument("--synthetic-m", type=int, default=16)
    parser.add_argument("--real-m", type=int, nargs="+", default=[4, 8])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--batch", type=int, default=2)
    args = parser.parse_args(argv)
    from tests.harness import run_distributed
    modes, results = args.modes.split(","), {"args": vars(args)}
    if "simulated" in modes:
        results["simulated"] = simulated()
        print(_table("simulated (p=4; F=B=W=1 per stage)", results["simulated"]))
    if "synthetic" in modes:
        results["synthetic"] = run_distributed(synthetic_worker, 4, args.synthetic_m, args.sleep_ms / 1e3,
                                               args.steps, timeout=900)[0]
        print(_table(f"synthetic (p=4, m={args.synthetic_m}, F=B=W={args.sleep_ms:g} ms)", results["synthetic"]))
    if "real" in modes:
        results["real"] = run_distributed(real_worker, 2, args, timeout=1800)[0]
        results["real_summary"] = _summary(results["real"])
        print(_table("real (p=2, LlamaModel, one thread per rank)", results["real"]))
        print(_table("real, ratios", results["real_summary"]))
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(results, f, indent=1)
    print(f"wrote {args.out}")
    return results


if __name__ == "__main__":
    main()

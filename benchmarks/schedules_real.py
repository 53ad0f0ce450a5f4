"""Real-compute mode of bench_schedules.py: p=2 gloo ranks, one thread and one core each, a small LlamaModel.

Every schedule of ours (and Megatron's fused-BW 1F1B), the ideal (single-rank step / 2), the busy ideal
(both ranks run the whole model on half the microbatches at once: the ideal with every core loaded) and
torch.distributed.pipelining's Schedule1F1B / ScheduleZBVZeroBubble (with its I/W split) are timed
round-robin in one run. Torch's last stage returns logits and its `loss_fn` takes the token cross-entropy
(summed), the loss ours computes inside its last stage; the warm-up step checks that both give the same
per-microbatch losses (rel 1e-4). (Ours fuses the cross-entropy into the head, in place on the vocab-parallel
logits; torch's takes it from the (b, s, vocab) logits the stage returns. Runs 1-12 in benchmarks/results gave
torch a cheaper stand-in, the sum of the logits.) Besides step times it records where the time goes:
  busy      main-thread CPU seconds per rank (`time.thread_time`; gloo waits block, so they do not count):
            the busiest rank's compute, including the runtime's own main-thread work, bounds any schedule
            whatever its order, so step / busiest measures idle time only;
  sim       the simulator's makespan for the plan that ran, at the F/B/W/comm costs `auto` profiled,
            over m * (F + B + W): the pipeline fill a perfect runtime on perfectly balanced stages pays;
  faults    main-thread minor page faults per step and rank: memory malloc gave back to the OS and the
            step touched anew (`llamapipe.core.host_memory`; the trainer and this benchmark keep freed memory
            unless --release-host-memory).
"""
from __future__ import annotations

import dataclasses
import os
import statistics
import time

import torch
from torch import nn

from llamapipe.core.host_memory import keep_freed_host_memory, minor_page_faults
from llamapipe.core.pipeline_parallel.schedule_ir import stage_of
from llamapipe.core.pipeline_parallel.schedule_specs import SPECS
from llamapipe.core.pipeline_parallel.simulator import Costs, simulate

SCHEDULES = [(name, spec.default_chunks) for name, spec in SPECS.items()]
REAL_SCHEDULES = SCHEDULES + [("1f1b-fused", 1)]      # Megatron's 1F1B: a BW sends after its weight grads
TORCH_EQUIVALENT = {"1f1b": "torch-1f1b", "zbv": "torch-zbv", "dualpipev": "torch-dualpipev"}


def placement(schedule: str, vpp: int) -> str:
    """From the spec of our schedule, or of ours that Megatron's fused 1F1B or a torch schedule stands for."""
    ours = {theirs: name for name, theirs in TORCH_EQUIVALENT.items()}
    return SPECS[ours.get(schedule, schedule.removesuffix("-fused"))].placement(vpp)


def loss_step(data_iterator, model):
    """Megatron-style forward step: the last stage returns per-token cross-entropy (b, s), summed here."""
    batch = next(data_iterator) if data_iterator is not None else {}
    out = model(**batch)
    return out, lambda o: (o.float().sum(), torch.tensor(o.numel()), {})


def loss_mismatch(ours: list, theirs: list, name: str, rtol: float = 1e-4) -> tuple[float, str]:
    """(largest relative difference between our per-microbatch loss sums and torch's, "" or why they are
    not the same losses: a count that differs, or a difference above `rtol`)."""
    if len(ours) != len(theirs):
        return float("inf"), f"{name}: {len(ours)} microbatch losses from ours, {len(theirs)} from torch"
    worst, why = 0.0, ""
    for mb, (a, b) in enumerate(zip(ours, theirs)):
        a, b = float(a["loss_sum"]), float(b)
        worst = max(worst, abs(a - b) / max(abs(b), 1e-12))
        if abs(a - b) > rtol * abs(b) and not why:
            why = f"{name}: microbatch {mb} loss {a} (ours) vs {b} (torch)"
    return worst, why


def check_same_losses(ours: list, theirs: list, name: str, rtol: float = 1e-4) -> float:
    """`loss_mismatch`'s difference; raises if the two do not compute the same losses."""
    worst, why = loss_mismatch(ours, theirs, name, rtol)
    if why:
        raise AssertionError(why)
    return worst


def llama_config(args):
    from llamapipe.model.llama import LlamaConfig
    return LlamaConfig(num_layers=args.layers, hidden_size=args.hidden, ffn_hidden_size=args.hidden * 11 // 4,
                       num_attention_heads=args.hidden // 32, num_query_groups=args.hidden // 64,
                       vocab_size=1024, max_position_embeddings=args.seq)


def llama_chunks(config, ps, schedule: str, vpp: int) -> list[nn.Module]:
    """This rank's `vpp` chunks of the model, placed as `schedule` places them."""
    from llamapipe.model.llama import LlamaModel
    stages = ps.pp_size * vpp
    per = config.num_layers // stages
    return [LlamaModel(config, ps, layer_range=(s * per, (s + 1) * per), pre_process=s == 0,
                       post_process=s == stages - 1)
            for s in (stage_of(ps.pp_rank, c, ps.pp_size, placement(schedule, vpp)) for c in range(vpp))]


def timed_rounds(ps, steps: dict, rounds: int) -> tuple[dict, dict, dict]:
    """Time the names round-robin, so background load hits all alike. Returns ({name: [step seconds per
    round, MAX over ranks]}, {name: [median main-thread CPU seconds of each rank]}, {name: [median
    main-thread minor page faults per step of each rank]})."""
    import torch.distributed as dist
    wall = torch.zeros(len(steps), rounds, dtype=torch.float64)
    cpu = torch.zeros(len(steps), rounds, dtype=torch.float64)
    faults = torch.zeros(len(steps), rounds, dtype=torch.float64)
    for k in range(rounds):
        for i, step in enumerate(steps.values()):
            dist.barrier(group=ps.pp_group)
            start, start_cpu, start_faults = time.perf_counter(), time.thread_time(), minor_page_faults()
            step()
            cpu[i, k] = time.thread_time() - start_cpu
            faults[i, k] = minor_page_faults() - start_faults
            dist.barrier(group=ps.pp_group)
            wall[i, k] = time.perf_counter() - start
    dist.all_reduce(wall, op=dist.ReduceOp.MAX, group=ps.pp_group)

    def per_rank(samples: torch.Tensor) -> dict:
        gathered = [torch.zeros(len(steps), dtype=torch.float64) for _ in range(ps.pp_size)]
        medians = torch.tensor([statistics.median(row) for row in samples.tolist()], dtype=torch.float64)
        dist.all_gather(gathered, medians, group=ps.pp_group)
        return {n: [float(g[i]) for g in gathered] for i, n in enumerate(steps)}
    return {n: wall[i].tolist() for i, n in enumerate(steps)}, per_rank(cpu), per_rank(faults)


def _our_step(config, ps0, name: str, vpp: int, m: int, batches: list):
    """(step callable, callable giving the plan that runs, the AutoSchedule or None): `auto` and `zb-h2`
    know their plan and costs once they have profiled."""
    from llamapipe.core.pipeline_parallel import executor
    from llamapipe.core.pipeline_parallel.runtime import RuntimeOptions
    from llamapipe.core.pipeline_parallel.schedules import cached_plan, get_forward_backward_func
    ps = dataclasses.replace(ps0, vpp_size=vpp)
    chunks = llama_chunks(config, ps, name, vpp)
    if name == "1f1b-fused":                  # Megatron-LM's 1F1B: a BW sends only after its weight grads
        plan = cached_plan("1f1b", ps.pp_size, 1, m)
        return (lambda: executor.run(plan, model_chunks=chunks, forward_step_func=loss_step,
                                     data_iterator=[iter(batches)], parallel_state=ps, num_microbatches=m,
                                     options=RuntimeOptions(fused_bw=True))), (lambda: plan), None
    fb = get_forward_backward_func(ps, name, options=RuntimeOptions(profile_iters=1))
    profiled = SPECS[name].profiled
    plan = (lambda: fb.plan) if profiled else (lambda: cached_plan(name, ps.pp_size, vpp, m))
    return (lambda: fb(forward_step_func=loss_step, data_iterator=[iter(batches) for _ in chunks], model=chunks,
                       num_microbatches=m)), plan, fb if profiled else None


def _loss_diff(ps, ours: list, theirs: list, name: str) -> float:
    """`loss_mismatch` on the rank that holds the loss, MAX over the pipeline ranks; every rank raises
    together when the losses differ (a raise on one rank alone would leave the other in a collective)."""
    import torch.distributed as dist
    worst, why = loss_mismatch(ours, theirs, name)
    got = torch.tensor([worst, len(theirs), bool(why)], dtype=torch.float64)
    dist.all_reduce(got, op=dist.ReduceOp.MAX, group=ps.pp_group)
    if got[2]:
        raise AssertionError(why or f"{name}: another pipeline rank's losses differ from torch's")
    if got[1] == 0:
        raise AssertionError(f"{name}: no rank returned microbatch losses to compare")
    return float(got[0])


def _ideal_steps(config, rank: int, world: int, batches: list) -> dict:
    """`single`: rank 0 runs the whole model on every microbatch (the others wait), so ideal = single / p;
    `busy-ideal`: every rank runs the whole model on its 1/p of the microbatches at the same time, with no
    communication: the ideal with every core busy (shared caches and memory bandwidth included)."""
    from llamapipe.model.llama import LlamaModel
    model = LlamaModel(config)

    def run(mine: list) -> None:
        for b in mine:
            model(**b).float().sum().backward()
    return {"single": lambda: run(batches if rank == 0 else []),
            "busy-ideal": lambda: run(batches[rank::world])}


def _simulated_fill(plan, vpp: int, stage_costs: Costs, early_send: bool) -> float:
    """Simulated makespan / m (F + B + W) at the profiled per-stage costs, split evenly over the chunks."""
    c = stage_costs
    chunk = Costs(f=c.f / vpp, b=c.b / vpp, w=c.w / vpp, comm=c.comm)
    return simulate(plan, chunk, early_send=early_send).makespan / (plan.num_microbatches * (c.f + c.b + c.w))


def real_worker(rank: int, world: int, args) -> list[dict]:
    from llamapipe.core.parallel_state import initialize_model_parallel
    torch.set_num_threads(1)
    kept = args.keep_host_memory and keep_freed_host_memory()      # as pretrain_llama.py does on CPU
    if args.pin and len(os.sched_getaffinity(0)) >= world:
        os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[rank]})     # one core per rank, no migration
    ps0, config, rows = initialize_model_parallel(1, world), llama_config(args), []
    for m in args.real_m:
        g = torch.Generator().manual_seed(m)
        batches = [{"input_ids": torch.randint(0, 1024, (args.batch, args.seq), generator=g),
                    "labels": torch.randint(0, 1024, (args.batch, args.seq), generator=g)} for _ in range(m)]
        steps, errors, plans, auto = _ideal_steps(config, rank, world, batches), {}, {}, None
        for name, vpp in REAL_SCHEDULES:
            steps[name], plans[name], profiler = _our_step(config, ps0, name, vpp, m, batches)
            auto = profiler if name == "auto" else auto
        tokens, labels = torch.cat([b["input_ids"] for b in batches]), torch.cat([b["labels"] for b in batches])
        from benchmarks.torch_adapter import torch_step     # it imports this module's chunk builder
        for name in TORCH_EQUIVALENT.values():
            try:
                steps[name] = torch_step(config, ps0, name, m, tokens, labels)
                steps[name]()                          # an API mismatch shows on the first step
            except Exception as err:  # an API mismatch is a result to report, not a crash
                steps.pop(name)
                errors[name] = f"{type(err).__name__}: {err}"
        out = {name: step() for name, step in steps.items()}   # warm-up; `auto` profiles here and switches
        loss_diff = {n: _loss_diff(ps0, out[ours], out[n], n) for ours, n in TORCH_EQUIVALENT.items() if n in out}
        wall, busy, faults = timed_rounds(ps0, steps, args.real_rounds)
        ideal = statistics.median(wall.pop("single")) / world
        busy_ideal = statistics.median(wall.pop("busy-ideal"))
        busy.pop("single"), busy.pop("busy-ideal"), faults.pop("single"), faults.pop("busy-ideal")
        for name, times in wall.items():
            row = {"schedule": name, "m": m, "step_s": statistics.median(times), "ideal_s": ideal,
                   "busy_ideal_s": busy_ideal, "busy_s": busy[name], "page_faults": faults[name],
                   "host_memory_kept": kept, "rounds_s": times}
            if name in loss_diff:          # largest relative loss difference to ours (MAX over the ranks)
                row["loss_rel_diff_vs_ours"] = loss_diff[name]
            if name in plans:              # auto profiled F/B/W/comm of one whole stage during warm-up
                row["sim_fill"] = _simulated_fill(plans[name](), dict(REAL_SCHEDULES)[name], auto.costs,
                                                   early_send=name != "1f1b-fused")
            rows.append(row)
        rows += [{"schedule": n, "m": m, "step_s": None, "ideal_s": ideal, "busy_ideal_s": busy_ideal, "error": e}
                 for n, e in errors.items()]
    return rows


def _paired(row: dict, base: dict) -> float:
    """Median over rounds of row's step / base's step in the same round."""
    return statistics.median(ours / theirs for ours, theirs in zip(row["rounds_s"], base["rounds_s"]))


def summary(real: list[dict]) -> list[dict]:
    """Ratios per m: each schedule vs our 1F1B, the ideal and the busy ideal; the busiest rank's compute vs
    the ideal and the step vs that compute (the idle a schedule and runtime add); ours vs our 1F1B and vs
    torch's equivalent also as the median of per-round ratios (rounds are interleaved, so pairing them
    cancels slow spells)."""
    out = []
    for m in sorted({r["m"] for r in real}):
        rows = {r["schedule"]: r for r in real if r["m"] == m and r["step_s"] is not None}
        base = rows["1f1b"]["step_s"]
        for name, r in rows.items():
            busiest = max(r["busy_s"])
            row = {"schedule": name, "m": m, "vs_our_1f1b": r["step_s"] / base, "vs_ideal": r["step_s"] / r["ideal_s"],
                   "vs_busy_ideal": r["step_s"] / r["busy_ideal_s"], "busiest_vs_ideal": busiest / r["ideal_s"],
                   "step_vs_busiest": r["step_s"] / busiest, "sim_fill": r.get("sim_fill")}
            row["vs_our_1f1b_paired"] = _paired(r, rows["1f1b"])
            torch_name = TORCH_EQUIVALENT.get(name)
            if torch_name in rows:
                row["vs_torch_paired"] = _paired(r, rows[torch_name])
            out.append(row)
    return out

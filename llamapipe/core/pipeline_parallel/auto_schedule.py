"""`--pipeline-schedule auto` and `zb-h2`: profile the first iterations, then switch to a cost-fitted plan.

The zero-bubble paper (Qi et al., arXiv 2401.10241, section 3) builds its schedule from measured F, B
and W times under a memory cap. `AutoSchedule` is a stateful forward-backward callable: for the first
`profile_iters` iterations it runs 1F1B with every BW split into B then W, so the three are timed
separately without changing order or memory (with two chunks per rank: ZB-V, auto's V placement).
The first (warm-up, untimed) iteration also measures activation memory (`activation_memory`): the
bytes one microbatch saves on one chunk (the unit) and what a deferred W holds from B until it runs (the
saved inputs still alive plus the output gradients of its closures), as a share of the unit (M_W / M_B).
Then the slowest stage's median times and the largest unit and share (all-reduced MAX over the world, so
every replica sees the same numbers) go to the schedule's builder (`schedule_specs`) on global rank 0:
`auto` under the memory cap (in units, or bytes turned into units; default: what the profiling plan
needs) through `auto_plan`, which minimises the synchronous makespan, or with `post_validation` (the
optimizer steps each stage as soon as its gradients are final, so iterations overlap) the longest stage
span; `zb-h2` under ZB-H2's own cap of 2p-1 microbatches. The options are the job's
`runtime.RuntimeOptions` (profile_iters, memory_limit, memory_limit_bytes, post_validation). The plan is broadcast to all ranks as JSON bytes (no pickle) and used from then on.
"""
from __future__ import annotations

import dataclasses
import json
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
from torch import nn

from llamapipe.core.config import ConfigError
from llamapipe.core.logger import get_logger
from llamapipe.core.pipeline_parallel import builders, executor
from llamapipe.core.pipeline_parallel.activation_memory import ActivationProbe
from llamapipe.core.parallel_state import ParallelState
from llamapipe.core.pipeline_parallel.p2p_communication import measure_latency
from llamapipe.core.pipeline_parallel.profile_costs import costs_from_medians, pass_medians
from llamapipe.core.pipeline_parallel.runtime import ActionTimes, RuntimeOptions
from llamapipe.core.pipeline_parallel.schedule_ir import KIND_SPECS, PASSES, Action, Plan
from llamapipe.core.pipeline_parallel.schedule_specs import SPECS, schedule_spec
from llamapipe.core.pipeline_parallel.simulator import Costs, simulate


def split_bw(plan: Plan) -> Plan:
    """The same plan with every fused BW replaced by B immediately followed by W."""
    actions = tuple(tuple(Action(part, a.chunk, a.microbatch) for a in rank for part in KIND_SPECS[a.kind].parts)
                    for rank in plan.actions)
    return Plan(plan.name + "-split", plan.pp, plan.vpp, plan.num_microbatches, plan.placement, actions)


def profiling_plan(pp: int, vpp: int, m: int) -> Plan:
    """1F1B with B/W split for one chunk; for two chunks ZB-V, which has auto's V placement."""
    return split_bw(builders.one_f_one_b(pp, m)) if vpp == 1 else builders.zbv(pp, m)


def measured_costs(action_times: list, group: Any = None) -> Costs:
    """Median F, B, W seconds of this rank, then the MAX over `group` (the slowest stage bounds the step);
    the medians and the costs come from `profile_costs`, as in `llamapipe profile`."""
    medians = pass_medians(action_times)
    local = torch.tensor([medians[k] for k in PASSES], dtype=torch.float64)
    if dist.is_initialized():
        dist.all_reduce(local, op=dist.ReduceOp.MAX, group=group)
    return costs_from_medians(dict(zip(PASSES, local.tolist())))


def broadcast_plan(plan: Optional[Plan], src: int = 0, group: Any = None) -> Plan:
    """Send `plan` (given on global rank `src`) to every rank of `group` as JSON bytes in a uint8 tensor."""
    if not dist.is_initialized():
        return plan
    payload = json.dumps(plan.to_json()).encode() if dist.get_rank() == src else b""
    size = torch.tensor([len(payload)], dtype=torch.int64)
    dist.broadcast(size, src=src, group=group)
    data = torch.frombuffer(bytearray(payload), dtype=torch.uint8) if payload else \
        torch.empty(int(size), dtype=torch.uint8)
    dist.broadcast(data, src=src, group=group)
    return Plan.from_json(json.loads(bytes(data.tolist()).decode()))


class MemoryLimitError(ConfigError):
    """A byte cap (--pipeline-memory-limit 2GiB) too small for one microbatch on every chunk of a rank."""


class AutoSchedule:
    """Forward-backward callable for a profiled schedule (`auto`, `zb-h2`); `plan` is None while profiling."""

    def __init__(self, parallel_state: ParallelState, variant: str = "auto",
                 options: RuntimeOptions = RuntimeOptions()) -> None:
        self.spec = schedule_spec(variant)
        if not self.spec.profiled:
            profiled = " or ".join(name for name, spec in SPECS.items() if spec.profiled)
            raise ValueError(f"AutoSchedule fits {profiled} to measured costs, not {variant}")
        if options.profile_iters < 1:
            raise ConfigError(f"pipeline_schedule {variant} needs at least 1 profiling iteration, "
                              f"got {options.profile_iters}", "pipeline_schedule")
        self.ps, self.options = parallel_state, options
        self.unit_bytes, self.w_share = 0, 0.5    # measured on the first profiling iteration
        self.plan: Optional[Plan] = None
        self.costs: Optional[Costs] = None
        self._times: list = []
        self._iters = 0
        self._message_bytes = 0         # largest p2p message seen while profiling (sizes the comm probe)
        self._device = torch.device("cpu")

    def __call__(self, *, forward_step_func: Callable, data_iterator: Any, model: list[nn.Module],
                 num_microbatches: int, forward_only: bool = False, loss_scale: float = 1.0) -> list[dict]:
        model = list(model) if isinstance(model, (list, tuple)) else [model]
        pp, vpp, m = self.ps.pp_size, len(model), num_microbatches
        self.spec.check_chunks(vpp)
        profiling = self.plan is None or self.plan.num_microbatches != m
        plan = profiling_plan(pp, vpp, m) if profiling else self.plan
        times = ActionTimes() if profiling and not forward_only else None
        probe = ActivationProbe(model) if times is not None and self._iters == 0 else None
        out = executor.run(plan, model_chunks=model, forward_step_func=forward_step_func,
                           data_iterator=data_iterator, parallel_state=self.ps, num_microbatches=m,
                           forward_only=forward_only, loss_scale=loss_scale, options=self.options.observing(times, probe))
        if probe is not None:
            self.unit_bytes, self.w_share = probe.planning_memory()
        if times is not None:
            numel, dtype = times.largest_send
            self._message_bytes = max(self._message_bytes, numel * dtype.itemsize)
            self._device = next(model[0].parameters()).device
            self._iters += 1
            if self._iters > 1 or self.options.profile_iters == 1:      # the first iteration is warm-up
                self._times += times.times
            if self._iters >= self.options.profile_iters:
                self._switch(pp, vpp, m)
        return out

    def _switch(self, pp: int, vpp: int, m: int) -> None:
        unit, share = self._measured_memory()
        self.costs = dataclasses.replace(measured_costs(self._times), comm=self._comm_latency(), w_mem=share)
        reference = profiling_plan(pp, vpp, m)
        limit = self._memory_limit(reference, unit, vpp) if self.spec.memory_capped else None
        build = not dist.is_initialized() or dist.get_rank() == 0
        self.plan = broadcast_plan(self._build(pp, vpp, m, limit) if build else None)
        chosen, base = simulate(self.plan, self.costs), simulate(reference, self.costs)
        ref, mib = ("1F1B" if vpp == 1 else "ZB-V"), unit / 2 ** 20
        peak = max(chosen.peak_memory)
        cap = "its fixed memory cap" if limit is None else f"memory limit {limit:.3g} units ({limit * mib:.3g} MiB)"
        get_logger().info(
            f"{self.spec.name} schedule: F={self.costs.f * 1e3:.2f} ms B={self.costs.b * 1e3:.2f} ms "
            f"W={self.costs.w * 1e3:.2f} ms comm={self.costs.comm * 1e3:.3f} ms, activations {mib:.3g} MiB per "
            f"unit (W keeps {share:.0%}), {cap} -> "
            f"{self.plan.name}: simulated bubble {chosen.bubble_rate:.1%} ({ref} {base.bubble_rate:.1%}), peak memory "
            f"{peak:.3g} units ({peak * mib:.3g} MiB), makespan {chosen.makespan / base.makespan:.3f}x {ref}, "
            f"longest stage span {max(chosen.span) / max(base.span):.3f}x {ref} (planned for the "
            f"{'span: post-validation' if self.options.post_validation else 'makespan: synchronous step'})")
        self._times, self._iters = [], 0

    def _build(self, pp: int, vpp: int, m: int, limit: Optional[float]) -> Plan:
        """The plan fitted to the measured costs; the memory-capped `auto` within `limit`, and both profiled
        schedules for what the runtime pays (the longest stage span under post-validation)."""
        return self.spec.build(pp, vpp, m, self.costs, limit, post_validation=self.options.post_validation)

    def _memory_limit(self, reference: Plan, unit: int, vpp: int) -> float:
        """The cap in units: a byte cap converted, the units given, or what the profiling plan needs."""
        if self.options.memory_limit_bytes is not None:
            return self._units_of(self.options.memory_limit_bytes, unit, vpp)
        return self.options.memory_limit or max(simulate(reference, self.costs).peak_memory)

    def _measured_memory(self) -> tuple[int, float]:
        """(bytes per unit, W share): this rank's measurement, MAX over the world."""
        packed = torch.tensor([float(self.unit_bytes), self.w_share], dtype=torch.float64)
        if dist.is_initialized():
            dist.all_reduce(packed, op=dist.ReduceOp.MAX)
        return int(packed[0]), float(packed[1])

    def _units_of(self, nbytes: int, unit: int, vpp: int) -> float:
        """A byte cap in units; every rank raises the same error when it cannot hold one microbatch per chunk."""
        units = nbytes / unit if unit > 0 else float("inf")
        if units < vpp:
            raise MemoryLimitError(
                f"pipeline_memory_limit {nbytes / 2 ** 20:.3g} MiB holds {units:.2f} microbatch-chunks of "
                f"activations ({unit / 2 ** 20:.3g} MiB each, measured), but one microbatch on the {vpp} model "
                f"chunk(s) of a rank needs {vpp}", "pipeline_memory_limit")
        return units

    def _comm_latency(self) -> float:
        """One-way p2p time of the largest profiled message (MAX over the world, like the F/B/W times)."""
        if not dist.is_initialized() or self.ps.pp_size < 2:
            return 0.0
        nbytes = torch.tensor([self._message_bytes], dtype=torch.int64)
        dist.all_reduce(nbytes, op=dist.ReduceOp.MAX)
        return measure_latency(self.ps.pp_rank, self.ps.pp_ranks, self.ps.pp_group, nbytes=int(nbytes),
                               device=self._device, reduce_group=dist.group.WORLD)

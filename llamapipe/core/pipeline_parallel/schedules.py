"""Megatron-compatible forward-backward entry points; each builds a plan and hands it to the executor.

Megatron-LM (arXiv 2104.04473) hands out its schedules through `get_forward_backward_func()`; here it
takes every schedule name of `schedule_specs` (1F1B, interleaved, GPipe, the zero-bubble ones of arXiv
2401.10241), and each runs as `executor.run(<builder>(...), ...)`, not as another runtime.
`forward_backward_zero_bubble` runs the fixed unit-cost zero-bubble plans (the profiling `auto` and `zb-h2`
of `get_forward_backward_func` re-plan from measured costs). Both are keyword-only and take `model` as
the list of this rank's chunks (local chunk order).
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable

from torch import nn

from llamapipe.core.parallel_state import ParallelState
from llamapipe.core.pipeline_parallel import executor
from llamapipe.core.pipeline_parallel.auto_schedule import AutoSchedule
from llamapipe.core.pipeline_parallel.runtime import RuntimeOptions
from llamapipe.core.pipeline_parallel.schedule_ir import Action, Plan
from llamapipe.core.pipeline_parallel.schedule_specs import SPECS, build, build_seq, schedule_spec
from llamapipe.core.pipeline_parallel.seq_split import piece_iterators


def no_pipelining_plan(m: int) -> Plan:
    """One rank, one chunk: forward and fused backward per microbatch (grads accumulate)."""
    actions = tuple(a for mb in range(m) for a in (Action("F", 0, mb), Action("BW", 0, mb)))
    return Plan("no-pipelining", 1, 1, m, "interleaved", (actions,))


@functools.lru_cache(maxsize=64)
def cached_plan(schedule: str, pp: int, vpp: int, m: int, seq_splits: int = 1) -> Plan:
    """Builders are pure, so one plan per (schedule, pp, vpp, m, K) is built once per process; K > 1 is Seq1F1B
    (builders_seq.py: m*K sequence pieces as the plan's units)."""
    if seq_splits > 1:
        return build_seq(schedule, pp, vpp, m, seq_splits)
    if pp == 1:
        return no_pipelining_plan(m)
    return build(schedule, pp, vpp, m)


class ForwardBackward:
    """Megatron's forward-backward callable for one fixed schedule, bound to the parallel state and the
    job's runtime options; every call builds (or takes the cached) plan and runs it."""

    def __init__(self, parallel_state: ParallelState, schedule_name: str,
                 options: RuntimeOptions = RuntimeOptions()) -> None:
        self.ps, self.schedule_name, self.options = parallel_state, schedule_name, options

    def __call__(self, *, forward_step_func: Callable, data_iterator: Any, model: list[nn.Module],
                 num_microbatches: int, forward_only: bool = False, loss_scale: float = 1.0) -> list[dict]:
        model = list(model) if isinstance(model, (list, tuple)) else [model]
        splits, options = self.options.seq_splits, self.options
        if splits is not None and splits.count > 1:   # Seq1F1B: the units are the microbatches' pieces
            data_iterator = piece_iterators(data_iterator, splits)
            options = dataclasses.replace(options, variable_seq_lengths=True)   # FLOPs-balanced: lengths differ
            plan = cached_plan(self.schedule_name, self.ps.pp_size, len(model), num_microbatches, splits.count)
            num_microbatches *= splits.count
        else:
            plan = cached_plan(self.schedule_name, self.ps.pp_size, len(model), num_microbatches)
        return executor.run(plan, model_chunks=model, forward_step_func=forward_step_func,
                            data_iterator=data_iterator, parallel_state=self.ps, num_microbatches=num_microbatches,
                            forward_only=forward_only, loss_scale=loss_scale, options=options)


def forward_backward_zero_bubble(*, forward_step_func: Callable, data_iterator: Any, model: list[nn.Module],
                                 num_microbatches: int, parallel_state: ParallelState, variant: str = "zb-h1",
                                 forward_only: bool = False, loss_scale: float = 1.0,
                                 options: RuntimeOptions = RuntimeOptions()) -> list[dict]:
    """Zero-bubble schedules with B/W split: zb-h1, zb-h2, zbv (two chunks per rank, V placement), or
    auto, with unit costs (the profiling `auto` and `zb-h2`, fitted to measured costs, come from
    `get_forward_backward_func(..., "auto" | "zb-h2")`)."""
    if variant not in SPECS or not SPECS[variant].zero_bubble:
        zero_bubble = [name for name, spec in SPECS.items() if spec.zero_bubble]
        raise ValueError(f"zero-bubble variant {variant} is unknown; choose one of {', '.join(zero_bubble)}")
    return ForwardBackward(parallel_state, variant, options)(
        forward_step_func=forward_step_func, data_iterator=data_iterator, model=model,
        num_microbatches=num_microbatches, forward_only=forward_only, loss_scale=loss_scale)


def get_forward_backward_func(parallel_state: ParallelState, schedule_name: str = "1f1b", *,
                              options: RuntimeOptions = RuntimeOptions()) -> Callable[..., list[dict]]:
    """The forward-backward callable for `schedule_name`, bound to `parallel_state` and the job's `options`.

    Returns `fn(*, forward_step_func, data_iterator, model, num_microbatches, forward_only=False,
    loss_scale=1.0)` where `model` is the list of local chunks. Megatron's shape keywords (seq_length,
    micro_batch_size, ...) are not taken: shapes are exchanged at run time, and an unknown keyword is an error.
    A profiled schedule (auto, zb-h2) returns an `AutoSchedule`; with one pipeline stage every schedule runs
    the microbatches one after another.
    """
    spec = schedule_spec(schedule_name)
    if parallel_state.pp_size > 1 and spec.profiled:
        return AutoSchedule(parallel_state, schedule_name, options)
    return ForwardBackward(parallel_state, schedule_name, options)

"""Megatron-compatible forward-backward entry points; each builds a plan and hands it to the executor.

Megatron-LM (arXiv 2104.04473) hands out its schedules through `get_forward_backward_func()`; here it
takes every schedule name of `schedule_specs` (1F1B, interleaved, GPipe, the zero-bubble ones of arXiv
2401.10241), and each runs as `executor.run(<builder>(...), ...)`, not as another runtime.
`forward_backward_zero_bubble` runs the fixed unit-cost zero-bubble plans (the profiling `auto` and `zb-h2`
of `get_forward_backward_func` re-plan from measured costs). Both are keyword-only and take `model` as
the list of this rank's chunks (local chunk order).
"""
from __future__ import annotations

import functools
from typing import Any, Callable

from torch import nn

from llamapipe.core.pipeline_parallel import executor
from llamapipe.core.pipeline_parallel.auto_schedule import AutoOptions, AutoSchedule
from llamapipe.core.pipeline_parallel.schedule_ir import Action, Plan
from llamapipe.core.pipeline_parallel.schedule_specs import SPECS, build, schedule_spec


def no_pipelining_plan(m: int) -> Plan:
    """One rank, one chunk: forward and fused backward per microbatch (grads accumulate)."""
    actions = tuple(a for mb in range(m) for a in (Action("F", 0, mb), Action("BW", 0, mb)))
    return Plan("no-pipelining", 1, 1, m, "interleaved", (actions,))


@functools.lru_cache(maxsize=64)
def cached_plan(schedule: str, pp: int, vpp: int, m: int) -> Plan:
    """Builders are pure, so one plan per (schedule, pp, vpp, m) is built once per process."""
    if pp == 1:
        return no_pipelining_plan(m)
    return build(schedule, pp, vpp, m)


def _run(plan_name: str, *, forward_step_func: Callable, data_iterator: Any, model: list[nn.Module],
         num_microbatches: int, parallel_state, forward_only: bool, loss_scale: float,
         variable_seq_lengths: bool, grad_sync: Any = None) -> list[dict]:
    model = model if isinstance(model, (list, tuple)) else [model]
    plan = cached_plan(plan_name, parallel_state.pp_size, len(model), num_microbatches)
    return executor.run(plan, model_chunks=list(model), forward_step_func=forward_step_func,
                        data_iterator=data_iterator, parallel_state=parallel_state,
                        num_microbatches=num_microbatches, forward_only=forward_only, loss_scale=loss_scale,
                        variable_seq_lengths=variable_seq_lengths, grad_sync=grad_sync)


def forward_backward_zero_bubble(*, forward_step_func: Callable, data_iterator: Any, model: list[nn.Module],
                                 num_microbatches: int, parallel_state, variant: str = "zb-h1",
                                 forward_only: bool = False, loss_scale: float = 1.0,
                                 variable_seq_lengths: bool = False, grad_sync: Any = None) -> list[dict]:
    """Zero-bubble schedules with B/W split: zb-h1, zb-h2, zbv (two chunks per rank, V placement), or
    auto, with unit costs (the profiling `auto` and `zb-h2`, fitted to measured costs, come from
    `get_forward_backward_func(..., "auto" | "zb-h2")`)."""
    if variant not in SPECS or not SPECS[variant].zero_bubble:
        zero_bubble = [name for name, spec in SPECS.items() if spec.zero_bubble]
        raise ValueError(f"zero-bubble variant {variant} is unknown; choose one of {', '.join(zero_bubble)}")
    kwargs = dict(locals())
    del kwargs["variant"]
    return _run(variant, **kwargs)


def get_forward_backward_func(parallel_state, schedule_name: str = "1f1b", *,
                              options: AutoOptions = AutoOptions()) -> Callable[..., list[dict]]:
    """The forward-backward callable for `schedule_name`, bound to `parallel_state`.

    Returns `fn(*, forward_step_func, data_iterator, model, num_microbatches, forward_only=False,
    loss_scale=1.0, variable_seq_lengths=False, grad_sync=None, **ignored)` where `model` is the list of
    local chunks and `grad_sync` a `core.distributed.grad_sync.GradSync` for --overlap-grad-reduce;
    Megatron's extra keywords (seq_length, micro_batch_size, ...) are accepted and ignored because
    shapes are exchanged at run time. A profiled schedule (auto, zb-h2) returns an `AutoSchedule`, which
    reads `options`; with one pipeline stage every schedule runs the microbatches one after another.
    """
    spec = schedule_spec(schedule_name)
    if parallel_state.pp_size > 1 and spec.profiled:
        return AutoSchedule(parallel_state, schedule_name, options)

    def forward_backward(*, forward_step_func: Callable, data_iterator: Any, model: list[nn.Module],
                         num_microbatches: int, forward_only: bool = False, loss_scale: float = 1.0,
                         variable_seq_lengths: bool = False, grad_sync: Any = None, **ignored: Any) -> list[dict]:
        return _run(schedule_name, forward_step_func=forward_step_func, data_iterator=data_iterator, model=model,
                    num_microbatches=num_microbatches, parallel_state=parallel_state,
                    forward_only=forward_only, loss_scale=loss_scale, variable_seq_lengths=variable_seq_lengths,
                    grad_sync=grad_sync)
    return forward_backward

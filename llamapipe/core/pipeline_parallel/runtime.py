"""One job's runtime options, built once in setup and handed unchanged from the loop to the executor.

Megatron carries its step hooks and timers on one config object (`ModelParallelConfig`: `grad_sync_func`,
`timers`, ...); here `RuntimeOptions` is that object for the pipeline runtime: what every forward-backward
of the job needs besides the per-call inputs of Megatron's entry point (`forward_step_func`,
`data_iterator`, `model`, `num_microbatches`, `forward_only`, `loss_scale`). A new runtime feature is a
field here plus the code that uses it; an unknown option is a TypeError when the object is built (a frozen
dataclass), never a keyword silently dropped on one of the paths.

Everything that watches a step (per-rank timers, the pipeline trace, the profiled schedules' action times,
the activation probe) is a `StepObserver`: the executor calls each observer's hooks in the same places, so
a new watcher is one subclass and one entry in `observers`, not another optional argument of `run`.
"""
from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any, Callable, Hashable, Iterable, Optional, Protocol

import torch
from torch import nn

if TYPE_CHECKING:
    from llamapipe.core.pipeline_parallel.offload_plan import OffloadOptions
    from llamapipe.core.pipeline_parallel.schedule_ir import Action, Plan
    from llamapipe.core.tensor_parallel.weight_grad_store import WeightGradStore


class StepObserver:
    """Watches one rank's forward-backward steps. Every hook is a no-op here; a subclass overrides what it
    watches. Times are `time.perf_counter()` seconds. `overhead_s` is the time the observer itself spent inside
    actions (measuring), which the executor keeps out of every action's compute time."""

    overhead_s: float = 0.0

    def step_begin(self, plan: "Plan", pp_rank: int, forward_only: bool) -> None:
        """Before this rank's first action of a step of `plan`."""

    def action_begin(self, action: "Action") -> None:
        """Before `action` runs (after the previous action's `action_done`)."""

    def action_done(self, action: "Action", start: float, end: float, blocked_s: float) -> None:
        """After `action` ran from `start` to `end`, `blocked_s` of it waiting for messages (and measuring)."""

    def comm_begin(self, what: str) -> None:
        """Before a communication call between actions (`what` as in `comm_done`)."""

    def comm_done(self, what: str, start: float, end: float) -> None:
        """After a communication call between actions (`what`: "post" the receives ahead and issue the
        queued sends; "finish": wait for every send at the step's end), from `start` to `end`."""

    def message_sent(self, msg: Any, when: float) -> None:
        """`msg` (a `p2p_communication.Message` to another rank) was handed to the communicator at `when`."""

    def message_waiting(self, msg: Any) -> None:
        """This rank blocks until `msg` from another rank has arrived (`message_received` follows)."""

    def message_received(self, msg: Any, when: float) -> None:
        """`msg` from another rank had arrived at `when` (the end of the wait for it)."""

    def phase_done(self, what: str, start: float, end: float, blocked_s: float) -> None:
        """After work of the step that is not an action of the plan: "embed" (the vocabulary-parallel
        embedding before the first action) and "embed-backward" (its backward after the last)."""

    def forward_done(self, key: Hashable, output: torch.Tensor) -> None:
        """After the forward of `key` = (chunk, microbatch); `output` is its output or scaled loss."""

    def backward_done(self, key: Hashable, split: bool, held: Iterable[torch.Tensor] = ()) -> None:
        """After the B (`split`: W still to come) or the fused BW of `key`; `held`: what its W keeps alive."""

    def step_end(self, largest_send: tuple[int, torch.dtype]) -> None:
        """After the step; `largest_send` is (numel, dtype) of this rank's largest message."""

    def offload_begin(self, store: Any) -> None:
        """The step offloads activations through `store` (an `offload_store.OffloadStore`)."""


class ForwardBackwardFunc(Protocol):
    """Megatron's forward-backward entry point (`schedules.get_forward_backward_func`): keyword-only, `model`
    the list of this rank's chunks; returns the last stage's per-microbatch loss dicts (else [])."""

    def __call__(self, *, forward_step_func: Callable, data_iterator: Any, model: list[nn.Module],
                 num_microbatches: int, forward_only: bool = False, loss_scale: float = 1.0) -> list[dict]: ...


class GradSyncHooks(Protocol):
    """What the executor tells a data-parallel gradient synchroniser (`core.distributed.grad_sync.GradSync`,
    --overlap-grad-reduce) so it can start all-reduces during the backward."""

    def begin_step(self, store: "WeightGradStore") -> None: ...
    def arm(self, chunk: int) -> None: ...
    def disarm(self) -> None: ...
    def chunk_done(self, chunk: int, last_action: bool) -> None: ...
    def last_action(self) -> None: ...
    def end_step(self) -> None: ...
    def abort(self) -> None: ...


@dataclasses.dataclass(frozen=True)
class RuntimeOptions:
    """What every forward-backward of one job needs besides its per-call inputs.

    The profiled schedules (`auto`, `zb-h2`) read `profile_iters`, `memory_limit`/`memory_limit_bytes` and
    `post_validation`; the executor reads the rest.
    """
    grad_sync: Optional[GradSyncHooks] = None   # DP all-reduces launched during the backward
    fused_bw: bool = False              # send a BW's input gradient after its W (Megatron's order; baselines)
    variable_seq_lengths: bool = False  # message shapes may change within a step (a header per message)
    observers: tuple[StepObserver, ...] = ()    # timers, the pipeline trace, ... (called on every step)
    profile_iters: int = 3              # profiled schedules: iterations profiled before switching (first: warm-up)
    memory_limit: Optional[float] = None        # auto: activation units per rank (None: the profiling plan's)
    memory_limit_bytes: Optional[int] = None    # auto: a byte cap instead, turned into units once measured
    post_validation: bool = False       # auto: iterations overlap (optimizer post-validation), so plan for the
                                        # longest stage span instead of the synchronous makespan
    communicator: Optional[Callable[..., Any]] = None   # builds each step's communicator in place of
                                        # p2p_communication.P2PCommunicator (same arguments): the dry run's
    offload: Optional["OffloadOptions"] = None   # PipeOffload: O/R actions added to every plan (offload_plan)

    def __post_init__(self) -> None:
        assert all(isinstance(o, StepObserver) for o in self.observers), self.observers

    def observing(self, *extra: Optional[StepObserver]) -> "RuntimeOptions":
        """These options with `extra` observers (None entries left out) after the job's own."""
        added = tuple(o for o in extra if o is not None)
        return dataclasses.replace(self, observers=self.observers + added) if added else self


class ActionTimes(StepObserver):
    """(action, compute seconds without message waits) of every action: what the profiled schedules fit
    their costs to. Forward-only steps are not recorded."""

    def __init__(self) -> None:
        self.times: list[tuple["Action", float]] = []
        self.largest_send: tuple[int, torch.dtype] = (0, torch.float32)
        self._recording = False

    def step_begin(self, plan: "Plan", pp_rank: int, forward_only: bool) -> None:
        self._recording = not forward_only

    def action_done(self, action: "Action", start: float, end: float, blocked_s: float) -> None:
        if self._recording:
            self.times.append((action, end - start - blocked_s))

    def step_end(self, largest_send: tuple[int, torch.dtype]) -> None:
        self.largest_send = largest_send

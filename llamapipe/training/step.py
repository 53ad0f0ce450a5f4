"""One training step: forward-backward, gradient reduction, the optimizer's decision, and its records.

The loop calls `run()` of one step object per iteration. `SynchronousStep` is the plain step: the
forward-backward of one global batch, the gradients reduced over TP/DP and divided by the global token
count, then `Optimizer.step`, whose global norm and inf/NaN check make the step a barrier over the pipeline.
The other form, `training/post_validated.PostValidatedStep` (--enable-optimizer-post-validation), learns
the decision one iteration later; both share everything else here: the forward-backward
(`forward_backward`), the gradient reduction (`finalize_grads`), the skip/stop decision and the records
(`conclude`), so a step logs, skips and stops alike in both forms.

The decision is named by an action of `core/optimizer/post_validation.Resolution`: "apply" or "clip" (the
update stands), "nonfinite_loss" (stop, or skip under --skip-nonfinite-steps), "found_inf" (fp16 overflow:
skipped, the loss scale shrinks) and "nonfinite_norm" (stop, or skip under fp16/--skip-nonfinite-steps).
Every iteration gets one metrics record, a skipped one too (`record_skip`).
"""
from __future__ import annotations

import math
import time
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.distributed as dist

from llamapipe.core.distributed.grad_sync import GradSync
from llamapipe.core.logger import get_logger
from llamapipe.core.num_microbatches_calculator import ConstantNumMicroBatchesCalculator
from llamapipe.core.optimizer import Optimizer, OptimizerParamScheduler
from llamapipe.core.parallel_state import ParallelState
from llamapipe.core.pipeline_parallel.position import waiting
from llamapipe.core.pipeline_parallel.runtime import ForwardBackwardFunc
from llamapipe.core.pipeline_parallel.step_timers import StepTimers
from llamapipe.training.config import Config
from llamapipe.training.flag_names import as_flags
from llamapipe.training.hang_watch import HangWatch, hang_region
from llamapipe.training.log import num_zeros_in_grad, params_norm
from llamapipe.training.progress import TrainingProgress
from llamapipe.training.setup import forward_step

log = get_logger()

APPLIED = ("apply", "clip")     # the actions whose update stands


@dataclass
class TrainState:
    iteration: int = 0
    consumed_samples: int = 0
    skipped_iterations: int = 0
    start_time: float = field(default_factory=time.time)


@dataclass
class StepParts:
    """What a training step works on; the Trainer builds them once."""
    config: Config
    ps: ParallelState
    chunks: list
    optimizer: Optimizer
    scheduler: OptimizerParamScheduler
    batches: ConstantNumMicroBatchesCalculator      # the microbatch count per step (batch ramp-up)
    fb_func: ForwardBackwardFunc    # the schedule's forward-backward, bound to the job's RuntimeOptions
    grad_sync: Optional[GradSync]   # under --overlap-grad-reduce (the same object as the RuntimeOptions')
    progress: TrainingProgress
    state: TrainState
    timers: Optional[StepTimers] = None     # --timing-log-level 1 and 2 (also an observer of the executor)
    hang: Optional[HangWatch] = None        # --hang-report-seconds (its position also observes the executor)


@dataclass
class IterationRecord:
    """What the metrics record of one iteration needs besides the loss and the norm."""
    iteration: int
    consumed_samples: int
    global_batch_size: int
    seconds: float
    extra: dict


def run_schedule(parts: StepParts, iterators: list, *, forward_only: bool, num_microbatches: int,
                 reduce_pp: bool = True) -> tuple[float, float]:
    """One global batch through the pipeline; returns (loss sum, token count) reduced over DP and, unless
    `reduce_pp` is False, PP (then ranks without the loss, and TP ranks other than 0, return zeros)."""
    ps = parts.ps
    scale = 1.0 if forward_only else parts.optimizer.get_loss_scale()
    losses = parts.fb_func(forward_step_func=forward_step, data_iterator=iterators, model=parts.chunks,
                           num_microbatches=num_microbatches, forward_only=forward_only, loss_scale=scale)
    totals = torch.zeros(2, dtype=torch.float64)
    for out in losses:
        totals[0] += float(out["loss_sum"])
        totals[1] += float(out["num_tokens"])
    for group, size, ranks in ((ps.dp_cp_group, ps.dp_cp_size, ps.dp_cp_ranks),
                               (ps.pp_group, ps.pp_size, ps.pp_ranks)):
        if size > 1 and (reduce_pp or group is ps.dp_cp_group):
            with waiting("the loss reduction", ranks, collective=True):
                dist.all_reduce(totals, group=group)
    if not reduce_pp and ps.tp_rank != 0:
        totals.zero_()
    return totals[0].item(), totals[1].item()


class SynchronousStep:
    """The training step that decides before the next iteration starts (no --enable-optimizer-post-validation)."""

    overlapped = False      # whether iterations overlap, so that global points must `drain` first

    def __init__(self, parts: StepParts, train_iters: list) -> None:
        self.parts, self.iterators = parts, train_iters
        self._overlap_logged = False

    def run(self) -> Optional[int]:
        """One optimizer step; returns an exit status when the run must stop."""
        p, st = self.parts, self.parts.state
        start = time.perf_counter()
        global_batch_size, num_microbatches = self.begin()
        loss_sum, tokens = self.forward_backward(self.iterators, num_microbatches)
        loss = loss_sum / max(tokens, 1.0)
        self.advance(global_batch_size)
        extra: dict = {}
        if not math.isfinite(loss) and not p.config.optimizer.fp16:
            action, grad_norm = "nonfinite_loss", float("nan")
        else:
            extra = self.finalize_grads(tokens)
            with self.region("optimizer"), hang_region(p.hang, "optimizer", "the optimizer step",
                                                       range(p.ps.world_size)):    # its norm and ZeRO collectives
                result = p.optimizer.step()
            grad_norm = result.grad_norm
            action = "apply" if result.update_successful else "found_inf" if result.found_inf else "nonfinite_norm"
        if action not in APPLIED:
            if p.grad_sync is not None:
                p.grad_sync.discard()    # buckets started during the backward: wait, then drop them
            p.optimizer.zero_grad()
        record = IterationRecord(st.iteration, st.consumed_samples, global_batch_size,
                                 time.perf_counter() - start, extra)
        self.mark()
        return self.conclude(record, action, loss, grad_norm)

    def region(self, name: str):
        """Time a part of the step under `name` when the timers are on (`step_timers.StepTimers.region`)."""
        return self.parts.timers.region(name) if self.parts.timers is not None else nullcontext()

    def mark(self) -> None:
        """Where an iteration ends for the timers."""
        if self.parts.timers is not None:
            self.parts.timers.mark()

    def drain(self) -> Optional[int]:
        """Settle what is pending before a global point (save, evaluation, exit, end): nothing here."""
        return None

    def summary(self) -> Optional[str]:
        return None

    def begin(self) -> tuple[int, int]:
        """(global batch size, microbatches) of the step that starts now (they change under batch ramp-up)."""
        batches = self.parts.batches
        batches.update(self.parts.state.consumed_samples)
        return batches.get_current_global_batch_size(), batches.get()

    def forward_backward(self, iterators: list, num_microbatches: int, reduce_pp: bool = True) -> tuple[float, float]:
        self.parts.optimizer.zero_grad()
        return run_schedule(self.parts, iterators, forward_only=False, num_microbatches=num_microbatches,
                            reduce_pp=reduce_pp)

    def advance(self, global_batch_size: int) -> None:
        self.parts.state.iteration += 1
        self.parts.state.consumed_samples += global_batch_size

    def finalize_grads(self, global_tokens: float) -> dict:
        """Reduce the gradients over TP/DP and divide them by `global_tokens`; the extra metrics they give."""
        from llamapipe.core.distributed.grad_reduce import finalize_model_grads
        p = self.parts
        with self.region("all-grads-sync"), hang_region(p.hang, "grad-reduce", "the gradient reduction",
                                                        p.ps.dp_cp_ranks):
            finalize_model_grads(p.chunks, p.ps, None, global_tokens=global_tokens,    # overlap: grad_sync
                                 bucket_size=p.config.parallel.ddp_bucket_size, grad_sync=p.grad_sync)
        if p.grad_sync is not None and not self._overlap_logged:
            self._overlap_logged = True
            log.info(as_flags(p.grad_sync.summary(), ["overlap_grad_reduce"]))
        extra = {}
        if p.config.logging.log_num_zeros_in_grad:   # the reduced gradients the optimizer is about to use
            extra["num_zeros_in_grad"] = num_zeros_in_grad(p.chunks, p.ps)
        return extra

    def conclude(self, record: IterationRecord, action: str, loss: float, grad_norm: float) -> Optional[int]:
        """Stop, skip or log the step the optimizer decided on (`action`); an exit status when the run stops."""
        p = self.parts
        fp16, skip = p.config.optimizer.fp16, p.config.training.skip_nonfinite_steps
        if action == "nonfinite_loss" and not skip:
            log.error(f"iteration {record.iteration}: lm loss is {loss}; stopping before applying the update "
                      "(pass --skip-nonfinite-steps to skip such steps instead)")
            return 1
        if action == "nonfinite_norm" and not fp16 and not skip:
            log.error(f"iteration {record.iteration}: gradient norm is not finite; the update was not applied "
                      "(pass --skip-nonfinite-steps to skip such steps instead)")
            return 1
        if action == "nonfinite_loss":
            self.record_skip(record, f"lm loss is {loss}")
        elif action not in APPLIED:
            self.record_skip(record, f"inf/nan in gradients (loss scale now {p.optimizer.get_loss_scale():g})")
        else:
            p.scheduler.step(record.global_batch_size if p.scheduler.counts_samples else 1)
            self.log_iteration(record, loss, grad_norm)
        return None

    def log_iteration(self, record: IterationRecord, loss: float, grad_norm: float) -> None:
        p = self.parts
        extra = dict(record.extra)
        if p.config.logging.log_params_norm:
            extra["params_norm"] = params_norm(p.chunks, p.ps)
        p.progress.iteration(iteration=record.iteration, consumed_samples=record.consumed_samples,
                             global_batch_size=record.global_batch_size, seconds=record.seconds,
                             lr=p.scheduler.get_lr(), loss=loss, loss_scale=p.optimizer.get_loss_scale(),
                             grad_norm=grad_norm, skipped_iterations=p.state.skipped_iterations, extra=extra)

    def record_skip(self, record: IterationRecord, why: str) -> None:
        """A step whose update was not applied: counted, warned about, and its own metrics record."""
        p = self.parts
        p.state.skipped_iterations += 1
        log.warning(f"skipped iteration {record.iteration}: {why}")
        p.progress.skipped(iteration=record.iteration, consumed_samples=record.consumed_samples,
                           global_batch_size=record.global_batch_size, seconds=record.seconds,
                           lr=p.scheduler.get_lr(), loss_scale=p.optimizer.get_loss_scale(),
                           skipped_iterations=p.state.skipped_iterations, reason=why)

"""The training step under --enable-optimizer-post-validation: iterations that overlap, results unchanged.

Each rank starts its optimizer step as soon as its own gradients are final (`Optimizer.
begin_post_validated_step`) and goes straight on to the next iteration: there is no barrier between
iterations, so the first stage runs iteration k+1's forwards while the last stages still finish k.
The step is resolved (`resolve_post_validated_step`) after the next iteration's forward-backward, when
the global statistics have long arrived; every rank resolves at that same point, so every rank takes the
same decision:

- the step stands (the usual case): the iteration is logged one iteration late and training goes on;
- the synchronous step would have clipped or skipped it: the speculating ranks roll it back and redo it,
  and every rank runs the next iteration again from the same microbatches (`ReplayableIterator`);
- a non-finite loss without --skip-nonfinite-steps: the run stops naming the iteration, as without the flag.

Global points drain the pipeline (`drain`): checkpoint saves, evaluation, exits and the last iteration
resolve the pending step before they act, so what they see is exactly the synchronous run's state.
The global token count of a step is known before its end (every loss-mask entry is 1: global batch x
sequence length) and checked when the step resolves.
"""
from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass
from typing import Any, Iterator, Optional

from llamapipe.core.logger import get_logger
from llamapipe.core.optimizer.post_validation import PendingStep, Resolution

log = get_logger()


class ReplayableIterator:
    """Wraps a data iterator; remembers the microbatches of the current iteration so it can yield them again."""

    def __init__(self, iterator: Iterator) -> None:
        self.iterator = iterator
        self.record: list = []
        self.queue: deque = deque()

    def __iter__(self) -> "ReplayableIterator":
        return self

    def __next__(self) -> Any:
        item = self.queue.popleft() if self.queue else next(self.iterator)
        self.record.append(item)
        return item

    def new_iteration(self) -> None:
        self.record, self.queue = [], deque()

    def replay(self) -> None:
        self.queue, self.record = deque(self.record), []


@dataclass
class _Step:
    pending: PendingStep
    iteration: int
    consumed_samples: int
    global_batch_size: int
    seconds: float
    extra: dict


class PostValidatedSteps:
    """`train_step` and `drain` of the Trainer under post-validation."""

    def __init__(self, trainer: Any) -> None:
        self.trainer = trainer
        self.step: Optional[_Step] = None
        self.rollbacks = self.replays = 0
        self.always_speculate = False          # tests set it to exercise rollbacks on every clipped step
        trainer.train_iters = [None if it is None else ReplayableIterator(it) for it in trainer.train_iters]
        self._last = time.perf_counter()

    def _iterators(self) -> list[ReplayableIterator]:
        return [it for it in self.trainer.train_iters if it is not None]

    def _forward_backward(self, num_microbatches: int) -> tuple[float, float]:
        t = self.trainer
        t.optimizer.zero_grad()
        return t._run_schedule(t.train_iters, forward_only=False, num_microbatches=num_microbatches,
                               reduce_pp=False)

    def train_step(self) -> Optional[int]:
        from llamapipe.core.distributed.grad_reduce import finalize_model_grads
        t, st = self.trainer, self.trainer.state
        t.batches.update(st.consumed_samples)
        global_batch_size, num_microbatches = t.batches.get_current_global_batch_size(), t.batches.get()
        for it in self._iterators():
            it.new_iteration()
        loss_sum, tokens = self._forward_backward(num_microbatches)
        status, replay = self.resolve()
        if status is not None:
            return status
        if replay:       # this iteration ran on parameters the synchronous step would not have had
            if t.grad_sync is not None:
                t.grad_sync.discard()
            for it in self._iterators():
                it.replay()
            loss_sum, tokens = self._forward_backward(num_microbatches)
            self.replays += 1
        st.iteration += 1
        st.consumed_samples += global_batch_size
        finalize_model_grads(t.chunks, t.ps, None, global_tokens=float(global_batch_size * t.config.training.seq_length),
                             bucket_size=t.config.parallel.ddp_bucket_size, grad_sync=t.grad_sync)
        extra = {}
        if t.config.logging.log_num_zeros_in_grad:
            from llamapipe.training.log import num_zeros_in_grad
            extra["num_zeros_in_grad"] = num_zeros_in_grad(t.chunks, t.ps)
        pending = t.optimizer.begin_post_validated_step(loss_sum, tokens, self.always_speculate)
        now = time.perf_counter()
        self.step = _Step(pending, st.iteration, st.consumed_samples, global_batch_size, now - self._last, extra)
        self._last = now
        if not pending.speculated:
            t.optimizer.resolve_post_validated_step(pending)   # the update now; what it means for the loop: later
        return None

    def drain(self) -> Optional[int]:
        """Resolve the pending step (a global point: save, evaluation, exit, end); an exit status or None."""
        status, _ = self.resolve()
        return status

    def resolve(self) -> tuple[Optional[int], bool]:
        """(exit status or None, whether the iteration run since the pending step must run again)."""
        if self.step is None:
            return None, False
        step, self.step = self.step, None
        result = self.trainer.optimizer.resolve_post_validated_step(step.pending)
        self.rollbacks += result.rolled_back
        expected = step.global_batch_size * self.trainer.config.training.seq_length
        if result.update_successful and result.tokens != expected:
            log.error(f"iteration {step.iteration}: {result.tokens:g} loss tokens but post-validation needs every "
                      f"loss-mask entry to be 1 ({expected} tokens); run without --enable-optimizer-post-validation")
            return 1, False
        return self._report(step, result), result.replay

    def _report(self, step: _Step, result: Resolution) -> Optional[int]:
        t, cfg = self.trainer, self.trainer.config
        fp16, skip = cfg.optimizer.fp16, cfg.training.skip_nonfinite_steps
        if result.action == "nonfinite_loss" and not skip:
            log.error(f"iteration {step.iteration}: lm loss is {result.loss}; stopping before applying the update "
                      "(pass --skip-nonfinite-steps to skip such steps instead)")
            return 1
        if result.action == "nonfinite_norm" and not fp16 and not skip:
            log.error(f"iteration {step.iteration}: gradient norm is not finite; the update was not applied "
                      "(pass --skip-nonfinite-steps to skip such steps instead)")
            return 1
        if not result.update_successful:
            why = {"nonfinite_loss": f"lm loss is {result.loss}",
                   "found_inf": f"inf/nan in gradients (loss scale now {t.optimizer.get_loss_scale():g})"}
            t.record_skip(step.iteration, step.consumed_samples, step.global_batch_size, step.seconds,
                          why.get(result.action, "inf/nan in gradients"))
            return None
        t.scheduler.step(step.global_batch_size if t.scheduler.counts_samples else 1)
        t.log_iteration(step.iteration, step.consumed_samples, step.global_batch_size, step.seconds,
                        result.loss, result.grad_norm, step.extra)
        return None

    def summary(self) -> str:
        return (f"post-validation: {self.rollbacks} speculative updates rolled back, "
                f"{self.replays} iterations run again")

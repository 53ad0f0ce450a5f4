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

Whether ranks speculate at all is `SpeculationPolicy`'s call, from the actions of the steps resolved so far
(the same on every rank): a run that clips on every step speculates on none and pays no replays. The end of
the run logs how many updates were rolled back, how many iterations ran twice and what their re-runs cost.

`PostValidatedStep` is the other form of `training/step.SynchronousStep`: it shares its forward-backward,
gradient reduction, skip/stop decision and records, and changes only when the decision is taken.
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
from llamapipe.core.optimizer.post_validation import PendingStep, SpeculationPolicy
from llamapipe.training.step import IterationRecord, StepParts, SynchronousStep

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
class _Pending:
    step: PendingStep
    record: IterationRecord


class PostValidatedStep(SynchronousStep):
    """The training step under post-validation: decided one iteration later, rolled back and replayed when
    the synchronous step would have done otherwise."""

    overlapped = True
    # tests only: "always" speculates on every step (every clipped step rolls back), "eager" on every step the
    # policy allows, whatever each rank's own statistics and timing say; "adaptive" is the real thing
    speculation = "adaptive"

    def __init__(self, parts: StepParts, train_iters: list) -> None:
        super().__init__(parts, [None if it is None else ReplayableIterator(it) for it in train_iters])
        self.pending: Optional[_Pending] = None
        self.policy = SpeculationPolicy()
        self.steps = self.rollbacks = self.replays = 0      # rollbacks: steps that some rank rolled back
        self.replay_seconds = 0.0
        self._last = time.perf_counter()
        self._started: Optional[float] = None

    def _replayable(self) -> list[ReplayableIterator]:
        return [it for it in self.iterators if it is not None]

    def run(self) -> Optional[int]:
        p = self.parts
        if self._started is None:
            self._started = time.perf_counter()
        global_batch_size, num_microbatches = self.begin()
        for it in self._replayable():
            it.new_iteration()
        loss_sum, tokens = self.forward_backward(self.iterators, num_microbatches, reduce_pp=False)
        self.mark()     # iterations overlap: the timers' iteration ends with its forward-backward
        status, replay = self.resolve()
        if status is not None:
            return status
        if replay:       # this iteration ran on parameters the synchronous step would not have had
            if p.grad_sync is not None:
                p.grad_sync.discard()
            for it in self._replayable():
                it.replay()
            start = time.perf_counter()
            loss_sum, tokens = self.forward_backward(self.iterators, num_microbatches, reduce_pp=False)
            self.replays, self.replay_seconds = self.replays + 1, self.replay_seconds + time.perf_counter() - start
        self.advance(global_batch_size)
        extra = self.finalize_grads(float(global_batch_size * p.config.training.seq_length))
        self.steps += 1
        allowed = self.speculation == "always" or self.policy.begin_step()
        with self.region("optimizer"):
            pending = p.optimizer.begin_post_validated_step(loss_sum, tokens, always_speculate=allowed and
                                                            self.speculation != "adaptive", paused=not allowed)
        now = time.perf_counter()
        record = IterationRecord(p.state.iteration, p.state.consumed_samples, global_batch_size, now - self._last,
                                 extra)
        self.pending, self._last = _Pending(pending, record), now
        if not pending.speculated:
            p.optimizer.resolve_post_validated_step(pending)   # the update now; what it means for the loop: later
        return None

    def drain(self) -> Optional[int]:
        """Resolve the pending step (a global point: save, evaluation, exit, end); an exit status or None."""
        status, _ = self.resolve()
        return status

    def resolve(self) -> tuple[Optional[int], bool]:
        """(exit status or None, whether the iteration run since the pending step must run again)."""
        if self.pending is None:
            return None, False
        pending, self.pending = self.pending, None
        result = self.parts.optimizer.resolve_post_validated_step(pending.step)
        self.rollbacks += result.replay       # some rank rolled back (the last step is not replayed: drained)
        self.policy.record(result.action, result.replay)
        expected = pending.record.global_batch_size * self.parts.config.training.seq_length
        if result.update_successful and result.tokens != expected:
            log.error(f"iteration {pending.record.iteration}: {result.tokens:g} loss tokens but post-validation "
                      f"needs every loss-mask entry to be 1 ({expected} tokens); run without "
                      "--enable-optimizer-post-validation")
            return 1, False
        return self.conclude(pending.record, result.action, result.loss, result.grad_norm), result.replay

    def summary(self) -> str:
        """E.g. "post-validation: 1 speculative update rolled back, 1 iteration run again (0.42 s, 1.3% of
        training time); speculation paused on 14 of 16 iterations (4 at the start, 10 after clipping)"."""
        seconds = time.perf_counter() - self._started if self._started is not None else 0.0
        share = 100.0 * self.replay_seconds / seconds if seconds > 0 else 0.0
        return (f"post-validation: {_count(self.rollbacks, 'speculative update')} rolled back, "
                f"{_count(self.replays, 'iteration')} run again ({self.replay_seconds:.2f} s, {share:.1f}% of "
                f"training time); {self.policy.describe(self.steps)}")


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}" + ("" if n == 1 else "s")

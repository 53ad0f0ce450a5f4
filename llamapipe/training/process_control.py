"""Process-level controls of the training loop: SIGTERM (--exit-signal-handler) and Python's garbage
collector (--manual-gc), both as Megatron-LM handles them."""
from __future__ import annotations

import contextlib
import gc
import signal
from typing import Any, Iterator, Optional

import torch
import torch.distributed as dist


class ExitSignal:
    """Remembers a SIGTERM (SLURM preemption) so all ranks can agree to save and exit."""

    def __init__(self, enabled: bool) -> None:
        self.received = False
        self._in_flight: Optional[tuple] = None
        if enabled:
            signal.signal(signal.SIGTERM, self._handle)

    def _handle(self, signum: int, frame: Any) -> None:
        self.received = True

    def agreed_flags(self, elapsed_s: float, collective: bool, overlapped: bool = False) -> torch.Tensor:
        """[SIGTERM seen, seconds elapsed], as MAX over all ranks when `collective`. `overlapped` (iterations
        that overlap under post-validation) reads the agreement started one iteration earlier and starts the
        next without blocking: a signal is then acted on one iteration later, on every rank alike."""
        flags = torch.tensor([float(self.received), elapsed_s])
        if not collective:
            return flags
        if not overlapped:
            dist.all_reduce(flags, op=dist.ReduceOp.MAX)
            return flags
        previous, self._in_flight = self._in_flight, (flags, dist.all_reduce(flags, op=dist.ReduceOp.MAX,
                                                                             async_op=True))
        if previous is None:
            return torch.zeros_like(flags)
        previous[1].wait()
        return previous[0]

    def settle(self) -> None:
        """Wait for the agreement still in flight (every rank started the same ones): a gloo work left
        pending at process exit can abort the process."""
        if self._in_flight is not None:
            self._in_flight[1].wait()
            self._in_flight = None


@contextlib.contextmanager
def manual_gc(enabled: bool) -> Iterator[None]:
    """--manual-gc: Python's collector never runs by itself during training, because ranks that pause at
    different moments make every rank wait for the slowest in the next collective; the loop collects every
    --manual-gc-interval iterations and around evaluation instead (`collect_for_eval`)."""
    if not enabled:
        yield
        return
    gc.disable()
    gc.collect()
    try:
        yield
    finally:
        gc.enable()


@contextlib.contextmanager
def collect_for_eval(enabled: bool) -> Iterator[None]:
    """--manual-gc without --no-manual-gc-eval: a full collection before evaluation, and one of the youngest
    generation (what evaluation alone allocated) after it."""
    if enabled:
        gc.collect()
    yield
    if enabled:
        gc.collect(generation=0)

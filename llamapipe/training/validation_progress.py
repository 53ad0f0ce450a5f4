"""Progress of one validation pass: lines while a long one runs, and how long it took.

Megatron's default --eval-iters 100 made the final validation of a short run take longer than its training
with no output in between (issue 33). A pass that has run for at least `min_seconds` reports at every tenth
of its iterations, so a slow one gives at most ten lines and a quick one none; its total time always goes
on the validation loss line.
"""
from __future__ import annotations

import math
import time
from typing import Callable, Optional

from llamapipe.core.logger import get_logger

MIN_SECONDS = 5.0   # quieter passes print only their result


class ValidationProgress:
    def __init__(self, total: int, *, min_seconds: float = MIN_SECONDS,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        self.total, self.min_seconds, self.clock = total, min_seconds, clock
        self.every = max(math.ceil(total / 10), 1)
        self.start = clock()

    @property
    def seconds(self) -> float:
        return self.clock() - self.start

    def line(self, done: int) -> Optional[str]:
        """The progress line after `done` iterations, or None when there is nothing to say yet."""
        if done % self.every or done >= self.total or self.seconds < self.min_seconds:
            return None
        return f"validation: {done}/{self.total} iterations, {self.seconds:.1f} s"

    def step(self, done: int) -> None:
        text = self.line(done)
        if text is not None:
            get_logger().info(text)

    def summary(self) -> str:
        """What the result line ends with: '100 iterations in 48.1 s'."""
        return f"{self.total} iteration{'s' if self.total != 1 else ''} in {self.seconds:.1f} s"

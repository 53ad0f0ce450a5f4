"""How many microbatches each iteration runs: constant, or growing with --rampup-batch-size (Megatron-LM).

Megatron-LM's megatron/core/num_microbatches_calculator.py, without its module-level singleton: the loop
owns one calculator and calls `update(consumed_samples)` before every step. Under --rampup-batch-size
START INCREMENT RAMP_SAMPLES the global batch starts at START and grows by INCREMENT every
RAMP_SAMPLES / ((global batch size - START) / INCREMENT) consumed samples, reaching the global batch size
once more than RAMP_SAMPLES samples are consumed. The batch size is a function of consumed samples alone,
so a run resumed at consumed_samples = k continues with the batch sizes of the uninterrupted run.
"""
from __future__ import annotations

from typing import Optional, Union

from llamapipe.core.config import ConfigError
from llamapipe.core.logger import get_logger


def microbatches_per_step(global_batch_size: int, micro_batch_size: int, dp_size: int,
                          said: Optional[str] = None) -> int:
    """Microbatches each data-parallel rank runs for one global batch: the one divisibility rule of the batch
    sizes, raising ConfigError that names the config fields and the numbers (`said` opens the sentence)."""
    per_step = micro_batch_size * dp_size
    if global_batch_size % per_step:
        said = said or f"global_batch_size {global_batch_size} is"
        named = [field for field in ("global_batch_size", "rampup_batch_size") if field in said]
        raise ConfigError(f"{said} not divisible by micro_batch_size ({micro_batch_size}) x data-parallel size "
                          f"({dp_size})", *named, "micro_batch_size")
    return global_batch_size // per_step


def ramp_batch_size(consumed_samples: int, global_batch_size: int, rampup_batch_size: Optional[tuple]) -> int:
    """The global batch size of the iteration that starts after `consumed_samples` (Megatron's rule)."""
    if rampup_batch_size is None:
        return global_batch_size
    start, increment, ramp_samples = (int(v) for v in rampup_batch_size)
    if consumed_samples > ramp_samples:
        return global_batch_size
    # the same float division as Megatron, so the step boundaries fall on the same samples
    samples_per_increment = ramp_samples / ((global_batch_size - start) // increment)
    return start + int(consumed_samples / samples_per_increment) * increment


def check_rampup_batch_size(rampup_batch_size: tuple, global_batch_size: int, micro_batch_size: int,
                            dp_size: int, pp_size: int = 1) -> None:
    """Raise ConfigError (one sentence naming the config fields and numbers) unless every batch size of the ramp
    splits into microbatches on every data-parallel rank, and into enough of them for the pipeline."""
    start, increment, ramp_samples = (int(v) for v in rampup_batch_size)
    said = f"rampup_batch_size {start} {increment} {ramp_samples}"
    if start <= 0 or increment <= 0 or ramp_samples <= 0:
        raise ConfigError(f"{said}: the start batch size, increment and ramp-up samples must all be positive",
                          "rampup_batch_size")
    if start >= global_batch_size:
        raise ConfigError(f"{said} starts at {start}, not below global_batch_size {global_batch_size}, so there "
                          "is nothing to ramp up; drop rampup_batch_size or lower its start", "rampup_batch_size",
                          "global_batch_size")
    if (global_batch_size - start) % increment:
        raise ConfigError(f"{said}: the ramp from {start} to global_batch_size {global_batch_size} "
                          f"({global_batch_size - start}) is not divisible by the increment {increment}",
                          "rampup_batch_size", "global_batch_size")
    for size in range(start, global_batch_size + 1, increment):
        microbatches_per_step(size, micro_batch_size, dp_size, f"{said} reaches global batch size {size}, which is")
    first = microbatches_per_step(start, micro_batch_size, dp_size)
    if pp_size > 1 and first < pp_size:
        raise ConfigError(f"{said} starts with {first} microbatches ({start} / (micro_batch_size {micro_batch_size} "
                          f"x data-parallel size {dp_size})), fewer than pp_size ({pp_size}) that the pipeline "
                          "schedule needs", "rampup_batch_size", "micro_batch_size", "pp_size")


def train_iters_for_samples(train_samples: int, global_batch_size: int, rampup_batch_size: Optional[tuple]) -> int:
    """Iterations of a --train-samples run (Megatron's update_train_iters): the ramp-up iterations while at
    most RAMP_SAMPLES (and at most train_samples) samples are consumed, then full global batches; a partial
    last batch is dropped. Call `check_rampup_batch_size` first (it rejects a ramp with no steps)."""
    if rampup_batch_size is None:
        return train_samples // global_batch_size
    ramp_samples = int(rampup_batch_size[2])
    iterations = consumed = 0
    while consumed <= ramp_samples and consumed <= train_samples:
        consumed += ramp_batch_size(consumed, global_batch_size, rampup_batch_size)
        iterations += 1
    if train_samples > consumed:
        iterations += (train_samples - consumed) // global_batch_size
    return iterations


def samples_for_iters(iterations: int, global_batch_size: int, rampup_batch_size: Optional[tuple]) -> int:
    """Samples consumed by `iterations` iterations from the start of training."""
    if rampup_batch_size is None:
        return iterations * global_batch_size
    consumed = 0
    for _ in range(iterations):
        consumed += ramp_batch_size(consumed, global_batch_size, rampup_batch_size)
    return consumed


class ConstantNumMicroBatchesCalculator:
    """global batch size / (micro batch size x data-parallel size) microbatches every iteration."""

    def __init__(self, global_batch_size: int, micro_batch_size: int, dp_size: int) -> None:
        microbatches_per_step(global_batch_size, micro_batch_size, dp_size)
        self.micro_batch_size, self.dp_size = micro_batch_size, dp_size
        self.current_global_batch_size = global_batch_size

    def get(self) -> int:
        """Microbatches per data-parallel rank in the current iteration."""
        return self.current_global_batch_size // (self.micro_batch_size * self.dp_size)

    def get_current_global_batch_size(self) -> int:
        return self.current_global_batch_size

    def update(self, consumed_samples: int) -> None:
        """Constant: nothing changes."""


class RampupBatchsizeNumMicroBatchesCalculator(ConstantNumMicroBatchesCalculator):
    """The global batch grows from START by INCREMENT as samples are consumed (see the module docstring)."""

    def __init__(self, global_batch_size: int, micro_batch_size: int, dp_size: int,
                 rampup_batch_size: tuple) -> None:
        check_rampup_batch_size(rampup_batch_size, global_batch_size, micro_batch_size, dp_size)
        super().__init__(global_batch_size, micro_batch_size, dp_size)
        self.global_batch_size, self.rampup_batch_size = global_batch_size, tuple(int(v) for v in rampup_batch_size)
        start, increment, ramp_samples = self.rampup_batch_size
        get_logger().info(f"batch size rampup: global batch size {start} growing by {increment} up to "
                          f"{global_batch_size} over the first {ramp_samples} samples")
        self.current_global_batch_size = start

    def update(self, consumed_samples: int) -> None:
        """Set the batch size for the iteration that starts after `consumed_samples`."""
        old = self.current_global_batch_size
        self.current_global_batch_size = ramp_batch_size(consumed_samples, self.global_batch_size,
                                                         self.rampup_batch_size)
        if self.current_global_batch_size != old:
            get_logger().info(f"ramping up batch size from {old} to {self.current_global_batch_size} "
                              f"after {consumed_samples} consumed samples")


NumMicroBatchesCalculator = Union[ConstantNumMicroBatchesCalculator, RampupBatchsizeNumMicroBatchesCalculator]


def build_num_microbatches_calculator(global_batch_size: int, micro_batch_size: int, dp_size: int,
                                      rampup_batch_size: Optional[tuple] = None) -> NumMicroBatchesCalculator:
    if rampup_batch_size is None:
        return ConstantNumMicroBatchesCalculator(global_batch_size, micro_batch_size, dp_size)
    return RampupBatchsizeNumMicroBatchesCalculator(global_batch_size, micro_batch_size, dp_size,
                                                    rampup_batch_size)

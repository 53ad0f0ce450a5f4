"""What the training loop reports: one record per iteration, a console line every --log-interval, and the
end-of-training summary.

Every iteration gets its own JSONL/TensorBoard/W&B record, whatever --log-interval says (tests and plots
read them), also one whose update was skipped (fp16 overflow, --skip-nonfinite-steps): `"skipped": true` and
its `skip_reason`, without `lm_loss` and `grad_norm`, so readers that select records by `lm_loss` see the
applied steps only. The console line, as in Megatron-LM, averages the loss and the time per iteration over the
iterations since the previous line. Throughput (tokens/s, TFLOP/s per GPU, MFU) leaves out the first
iteration of a run, which also pays for warm-up (allocations, profiling, first-touch of memory). A single
iteration's loss is noisy, so the summary compares the mean loss of the first and the last (up to) ten
iterations this run trained; skipped updates are counted there, with a hint when an fp16 run skipped all of them.
"""
from __future__ import annotations

import time
from typing import Callable, Optional

from llamapipe.core.logger import get_logger
from llamapipe.training.log import MetricsWriter, device_peak_tflops, flops_per_token, max_memory_gib
from llamapipe.model.llama import LlamaConfig

SUMMARY_WINDOW = 10     # iterations averaged at each end of the run for the summary
SKIPPED_ALL_HINT = ("; no update was applied: the fp16 loss scale starts at --initial-loss-scale (2^32 by "
                    "default, as in Megatron) and halves once per overflowing iteration (after --hysteresis of "
                    "them), so a short run can skip every one; give --initial-loss-scale 65536, train longer, or "
                    "use --bf16")


def start_line(train_iters: int, start: int, train_samples: Optional[int] = None, global_batch_size: int = 0,
               rampup: bool = False) -> str:
    """What the run is about to train: the count of iterations it will run, and where a resumed run takes over
    (the length is the last iteration, not a count from the checkpoint), in the flag the user gave: --train-iters,
    or --train-samples (`train_samples`) with the iterations it makes at `global_batch_size` or through the
    --rampup-batch-size ramp (`rampup`)."""
    left = train_iters - start
    if train_samples is None:
        given, ends = f"--train-iters {train_iters}", "--train-iters is the last iteration"
    else:
        batches = "through --rampup-batch-size" if rampup else f"at global batch {global_batch_size}"
        given = f"--train-samples {train_samples} = {train_iters} iterations {batches}"
        ends = f"--train-samples {train_samples} ends at iteration {train_iters}"
    if left <= 0:
        last = (f"--train-iters {train_iters} is the last iteration" if train_samples is None else
                f"--train-samples {train_samples} ({train_iters} iterations) is the last iteration")
        return f"nothing to train: resumed at iteration {start}, and {last}"
    count = f"training {left} iteration{'' if left == 1 else 's'}"
    if start == 0:
        return f"{count} ({given})"
    return f"{count}, {start + 1} to {train_iters} (resumed at iteration {start}; {ends})"


class TrainingProgress:
    """Builds the per-iteration records and the lines a person reads."""

    def __init__(self, metrics: MetricsWriter, model_cfg: LlamaConfig, *, seq_length: int, world_size: int,
                 train_iters: int, log_interval: int, tp: int = 1,
                 interval_fields: Optional[Callable[[], dict]] = None) -> None:
        self.metrics, self.train_iters, self.log_interval = metrics, train_iters, log_interval
        self.interval_fields = interval_fields          # the timers' fields (collective), at each line's iteration
        self.seq_length, self.world_size = seq_length, world_size
        self.flops_per_token = flops_per_token(model_cfg, seq_length, tp)   # the vocabulary padded for tp
        self.peak = device_peak_tflops()
        self.losses: dict[int, float] = {}              # iteration -> lm loss, this run only
        self._interval: list[dict] = []                 # records since the last console line
        self._timed_tokens = self._timed_seconds = 0.0  # the run's totals after its first iteration
        self._skips: list[tuple[str, float]] = []       # (reason, loss scale after it) of each skipped update
        self._start = time.time()

    def _throughput(self, tokens: float, seconds: float) -> dict:
        tokens_per_sec = tokens / seconds
        tflops = self.flops_per_token * tokens_per_sec / self.world_size / 1e12
        return {"tokens_per_sec": tokens_per_sec, "tflops_per_device": tflops,
                "mfu": tflops / self.peak if self.peak else None}

    def iteration(self, *, iteration: int, consumed_samples: int, global_batch_size: int, seconds: float,
                  lr: float, loss: float, loss_scale: float, grad_norm: float, skipped_iterations: int,
                  extra: Optional[dict] = None) -> None:
        """Record one trained iteration; print the averaged console line when `iteration` ends an interval."""
        tokens = global_batch_size * self.seq_length
        first = not self.losses
        record = {"iteration": iteration, "consumed_samples": consumed_samples,
                  "global_batch_size": global_batch_size, "elapsed_ms": seconds * 1000.0, "lr": lr,
                  "lm_loss": loss, "loss_scale": loss_scale, "grad_norm": float(grad_norm),
                  "skipped_iterations": skipped_iterations, "skipped": False,
                  **({"tokens_per_sec": None, "tflops_per_device": None, "mfu": None} if first else
                     self._throughput(tokens, seconds)),
                  "max_memory_gib": max_memory_gib(), **(extra or {}), **self._timer_fields(iteration)}
        if not first:
            self._timed_tokens += tokens
            self._timed_seconds += seconds
        self.losses[iteration] = loss
        self.metrics.write(record)
        self._interval.append(record)
        if iteration % self.log_interval == 0:
            self.metrics.iteration(self._averaged(), self.train_iters)
            self._interval = []

    def skipped(self, *, iteration: int, consumed_samples: int, global_batch_size: int, seconds: float, lr: float,
                loss_scale: float, skipped_iterations: int, reason: str) -> None:
        """Record an iteration whose update was not applied; it ends a console interval like any other."""
        self._skips.append((reason, loss_scale))
        self.metrics.write({"iteration": iteration, "consumed_samples": consumed_samples,
                            "global_batch_size": global_batch_size, "elapsed_ms": seconds * 1000.0, "lr": lr,
                            "loss_scale": loss_scale, "skipped_iterations": skipped_iterations, "skipped": True,
                            "skip_reason": reason, **self._timer_fields(iteration)})
        if iteration % self.log_interval == 0 and self._interval:
            self.metrics.iteration(self._averaged(), self.train_iters)
            self._interval = []

    def _timer_fields(self, iteration: int) -> dict:
        """At the end of a logging interval, the timers' fields (every rank joins their gather); else none."""
        if self.interval_fields is None or iteration % self.log_interval:
            return {}
        return self.interval_fields()

    def _averaged(self) -> dict:
        """The interval's last record with its loss and time per iteration averaged, throughput over the
        interval's timed iterations."""
        rows = self._interval
        out = dict(rows[-1], lm_loss=sum(r["lm_loss"] for r in rows) / len(rows),
                   elapsed_ms=sum(r["elapsed_ms"] for r in rows) / len(rows))
        timed = [r for r in rows if r["tokens_per_sec"] is not None]
        if timed:
            seconds = sum(r["elapsed_ms"] for r in timed) / 1000.0
            tokens = sum(r["global_batch_size"] for r in timed) * self.seq_length
            out.update(self._throughput(tokens, seconds))
        return out

    def summary(self) -> str:
        """One line: iterations and time, throughput, and the mean loss at the start vs the end of the run."""
        iters = sorted(self.losses)
        line = f"training done: {len(iters)} iterations in {time.time() - self._start:.1f} s"
        if self._timed_seconds:
            t = self._throughput(self._timed_tokens, self._timed_seconds)
            line += f", {t['tokens_per_sec']:.0f} tokens/s ({t['tflops_per_device']:.3f} TFLOP/s per device) " \
                    "after the first iteration"
        if self._skips:
            line += f"; {len(self._skips)} iteration(s) skipped their update (last: {self._skips[-1][0]})"
        if not iters:
            return line + (SKIPPED_ALL_HINT if self._skips and self._skips[-1][1] > 1.0 else "")
        n = min(SUMMARY_WINDOW, len(iters) // 2)
        if n == 0:
            return line + f"; lm loss {self.losses[iters[0]]:.4f} at iteration {iters[0]} (one iteration: " \
                          "nothing to compare)"
        first, last = iters[:n], iters[-n:]
        before = sum(self.losses[i] for i in first) / n
        after = sum(self.losses[i] for i in last) / n
        if n == 1:
            text = f"lm loss {before:.4f} at iteration {first[0]} -> {after:.4f} at iteration {last[0]}"
        else:
            text = (f"mean lm loss {before:.4f} over iterations {first[0]}-{first[-1]} -> {after:.4f} over "
                    f"iterations {last[0]}-{last[-1]}")
        if n < SUMMARY_WINDOW:
            means = "single iterations" if n == 1 else f"means of {n}"
            text += f" (only {len(iters)} iterations, so {means} instead of means of {SUMMARY_WINDOW})"
        return f"{line}; {text}: the loss is {'falling' if after < before else 'not falling'}"

    def log_summary(self) -> None:
        get_logger().info(self.summary())

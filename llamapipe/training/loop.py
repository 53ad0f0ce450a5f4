"""The training loop: build this rank's model chunks, data, optimizer and schedule, then train (the process-level
entry around it, `pretrain`, is training/pretrain.py).

Loss accounting follows the per-token convention (docs/design.md section 4): every microbatch returns the sum
of its token losses and its token count; gradients are divided by the global token count after the
step's last backward, so every layout computes exactly the single-rank token-averaged loss.
Exit handling (Megatron): --exit-interval, --exit-duration-in-mins and --exit-signal-handler (--exit-signal,
SIGTERM by default, and Ctrl-C) are agreed on by all ranks through one all-reduce, then a checkpoint is saved
and the run exits 0; any other stop signal ends the run at once in one line (training/signals).
Under --rampup-batch-size the microbatch count of each step comes from the consumed samples
(core.num_microbatches_calculator); the schedules cache one plan per count. A run that ends normally
validates once more unless it just did (Megatron evaluates after training) and logs a summary.
"""
from __future__ import annotations

import gc
import math
import time
from typing import Optional

import torch
import torch.distributed as dist

from llamapipe.training.config import Config
from llamapipe.core.logger import get_logger
from llamapipe.core.num_microbatches_calculator import build_num_microbatches_calculator
from llamapipe.core.parallel_state import ParallelState
from llamapipe.training.log import MetricsWriter
from llamapipe.training.process_control import collect_for_eval, manual_gc
from llamapipe.training.signals import ExitSignal
from llamapipe.training.progress import TrainingProgress, start_line
from llamapipe.training.restart_record import ProgressRecord, restart_line, restart_report, save_cost_line
from llamapipe.fault_injection import kill_at
from llamapipe.model.llama import LlamaConfig
from llamapipe.training.setup import build_model_chunks, build_iterators
from llamapipe.training.step import StepParts, SynchronousStep, TrainState, run_schedule
from llamapipe.training.hang_watch import build_hang_watch
from llamapipe.training.timers_log import TimersLog, build_timers
from llamapipe.training.trace_log import build_trace

log = get_logger()


class Trainer:
    """Holds everything one rank needs for the loop; the loop itself is `train`."""

    def __init__(self, config: Config, model_cfg: LlamaConfig, ps: ParallelState, device: torch.device) -> None:
        from llamapipe.core.optimizer import OptimizerParamScheduler, build_optimizer
        from llamapipe.training.setup import build_forward_backward_func, build_runtime_options
        from llamapipe.training.checkpointing.save_lock import hold_save_dir
        ckpt = config.checkpoint      # one run per --save directory, and one history in it, before any work
        self.save_lock = hold_save_dir(ckpt.save, ckpt.load, ckpt.overwrite_save)
        self.config, self.model_cfg, self.ps, self.device = config, model_cfg, ps, device
        self.chunks, self.roles = build_model_chunks(config, model_cfg, ps, device)
        self.optimizer = build_optimizer(self.chunks, config.optimizer, ps)
        cfg = config.training
        self.scheduler = OptimizerParamScheduler(self.optimizer, config.optimizer, cfg.train_iters,
                                                 train_samples=cfg.train_samples)
        self.batches = build_num_microbatches_calculator(cfg.global_batch_size, cfg.micro_batch_size, ps.dp_size,
                                                         cfg.rampup_batch_size)
        self.state = TrainState()
        resumed = self._load()
        train_iters, self.valid_iters = build_iterators(config, model_cfg, ps, self.roles, self.state.consumed_samples)
        lcfg = config.logging
        self.timers = build_timers(lcfg.timing_log_level, lcfg.log_straggler, device.type)   # None at 0 without --log-straggler
        self.trace = build_trace(config, ps)                            # --pipeline-trace (None without)
        self.hang = build_hang_watch(config, ps)                        # --hang-report-seconds (None at 0)
        observers = (self.hang.observers() if self.hang is not None else ()) + tuple(
            o for o in (self.timers, self.trace and self.trace.recorder) if o is not None)
        self.runtime = build_runtime_options(config, ps, self.chunks, observers=observers)
        fb_func = build_forward_backward_func(config, ps, self.runtime)
        self.timers_log = None if self.timers is None else self._timers_log()
        self.metrics = MetricsWriter(config.logging, enabled=dist.get_rank() == 0, run_config=config,
                                     save_dir=config.checkpoint.save)
        self.resumed_from = resumed
        self.progress_record = ProgressRecord(config.checkpoint.save, enabled=dist.get_rank() == 0)
        self._train_start, self._first_iteration = time.time(), self.state.iteration    # reset by train()
        if resumed is not None:
            self.metrics.mark_resume(resumed)     # where this run's records take over from the earlier run's
        self.progress = TrainingProgress(self.metrics, model_cfg, seq_length=cfg.seq_length,
                                         world_size=ps.world_size, train_iters=cfg.train_iters,
                                         log_interval=config.logging.log_interval, tp=ps.tp_size,
                                         interval_fields=self.timers_log and self.timers_log.interval_fields)
        self.exit_signal = ExitSignal(cfg.exit_signal_handler, cfg.exit_signal)
        self.parts = StepParts(config, ps, self.chunks, self.optimizer, self.scheduler, self.batches,
                               fb_func, self.runtime.grad_sync, self.progress, self.state, self.timers, self.hang)
        step_form = SynchronousStep
        if cfg.post_validation:
            from llamapipe.training.post_validated import PostValidatedStep
            step_form = PostValidatedStep
        self.step = step_form(self.parts, train_iters)

    def _timers_log(self) -> TimersLog:
        """--timing-log-level's report and --log-straggler's detector, over one gather per interval."""
        lcfg, cfg = self.config.logging, self.config.training
        detector = expected = None
        if lcfg.log_straggler:
            from llamapipe.training.straggler import StragglerDetector, expected_work
            from llamapipe.training.timers_log import replica_keys
            detector = StragglerDetector(replica_keys(self.ps, self.ps.world_size), lcfg.straggler_minmax_count,
                                         lcfg.straggler_threshold)
            expected = expected_work(self.model_cfg, self.chunks, self.roles, pp=self.ps.pp_size, tp=self.ps.tp_size,
                                     seq_length=cfg.seq_length, micro_batch=cfg.micro_batch_size,
                                     vocab_parallel=self.config.parallel.vocab_parallel, device=self.device.type)
        return TimersLog(self.timers, self.ps, lcfg.timing_log_option, report=lcfg.timing_log_level > 0,
                         straggler=detector, expected=expected or 0.0)

    def _load(self) -> Optional[int]:
        """Resume from --load; returns the iteration resumed from (None: nothing loaded)."""
        ckpt = self.config.checkpoint
        if not ckpt.load:
            return None
        from llamapipe.training.checkpointing.save_load import load_checkpoint
        result = load_checkpoint(ckpt.load, model_chunks=self.chunks, optimizer=self.optimizer,
                                 scheduler=self.scheduler, parallel_state=self.ps, config=self.config,
                                 no_load_optim=ckpt.no_load_optim, no_load_rng=ckpt.no_load_rng,
                                 finetune=ckpt.finetune)
        if result is None:
            return None
        self.state.iteration, self.state.consumed_samples = result.iteration, result.consumed_samples
        log.info(f"resumed from {ckpt.load} at iteration {result.iteration} "
                 f"({result.consumed_samples} consumed samples)")
        return result.iteration

    def save(self) -> None:
        ckpt = self.config.checkpoint
        if not ckpt.save:
            return
        from llamapipe.training.checkpointing.save_load import save_checkpoint
        self.progress_record.note(self.state.iteration, "saving")
        start = time.perf_counter()
        save_checkpoint(ckpt.save, self.state.iteration, model_chunks=self.chunks, optimizer=self.optimizer,
                        scheduler=self.scheduler, parallel_state=self.ps, config=self.config,
                        consumed_samples=self.state.consumed_samples, keep_last_n=ckpt.keep_last_n,
                        async_save=ckpt.async_save)
        if not ckpt.async_save:     # an async save's time is its writer thread's, not measured here
            trained = self.state.iteration - self._first_iteration
            per_iteration = (time.time() - self._train_start) / trained if trained > 0 else None
            log.info(save_cost_line(self.state.iteration, time.perf_counter() - start, per_iteration,
                                    ckpt.save_interval))

    def _report_restart(self) -> None:
        """On a torchrun restart: what the failure cost (restart_record), in the log and the JSONL."""
        report = restart_report(self.config.checkpoint.save, self.resumed_from or 0)
        if report is not None:
            log.info(restart_line(report))
            self.metrics.write({**report, "event": "restart"})
        self.progress_record.note(self.state.iteration)   # this attempt's start: what a next failure loses from

    def train(self) -> int:
        cfg, st = self.config.training, self.state
        self._report_restart()
        self._train_start, self._first_iteration = time.time(), st.iteration
        log.info(start_line(cfg.train_iters, st.iteration, cfg.train_samples, cfg.global_batch_size,
                            cfg.rampup_batch_size is not None))   # the layout is in the "run:" lines
        with manual_gc(cfg.manual_gc):
            status = self._train_loop()
        if self.trace is not None and status is None:
            self.trace.finish()         # the run ended inside the traced window
        self.exit_signal.settle()
        for summary in (self.step.summary(), self.timers_log and self.timers_log.summary()):
            if summary:     # post-validation's rollbacks and replays; the measured bubble
                log.info(summary)
        if status is None:
            if cfg.eval_iters and not self._every(cfg.eval_interval):
                self.evaluate()     # the last iteration was not validated yet
            status = 0
        self.progress.log_summary()
        return status

    def _train_loop(self) -> Optional[int]:
        """Iterations up to --train-iters; an exit status when the run stops early (None: it completed)."""
        cfg, st = self.config.training, self.state
        saved_at = st.iteration if self.config.checkpoint.load else None
        while st.iteration < cfg.train_iters:
            if self.trace is not None:
                self.trace.before_iteration(st.iteration)
            status = self.train_step()
            if status is not None:
                return status
            self.progress_record.note(st.iteration)
            kill_at("iteration", st.iteration)
            if cfg.manual_gc and self._every(cfg.manual_gc_interval):
                gc.collect()
            exiting = self._should_exit()
            if exiting or st.iteration >= cfg.train_iters or self._every(cfg.eval_interval) \
                    or self._every(self.config.checkpoint.save_interval):
                status = self.step.drain()      # a global point: settle the pending step first
                if status is not None:
                    return status
            if self._every(self.config.checkpoint.save_interval):
                self.save()
                saved_at = st.iteration
            if self._every(cfg.eval_interval):
                self.evaluate()
            if self.timers is not None and (self._every(self.config.checkpoint.save_interval)
                                            or self._every(cfg.eval_interval)):
                self.timers.restart()       # what a global point took is not the next iteration's idle time
            if exiting:
                if saved_at != st.iteration:
                    self.save()
                log.info(f"exiting at iteration {st.iteration}")
                return 0
        if saved_at != st.iteration:
            self.save()
        return None

    def _every(self, interval: Optional[int]) -> bool:
        return bool(interval) and self.state.iteration % interval == 0

    def _should_exit(self) -> bool:
        cfg, st = self.config.training, self.state
        collective = cfg.exit_signal_handler or cfg.exit_duration_in_mins is not None
        flags = self.exit_signal.agreed_flags(time.time() - st.start_time, collective, overlapped=self.step.overlapped)
        if flags[0] > 0:
            log.info(f"{self.exit_signal.received or cfg.exit_signal + ' (on another rank)'} received; saving at "
                     f"iteration {st.iteration} and exiting")
            return True
        if cfg.exit_duration_in_mins is not None and flags[1] / 60 > cfg.exit_duration_in_mins:
            log.info(f"--exit-duration-in-mins {cfg.exit_duration_in_mins} reached")
            return True
        return self._every(cfg.exit_interval)

    def train_step(self) -> Optional[int]:
        """One optimizer step (`training/step`); returns an exit status when the run must stop."""
        if self.resumed_from is not None and self.state.iteration == self.resumed_from:
            kill_at("resume", self.state.iteration, resumed=True)     # a test's failure (fault_injection)
        if self.hang is None:
            return self.step.run()
        self.hang.begin_iteration(self.state.iteration + 1)     # watched for --hang-report-seconds
        try:
            return self.step.run()
        finally:
            self.hang.end_iteration()

    def evaluate(self) -> Optional[float]:
        """Validation loss and perplexity over --eval-iters global batches."""
        cfg = self.config.training
        if not cfg.eval_iters or self.valid_iters is None:
            return None
        from llamapipe.training.validation_progress import ValidationProgress
        loss_sum = tokens = 0.0
        progress = ValidationProgress(cfg.eval_iters)
        self.progress_record.note(self.state.iteration, "validating")
        with torch.no_grad(), collect_for_eval(cfg.manual_gc and cfg.manual_gc_eval):
            for done in range(1, cfg.eval_iters + 1):
                batch_loss, batch_tokens = run_schedule(self.parts, self.valid_iters, forward_only=True,
                                                        num_microbatches=cfg.num_microbatches)
                loss_sum, tokens = loss_sum + batch_loss, tokens + batch_tokens
                progress.step(done)
                kill_at("validation", self.state.iteration)     # a test's failure (fault_injection)
        loss = loss_sum / max(tokens, 1.0)
        ppl = math.exp(min(loss, 20.0))
        log.info(f"validation loss at iteration {self.state.iteration}: lm loss {loss:.6E} | lm loss PPL {ppl:.6E} "
                 f"| {progress.summary()}")
        self.metrics.write({"iteration": self.state.iteration, "valid_lm_loss": loss, "valid_ppl": ppl})
        return loss

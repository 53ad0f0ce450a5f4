"""Flags that are accepted but do nothing for this layout, each named in one notice line with why (issue 33).

A run that asks for ZeRO-3 at data-parallel size 1 trains exactly like one that does not; saying so at
start-up keeps a user from believing a strategy is active. These notices join the others (flags with no
effect anywhere, values from a checkpoint) that `parser.config_from_args` logs once the config is valid.
"""
from __future__ import annotations

import argparse
import signal

from llamapipe.core.config import FSDP_STRATEGIES, ParallelConfig
from llamapipe.core.pipeline_parallel.schedule_specs import SPECS, default_schedule
from llamapipe.training.arguments.pipeline import virtual_stage_flag
from llamapipe.training.restart_record import restart_notice

_PROFILE_ITERS_DEFAULT = 3      # flags_training's default: a different value was given on purpose


def strategy_flag(args: argparse.Namespace) -> str:
    """The flag, as given, that chose a sharding strategy other than no_shard."""
    if args.use_torch_fsdp2:
        return "--use-torch-fsdp2"
    if args.data_parallel_sharding_strategy != "no_shard":
        return f"--data-parallel-sharding-strategy {args.data_parallel_sharding_strategy}"
    return "--use-distributed-optimizer"


def _data_parallel(args: argparse.Namespace, par: ParallelConfig) -> list[str]:
    lines = []
    if par.dp_size * par.cp_size == 1:     # at cp > 1 the CP ranks hold replicas of the weights to shard over
        why = (f"at data-parallel size 1 (world size {par.world_size} = tp {par.tp_size} x pp {par.pp_size}): "
               "there is no other data-parallel rank")
        if par.data_parallel_sharding_strategy != "no_shard":
            lines.append(f"{strategy_flag(args)} has no effect {why} to shard with; every rank keeps its whole "
                         "optimizer state, gradients and parameters")
        if par.overlap_grad_reduce:
            lines.append(f"--overlap-grad-reduce has no effect {why} to reduce gradients with")
        if args.ddp_bucket_size is not None:
            lines.append(f"--ddp-bucket-size {args.ddp_bucket_size} has no effect {why} to reduce gradients with")
    elif par.overlap_grad_reduce and par.data_parallel_sharding_strategy in FSDP_STRATEGIES:
        lines.append(f"--overlap-grad-reduce has no effect with --data-parallel-sharding-strategy "
                     f"{par.data_parallel_sharding_strategy}: FSDP reduce-scatters the gradients once, after the "
                     "step's last weight-gradient pass")
    return lines


def _pipeline(args: argparse.Namespace, par: ParallelConfig) -> list[str]:
    lines, schedule = [], par.pipeline_schedule
    flag = virtual_stage_flag(args)
    if flag is not None and par.vpp_size == 1 and par.pp_size > 1:
        lines.append(f"{flag} has no effect: it gives one model chunk per pipeline rank, the layout without it")
    if par.pp_size == 1 and args.pipeline_schedule not in (None, default_schedule(1)):
        lines.append(f"--pipeline-schedule {schedule} has no effect with --pipeline-model-parallel-size 1: the "
                     "one stage runs its microbatches one after another")
    if args.enable_vocab_parallel and par.pp_size == 1:
        lines.append("--enable-vocab-parallel has no effect with --pipeline-model-parallel-size 1: the one rank "
                     "holds the whole output layer (turned off)")
    profiled = SPECS[schedule].profiled and par.pp_size > 1
    if args.pipeline_profile_iters != _PROFILE_ITERS_DEFAULT and not profiled:
        lines.append(f"--pipeline-profile-iters {args.pipeline_profile_iters} has no effect: only the auto and "
                     f"zb-h2 schedules at --pipeline-model-parallel-size > 1 profile (this run: {schedule}, pp "
                     f"{par.pp_size})")
    return lines


def _checkpoint(args: argparse.Namespace) -> list[str]:
    if args.save is not None:
        return []
    given = [f"--save-interval {args.save_interval}" if args.save_interval is not None else None,
             f"--keep-last-n {args.keep_last_n}" if args.keep_last_n is not None else None,
             "--async-save" if args.async_save else None, "--overwrite-save" if args.overwrite_save else None,
             f"--ckpt-format {args.ckpt_format}" if args.ckpt_format != "torch" else None]
    return [f"{flag} has no effect without --save: no checkpoint is written" for flag in given if flag]


def _exit_signal(args: argparse.Namespace) -> list[str]:
    if args.exit_signal_handler or args.exit_signal == signal.SIGTERM:
        return []
    return [f"--exit-signal {args.exit_signal.name} has no effect without --exit-signal-handler: that signal "
            "stops the run without saving"]


def _reliability(args: argparse.Namespace) -> list[str]:
    """The straggler detector's and the hang watch's options without the flag that turns each on; a job torchrun
    may restart that would not resume (issue 46)."""
    lines = []
    if not args.log_straggler:
        count, threshold = args.straggler_minmax_count, args.straggler_threshold
        given = [f"--straggler-minmax-count {count}" if count != 1 else None,
                 f"--straggler-threshold {threshold:g}" if threshold != 1.1 else None]
        lines += [f"{flag} has no effect without --log-straggler: no rank is compared" for flag in given if flag]
    if args.hang_report_keep_waiting and args.hang_report_seconds == 0:
        lines.append("--hang-report-keep-waiting has no effect with --hang-report-seconds 0: no hang is reported")
    restart = restart_notice(args.save, args.load)
    return lines + ([restart] if restart else [])


def noop_notices(args: argparse.Namespace, par: ParallelConfig) -> list[str]:
    """One 'notice: ...' line per flag given that does nothing with this layout."""
    lines = []
    if args.sequence_parallel and par.tp_size == 1:
        lines.append("--sequence-parallel has no effect with --tensor-model-parallel-size 1: there is no other "
                     "tensor-parallel rank to split the sequence over (turned off)")
    if par.cp_size == 1 and args.cp_comm_type != ["p2p"]:
        lines.append(f"--cp-comm-type {' '.join(args.cp_comm_type)} has no effect with --context-parallel-size 1: "
                     "each rank holds whole sequences")
    if par.cp_size > 1 and args.use_flash_attn:
        lines.append(f"--use-flash-attn has no effect with --context-parallel-size {par.cp_size}: context-parallel "
                     "attention runs its own per-block kernel with the log-sum-exp (the CPU flash kernel on CPU, "
                     "plain matmuls elsewhere; docs/context_parallel.md)")
    if args.decoupled_min_lr is not None and args.decoupled_lr is None:
        lines.append(f"--decoupled-min-lr {args.decoupled_min_lr:g} has no effect without --decoupled-lr (as in "
                     "Megatron-LM): the embedding and output layer follow --lr and --min-lr")
    lines += _data_parallel(args, par) + _pipeline(args, par) + _checkpoint(args) + _exit_signal(args)
    lines += _reliability(args)
    return ["notice: " + line for line in lines]

"""Training length, batch sizes, evaluation and the learning-rate schedule from the flags (Megatron's rules).

Training is iteration-based (--train-iters, with --lr-warmup-iters / --lr-decay-iters) or sample-based
(--train-samples, with --lr-warmup-samples / --lr-decay-samples and --rampup-batch-size), never a mix;
--lr-warmup-fraction replaces either warmup. A sample-based run still gets its iteration count:
train_samples // global batch size, or Megatron's count through the ramp-up.
"""
from __future__ import annotations

import argparse

from llamapipe.core.config import ArgumentError, OptimizerConfig, ParallelConfig, TrainingConfig
from llamapipe.core.num_microbatches_calculator import (check_rampup_batch_size, microbatches_per_step,
                                                         train_iters_for_samples)
from llamapipe.training.arguments.pipeline import check_seq_pieces

DEFAULT_TRAIN_ITERS = 10    # when neither --train-iters nor --train-samples is given (Megatron requires one)
# The schedules build a plan with a few actions per microbatch and rank before the first step, so a mistyped
# --global-batch-size (1e11) would grow memory for hours with no output; real runs use at most thousands.
MAX_MICROBATCHES = 10 ** 6


def _check_iteration_based(args: argparse.Namespace) -> None:
    for flag, given in (("--lr-decay-samples", args.lr_decay_samples is not None),
                        ("--lr-warmup-samples", bool(args.lr_warmup_samples))):
        if given:
            raise ArgumentError(f"{flag} {getattr(args, flag[2:].replace('-', '_'))} needs sample-based training "
                                "(--train-samples); with --train-iters use " + flag.replace("samples", "iters"))
    if args.rampup_batch_size is not None:
        raise ArgumentError(f"--rampup-batch-size {' '.join(map(str, args.rampup_batch_size))} needs "
                            "sample-based training: give --train-samples instead of --train-iters")
    if args.lr_warmup_fraction is not None and args.lr_warmup_iters:
        raise ArgumentError(f"--lr-warmup-fraction {args.lr_warmup_fraction} and --lr-warmup-iters "
                            f"{args.lr_warmup_iters} both set the warmup; give one")


def _check_sample_based(args: argparse.Namespace) -> None:
    for flag, given in (("--lr-decay-iters", args.lr_decay_iters is not None),
                        ("--lr-warmup-iters", bool(args.lr_warmup_iters))):
        if given:
            raise ArgumentError(f"{flag} {getattr(args, flag[2:].replace('-', '_'))} is iteration-based, but "
                                f"--train-samples {args.train_samples} is given; use "
                                + flag.replace("iters", "samples"))
    if args.lr_warmup_fraction is not None and args.lr_warmup_samples:
        raise ArgumentError(f"--lr-warmup-fraction {args.lr_warmup_fraction} and --lr-warmup-samples "
                            f"{args.lr_warmup_samples} both set the warmup; give one")


def _train_iters(args: argparse.Namespace, gbs: int, par: ParallelConfig) -> int:
    if args.train_samples is None:
        _check_iteration_based(args)
        return args.train_iters if args.train_iters is not None else DEFAULT_TRAIN_ITERS
    if args.train_iters is not None:
        raise ArgumentError(f"--train-iters {args.train_iters} and --train-samples {args.train_samples} both set "
                            "the training length; give one")
    _check_sample_based(args)
    ramp = tuple(args.rampup_batch_size) if args.rampup_batch_size is not None else None
    if ramp is not None:
        check_rampup_batch_size(ramp, gbs, args.micro_batch_size, par.dp_size, par.pp_size)
    iters = train_iters_for_samples(args.train_samples, gbs, ramp)
    if iters < 1:
        raise ArgumentError(f"--train-samples {args.train_samples} is less than one global batch ({gbs})")
    return iters


def _eval_iters(args: argparse.Namespace) -> int:
    if args.eval_iters < -1:
        raise ArgumentError(f"--eval-iters {args.eval_iters} must be positive, or 0 or -1 for no evaluation")
    if args.eval_interval is not None and args.eval_iters <= 0:
        raise ArgumentError(f"--eval-interval {args.eval_interval} needs --eval-iters > 0, got {args.eval_iters}")
    return max(args.eval_iters, 0)


def training_config(args: argparse.Namespace, par: ParallelConfig, seq_length: int) -> TrainingConfig:
    """`seq_length` is the run's (--seq-length, or the preset default that model_args resolves)."""
    mbs, dp = args.micro_batch_size, par.dp_size
    check_seq_pieces(par, seq_length)
    gbs = args.global_batch_size if args.global_batch_size is not None else mbs * dp
    num_microbatches = microbatches_per_step(gbs, mbs, dp)
    if num_microbatches > MAX_MICROBATCHES:
        raise ArgumentError(f"--global-batch-size {gbs} / (--micro-batch-size {mbs} x data-parallel size {dp}) = "
                            f"{num_microbatches} microbatches per step, more than {MAX_MICROBATCHES}; lower "
                            "--global-batch-size or raise --micro-batch-size")
    train_iters = _train_iters(args, gbs, par)
    decay_iters = args.lr_decay_iters if args.lr_decay_iters is not None else train_iters
    if args.lr_warmup_iters > decay_iters:
        raise ArgumentError(f"--lr-warmup-iters {args.lr_warmup_iters} is longer than the decay length "
                            f"({decay_iters}, from --lr-decay-iters or --train-iters)")
    decay_samples = args.lr_decay_samples if args.lr_decay_samples is not None else args.train_samples
    if args.lr_warmup_samples and args.lr_warmup_samples > decay_samples:
        raise ArgumentError(f"--lr-warmup-samples {args.lr_warmup_samples} is longer than the decay length "
                            f"({decay_samples}, from --lr-decay-samples or --train-samples)")
    return TrainingConfig(micro_batch_size=mbs, global_batch_size=gbs, seq_length=seq_length,
                          train_iters=train_iters, seed=args.seed, eval_interval=args.eval_interval,
                          eval_iters=_eval_iters(args), exit_interval=args.exit_interval,
                          exit_duration_in_mins=args.exit_duration_in_mins,
                          exit_signal_handler=args.exit_signal_handler, exit_signal=args.exit_signal.name,
                          skip_nonfinite_steps=args.skip_nonfinite_steps, num_microbatches=num_microbatches,
                          profile_iters=args.pipeline_profile_iters,
                          keep_host_memory=not args.release_host_memory, train_samples=args.train_samples,
                          rampup_batch_size=tuple(args.rampup_batch_size) if args.rampup_batch_size else None,
                          calculate_per_token_loss=args.calculate_per_token_loss, manual_gc=args.manual_gc,
                          manual_gc_interval=args.manual_gc_interval, manual_gc_eval=args.manual_gc_eval,
                          compile=args.compile, post_validation=args.enable_optimizer_post_validation)


def optimizer_config(args: argparse.Namespace, par: ParallelConfig) -> OptimizerConfig:
    """ZeRO-1 is the resolved sharding strategy optim (par), however the flags asked for it."""
    if args.lr_warmup_fraction is not None and not 0 <= args.lr_warmup_fraction <= 1:
        raise ArgumentError(f"--lr-warmup-fraction {args.lr_warmup_fraction} must be between 0 and 1")
    return OptimizerConfig(lr=args.lr, min_lr=args.min_lr, lr_decay_style=args.lr_decay_style,
                           lr_warmup_iters=args.lr_warmup_iters, lr_decay_iters=args.lr_decay_iters,
                           lr_warmup_samples=args.lr_warmup_samples, lr_decay_samples=args.lr_decay_samples,
                           lr_warmup_fraction=args.lr_warmup_fraction, decoupled_lr=args.decoupled_lr,
                           decoupled_min_lr=args.decoupled_min_lr,
                           weight_decay=args.weight_decay, adam_beta1=args.adam_beta1, adam_beta2=args.adam_beta2,
                           adam_eps=args.adam_eps, clip_grad=args.clip_grad, bf16=args.bf16, fp16=args.fp16,
                           loss_scale=args.loss_scale, initial_loss_scale=args.initial_loss_scale,
                           min_loss_scale=args.min_loss_scale, loss_scale_window=args.loss_scale_window,
                           hysteresis=args.hysteresis,
                           use_distributed_optimizer=par.data_parallel_sharding_strategy == "optim",
                           optimizer_cpu_offload=args.optimizer_cpu_offload)

"""Validation of parsed command-line arguments: value ranges, and the parallel, checkpoint and logging configs.

Every inconsistent combination is rejected before any process group exists, with `ArgumentError`: one
plain sentence that names the flags and the numbers (docs/design.md section 2). The other concerns have
their own modules here (model_args, training_args, data_args, pipeline); `parser.config_from_args` calls
them in order, and the first failing check is the one reported.
"""
from __future__ import annotations

import argparse
import math
import os
from typing import Optional

import torch

from llamapipe.core.config import FSDP_STRATEGIES, ArgumentError, ParallelConfig
from llamapipe.core.context_parallel import COMM_TYPES
from llamapipe.core.parallel_state import AXES, DEFAULT_ORDER, full_order
from llamapipe.training.arguments.offload_args import check_offload, check_offload_modules
from llamapipe.training.checkpointing import catalog
from llamapipe.training.arguments.memory_limit import MemoryBytes
from llamapipe.core.pipeline_parallel.schedule_specs import SPECS, default_schedule
from llamapipe.training.arguments.pipeline import check_seq_splits, grouped_schedule, schedule_chunks, vpp_size
from llamapipe.training.flag_names import flag_message
from llamapipe.training.schedule_file import load_schedule
from llamapipe.training.config import CheckpointConfig, LoggingConfig
from llamapipe.safe_files import UnsafePathError, check_target


_POSITIVE = ("tensor_model_parallel_size", "pipeline_model_parallel_size", "context_parallel_size", "num_layers_per_virtual_pipeline_stage",
             "num_virtual_stages_per_pipeline_rank",
             "micro_batch_size", "global_batch_size", "seq_length", "train_iters", "train_samples", "num_layers",
             "hidden_size", "ffn_hidden_size", "num_attention_heads", "num_query_groups", "kv_channels", "vocab_size",
             "max_position_embeddings", "make_vocab_size_divisible_by", "log_interval", "save_interval",
             "eval_interval", "exit_interval", "loss_scale_window", "hysteresis", "keep_last_n",
             "recompute_num_layers", "pipeline_profile_iters", "distributed_timeout_minutes", "pipeline_memory_limit",
             "rotary_base", "norm_epsilon", "lr_decay_iters", "lr_decay_samples", "exit_duration_in_mins",
             "adam_eps", "init_method_std", "loss_scale", "initial_loss_scale", "min_loss_scale")
_NON_NEGATIVE = ("lr_warmup_iters", "lr_warmup_samples", "weight_decay", "clip_grad", "min_lr", "num_workers", "seed",
                 "manual_gc_interval")


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def check_finite(args: argparse.Namespace) -> None:
    """Every number flag parsed as a float: argparse's float() takes 'nan' and 'inf', which no flag means."""
    for name, value in vars(args).items():
        if isinstance(value, float) and not math.isfinite(value):
            raise ArgumentError(f"{_flag(name)} {value} is not a finite number")


def check_positive(args: argparse.Namespace, world_size: int) -> None:
    if world_size < 1:
        raise ArgumentError(f"WORLD_SIZE {world_size} must be positive")
    check_finite(args)
    for name in _POSITIVE:
        value = getattr(args, name)
        if value is not None and value <= 0:
            raise ArgumentError(f"{_flag(name)} {value} must be positive")
    for name in _NON_NEGATIVE:
        value = getattr(args, name)
        if value is not None and value < 0:
            raise ArgumentError(f"{_flag(name)} {value} must not be negative")
    if args.lr <= 0:
        raise ArgumentError(f"--lr {args.lr} must be positive")
    if args.min_lr > args.lr:
        raise ArgumentError(f"--min-lr {args.min_lr} is larger than --lr {args.lr}")
    for name in ("adam_beta1", "adam_beta2"):
        if not 0 <= getattr(args, name) < 1:
            raise ArgumentError(f"{_flag(name)} {getattr(args, name)} must be in [0, 1): Adam's moving averages "
                                "would not decay")


def parallel_config(args: argparse.Namespace, world_size: int, num_layers: int) -> ParallelConfig:
    """The layout; `num_layers` is the model's (from --num-layers or the --model preset)."""
    tp, pp, cp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size, args.context_parallel_size
    if world_size % (tp * cp * pp):
        cp_text = f" x --context-parallel-size ({cp})" if cp > 1 else ""
        raise ArgumentError(f"world size {world_size} is not divisible by --tensor-model-parallel-size ({tp})"
                            f"{cp_text} x --pipeline-model-parallel-size ({pp})")
    order = rank_order(args.parallel_order)
    cp_comm_type = context_parallel_comm_type(args, cp)
    sequence_parallel = args.sequence_parallel and tp > 1     # at tp 1 a notice says so (noop.py)
    backend = args.distributed_backend or ("nccl" if torch.cuda.is_available() else "gloo")
    if backend == "nccl" and not torch.cuda.is_available():
        raise ArgumentError("--distributed-backend nccl needs CUDA, which is not available; use gloo")
    vpp = vpp_size(args, num_layers)
    schedule = grouped_schedule(args, args.pipeline_schedule or default_schedule(vpp), pp)
    try:
        spec = load_schedule(schedule)     # a name in the table, or file:PATH (read and verified)
    except ValueError as err:
        raise ArgumentError(flag_message(err)) from None
    vpp = schedule_chunks(args, spec, vpp, num_layers)
    if args.fp16 and args.bf16:
        raise ArgumentError("--fp16 and --bf16 cannot be used together")
    if args.ddp_bucket_size is not None and args.ddp_bucket_size < 1:
        raise ArgumentError(f"--ddp-bucket-size must be a positive number of elements, got {args.ddp_bucket_size}")
    strategy = data_parallel_sharding_strategy(args)
    offload_chunks, offload_time = check_offload(args, pp, vpp)
    if args.offload_weight_grad_inputs and schedule in SPECS and not SPECS[schedule].zero_bubble:
        raise ArgumentError(f"--offload-weight-grad-inputs moves what a deferred weight gradient holds from its B to "
                            f"its W, but --pipeline-schedule {schedule} runs them together; use a zero-bubble schedule "
                            "(zb-h1, zbv, v-half, auto)")
    modules, fraction, min_numel, delta = check_offload_modules(args)
    seq_splits = check_seq_splits(args, schedule, pp, args.enable_vocab_parallel and pp > 1, offload_chunks > 0)
    limit = args.pipeline_memory_limit
    return ParallelConfig(world_size=world_size, tp_size=tp, pp_size=pp, vpp_size=vpp,
                          dp_size=world_size // (tp * cp * pp), cp_size=cp, cp_comm_type=cp_comm_type, order=order,
                          cp_a2a_size=cp_a2a_size(args, cp, cp_comm_type),
                          sequence_parallel=sequence_parallel, pipeline_schedule=schedule,
                          pipeline_memory_limit=None if isinstance(limit, MemoryBytes) else limit,
                          pipeline_memory_limit_bytes=int(limit) if isinstance(limit, MemoryBytes) else None,
                          first_stage_layers=args.decoder_first_pipeline_num_layers,
                          last_stage_layers=args.decoder_last_pipeline_num_layers, distributed_backend=backend,
                          account_for_embedding=args.account_for_embedding_in_pipeline_split,
                          account_for_loss=args.account_for_loss_in_pipeline_split,
                          pipeline_layout=args.pipeline_model_parallel_layout,
                          distributed_timeout_minutes=args.distributed_timeout_minutes,
                          data_parallel_sharding_strategy=strategy,
                          overlap_grad_reduce=args.overlap_grad_reduce,
                          vocab_parallel=args.enable_vocab_parallel and pp > 1,   # pp 1: a notice (noop.py)
                          offload_chunk_num=offload_chunks, offload_time=offload_time, offload_modules=modules,
                          offload_fraction=fraction, offload_min_numel=min_numel, offload_rank_delta_bytes=delta,
                          offload_held=args.offload_weight_grad_inputs,
                          ddp_bucket_size=args.ddp_bucket_size or ParallelConfig.ddp_bucket_size,
                          num_seq_splits=seq_splits, seq_split_balance=args.seq1f1b_balance_method)


def rank_order(order: str) -> str:
    """--parallel-order with every axis (full_order: one without cp gets it right after tp)."""
    axes = order.split("-")
    if not {"tp", "dp", "pp"} <= set(axes) or len(set(axes)) != len(axes) or not set(axes) <= set(AXES):
        raise ArgumentError(f"--parallel-order {order} must name tp, dp and pp once each, and may name cp once, "
                            f"e.g. {DEFAULT_ORDER} or tp-dp-pp")
    return full_order(order)


def context_parallel_comm_type(args: argparse.Namespace, cp: int) -> str:
    """The one --cp-comm-type (Megatron also takes one per layer: accepted when all alike)."""
    given = list(dict.fromkeys(args.cp_comm_type))
    for value in given:
        if value not in COMM_TYPES:
            raise ArgumentError(f"--cp-comm-type {value} is not one of {', '.join(COMM_TYPES)}")
    if len(given) > 1:
        raise ArgumentError(f"--cp-comm-type {' '.join(args.cp_comm_type)} gives layers different communication "
                            "types, which is not supported; give one")
    return given[0]


def cp_a2a_size(args: argparse.Namespace, cp: int, comm: str) -> Optional[int]:
    """The a2a level of --cp-comm-type a2a+p2p: the first of --hierarchical-context-parallel-sizes A P (Megatron's
    order: A consecutive CP ranks exchange heads, the ring runs over P), whose product must be the CP size."""
    sizes = args.hierarchical_context_parallel_sizes
    if cp == 1:     # --cp-comm-type has no effect then (a notice: noop.py)
        return None
    if comm != "a2a+p2p":
        if sizes is not None:
            raise ArgumentError(f"--hierarchical-context-parallel-sizes {' '.join(map(str, sizes))} is for "
                                f"--cp-comm-type a2a+p2p, not {comm}")
        return None
    if sizes is None or len(sizes) != 2 or min(sizes) < 1 or sizes[0] * sizes[1] != cp:
        got = ' '.join(map(str, sizes)) if sizes else "none"
        raise ArgumentError(f"--cp-comm-type a2a+p2p needs --hierarchical-context-parallel-sizes A P (the all-to-all "
                            f"and ring levels) with A x P = --context-parallel-size ({cp}); got {got}")
    return sizes[0]


# flags whose code reads whole (unsharded) parameters or gradients, which ZeRO-2/3 keep only as shards
_NOT_WITH_FSDP = ("log_params_norm", "log_num_zeros_in_grad", "enable_optimizer_post_validation", "compile")


def data_parallel_sharding_strategy(args: argparse.Namespace) -> str:
    """The effective --data-parallel-sharding-strategy, from it, --use-distributed-optimizer (optim, ZeRO-1) or
    --use-torch-fsdp2 (optim_grads_params, ZeRO-3)."""
    strategy, zero3 = args.data_parallel_sharding_strategy, FSDP_STRATEGIES[-1]
    if args.use_torch_fsdp2:
        typed = getattr(args, "data_parallel_sharding_strategy_given", False)
        if strategy != zero3 and (strategy != "no_shard" or typed):     # the default no_shard is not a choice
            raise ArgumentError(f"--use-torch-fsdp2 selects ZeRO-3 ({zero3}) and cannot be combined with "
                                f"--data-parallel-sharding-strategy {strategy}")
        strategy = zero3
    if args.use_distributed_optimizer and strategy == "no_shard":
        strategy = "optim"
    if strategy in FSDP_STRATEGIES:
        if args.use_distributed_optimizer:
            raise ArgumentError(f"--use-distributed-optimizer (ZeRO-1) cannot be combined with "
                                f"--data-parallel-sharding-strategy {strategy}, which shards the optimizer itself")
        for name in _NOT_WITH_FSDP:
            if getattr(args, name, False):
                raise ArgumentError(f"{_flag(name)} is not supported with --data-parallel-sharding-strategy "
                                    f"{strategy} (parameters and gradients exist only as data-parallel shards)")
    return strategy


def checkpoint_config(args: argparse.Namespace, family: str = "llama") -> CheckpointConfig:
    # --load equal to --save may not exist yet: the first launch of a restartable (torchrun) job.
    if args.load is not None and not os.path.isdir(args.load) and args.load != args.save:
        raise ArgumentError(f"--load {args.load} is not a directory")
    if args.save is not None and os.path.lexists(args.save) and not os.path.isdir(args.save):
        if os.path.islink(args.save) and not os.path.exists(args.save):
            raise ArgumentError(f"--save {args.save} is a dangling symbolic link (to {os.readlink(args.save)}, which "
                                "does not exist); create that directory or give another --save")
        raise ArgumentError(f"--save {args.save} is a file, not a directory; checkpoints go into a directory")
    if args.ckpt_format not in ("torch", "torch_dist"):
        raise ArgumentError(f"--ckpt-format {args.ckpt_format} is not supported: give torch (llamapipe's checkpoints) "
                            "or torch_dist (Megatron-LM's as well)")
    if args.ckpt_format == "torch_dist" and family != "llama":
        raise ArgumentError(f"--ckpt-format torch_dist writes Megatron-LM's LLaMA-shaped GPTModel, but this run's model "
                            f"is a {family} model; save with --ckpt-format torch")
    megatron = args.save if args.ckpt_format == "torch_dist" and args.save is not None else None
    return CheckpointConfig(save=args.save if megatron is None else os.path.join(megatron, catalog.OURS),
                            megatron_save=megatron, save_interval=args.save_interval, load=args.load,
                            no_load_optim=args.no_load_optim, no_load_rng=args.no_load_rng,
                            finetune=args.finetune, keep_last_n=args.keep_last_n,
                            override_opt_param_scheduler=args.override_opt_param_scheduler,
                            use_checkpoint_opt_param_scheduler=args.use_checkpoint_opt_param_scheduler,
                            async_save=args.async_save, allow_tokenizer_change=args.allow_tokenizer_change,
                            overwrite_save=args.overwrite_save)


def logging_config(args: argparse.Namespace) -> LoggingConfig:
    if args.straggler_minmax_count < 1:
        raise ArgumentError(f"--straggler-minmax-count {args.straggler_minmax_count} must be at least 1")
    if not 1.0 < args.straggler_threshold < float("inf"):
        raise ArgumentError(f"--straggler-threshold {args.straggler_threshold} must be a ratio above 1 "
                            "(e.g. 1.1: 10% more compute than the fastest replica)")
    return LoggingConfig(log_straggler=args.log_straggler, straggler_minmax_count=args.straggler_minmax_count,
                         straggler_threshold=args.straggler_threshold,
                         log_interval=args.log_interval, tensorboard_dir=args.tensorboard_dir,
                         metrics_jsonl=args.metrics_jsonl, log_throughput=args.log_throughput,
                         log_params_norm=args.log_params_norm, log_num_zeros_in_grad=args.log_num_zeros_in_grad,
                         wandb_project=args.wandb_project, wandb_exp_name=args.wandb_exp_name,
                         wandb_save_dir=args.wandb_save_dir, timing_log_level=args.timing_log_level,
                         timing_log_option=args.timing_log_option, pipeline_trace=args.pipeline_trace,
                         profile_step_start=args.profile_step_start, profile_step_end=args.profile_step_end,
                         profile_ranks=None if args.profile_ranks is None else tuple(args.profile_ranks),
                         hang_report_seconds=hang_report_seconds(args),
                         hang_report_keep_waiting=args.hang_report_keep_waiting)


MIN_HANG_REPORT_SECONDS = 1.0     # shorter, one action of a healthy step would be taken for a hang


def hang_report_seconds(args: argparse.Namespace) -> float:
    """--hang-report-seconds: below the collectives' timeout, which would end a hung step without a report."""
    timeout_s = args.distributed_timeout_minutes * 60
    seconds = args.hang_report_seconds
    if seconds is None:      # off when half the timeout is too short to tell a hang (collectives end it then)
        default = min(300.0, timeout_s / 2)
        return default if default >= MIN_HANG_REPORT_SECONDS else 0.0
    if seconds < 0:
        raise ArgumentError(f"--hang-report-seconds must be 0 (off) or positive, got {seconds:g}")
    if 0 < seconds < MIN_HANG_REPORT_SECONDS:
        raise ArgumentError(f"--hang-report-seconds {seconds:g} is below {MIN_HANG_REPORT_SECONDS:g} s: one action "
                            "of a healthy step takes that long, and the run would be reported hung and ended; "
                            f"give 0 (off) or at least {MIN_HANG_REPORT_SECONDS:g}")
    if seconds >= timeout_s:
        raise ArgumentError(f"--hang-report-seconds {seconds:g} must be below --distributed-timeout-minutes "
                            f"{args.distributed_timeout_minutes:g} ({timeout_s:g} s): a collective would time out "
                            "before the hang is reported")
    return seconds


def check_trace(args: argparse.Namespace, world_size: int, notices: list[str], train_iters: int) -> None:
    """--pipeline-trace with Megatron's profile window flags: a window that opens inside the run, ranks that
    exist. A window that the run ends inside is traced up to the run's last iteration, and said so."""
    window = f"--profile-step-start {args.profile_step_start} and --profile-step-end {args.profile_step_end}"
    if args.pipeline_trace is None:
        given = [f for f, v in (("--profile-step-start", args.profile_step_start != 10),
                                ("--profile-step-end", args.profile_step_end != 12),
                                ("--profile-ranks", args.profile_ranks is not None)) if v]
        if given:
            notices.append(f"notice: {' and '.join(given)} take effect with --pipeline-trace PATH (a merged "
                           "Chrome trace of those iterations); without it nothing is traced")
        return
    if not 0 <= args.profile_step_start < args.profile_step_end:
        raise ArgumentError(f"--pipeline-trace needs 0 <= --profile-step-start < --profile-step-end; {window} "
                            "trace no iteration")
    try:
        check_target(args.pipeline_trace)
    except UnsafePathError as err:
        raise ArgumentError(f"--pipeline-trace: {err}") from None
    if args.profile_step_start >= train_iters:
        raise ArgumentError(f"--pipeline-trace: {window} trace iterations {args.profile_step_start + 1}-"
                            f"{args.profile_step_end}, but the run ends at iteration {train_iters}; set "
                            f"--profile-step-start {max(train_iters - 2, 0)} --profile-step-end {train_iters} to "
                            "trace its last iterations")
    if args.profile_step_end > train_iters:
        notices.append(f"notice: the run ends at iteration {train_iters}, inside the window of {window}: "
                       f"--pipeline-trace traces iterations {args.profile_step_start + 1}-{train_iters}")
    outside = [r for r in args.profile_ranks or () if not 0 <= r < world_size]
    if outside:
        raise ArgumentError(f"--profile-ranks {' '.join(map(str, outside))}: there are ranks 0 to {world_size - 1} "
                            f"only (world size {world_size})")

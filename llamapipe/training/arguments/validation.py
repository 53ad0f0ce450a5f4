"""Validation of parsed command-line arguments and the per-concern configs built from them.

Every inconsistent combination is rejected here (the pipeline layout's in `training/arguments/pipeline.py`),
before any process group exists, with `ArgumentError`: one plain sentence that names the flags and the
numbers (docs/design.md section 2). `llamapipe.training.arguments.parser` defines the flags and calls these in order; the first
failing check is the one reported.
"""
from __future__ import annotations

import argparse
import os
from typing import Sequence

import torch

from llamapipe.training.arguments.pipeline import check_layer_split, vpp_size
from llamapipe.core.config import ArgumentError, DataConfig, OptimizerConfig, ParallelConfig, SCHEDULES, TrainingConfig
from llamapipe.training.config import CheckpointConfig
from llamapipe.core.logger import get_logger
from llamapipe.core.pipeline_parallel.activation_memory import MemoryBytes
from llamapipe.model.config import LlamaConfig

log = get_logger()

_POSITIVE = ("tensor_model_parallel_size", "pipeline_model_parallel_size", "num_layers_per_virtual_pipeline_stage",
             "num_virtual_stages_per_pipeline_rank",
             "micro_batch_size", "global_batch_size", "seq_length", "train_iters", "num_layers", "hidden_size",
             "ffn_hidden_size", "num_attention_heads", "num_query_groups", "vocab_size", "max_position_embeddings",
             "make_vocab_size_divisible_by", "log_interval", "save_interval", "eval_interval", "exit_interval",
             "loss_scale_window", "hysteresis", "keep_last_n", "recompute_num_layers", "pipeline_profile_iters",
             "distributed_timeout_minutes", "pipeline_memory_limit", "rotary_base", "norm_epsilon")
_NON_NEGATIVE = ("lr_warmup_iters", "eval_iters", "weight_decay", "clip_grad", "min_lr", "num_workers", "seed")


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def check_positive(args: argparse.Namespace, world_size: int) -> None:
    if world_size < 1:
        raise ArgumentError(f"WORLD_SIZE {world_size} must be positive")
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


def parallel_config(args: argparse.Namespace, world_size: int) -> ParallelConfig:
    tp, pp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size
    if world_size % (tp * pp):
        raise ArgumentError(f"world size {world_size} is not divisible by --tensor-model-parallel-size ({tp}) "
                            f"x --pipeline-model-parallel-size ({pp})")
    axes = args.parallel_order.split("-")
    if sorted(axes) != ["dp", "pp", "tp"]:
        raise ArgumentError(f"--parallel-order {args.parallel_order} must name tp, dp and pp once each, e.g. tp-dp-pp")
    sequence_parallel = args.sequence_parallel
    if sequence_parallel and tp == 1:
        log.warning("--sequence-parallel has no effect with --tensor-model-parallel-size 1; turning it off")
        sequence_parallel = False
    backend = args.distributed_backend or ("nccl" if torch.cuda.is_available() else "gloo")
    if backend == "nccl" and not torch.cuda.is_available():
        raise ArgumentError("--distributed-backend nccl needs CUDA, which is not available; use gloo")
    vpp = vpp_size(args)
    schedule = args.pipeline_schedule or ("interleaved" if vpp > 1 else "1f1b")
    if schedule not in SCHEDULES:
        raise ArgumentError(f"--pipeline-schedule {schedule} is unknown; choose one of {', '.join(SCHEDULES)}")
    if args.fp16 and args.bf16:
        raise ArgumentError("--fp16 and --bf16 cannot be used together")
    if args.ddp_bucket_size is not None and args.ddp_bucket_size < 1:
        raise ArgumentError(f"--ddp-bucket-size must be a positive number of elements, got {args.ddp_bucket_size}")
    limit = args.pipeline_memory_limit
    return ParallelConfig(world_size=world_size, tp_size=tp, pp_size=pp, vpp_size=vpp,
                          dp_size=world_size // (tp * pp), order=args.parallel_order,
                          sequence_parallel=sequence_parallel, pipeline_schedule=schedule,
                          pipeline_memory_limit=None if isinstance(limit, MemoryBytes) else limit,
                          pipeline_memory_limit_bytes=int(limit) if isinstance(limit, MemoryBytes) else None,
                          first_stage_layers=args.decoder_first_pipeline_num_layers,
                          last_stage_layers=args.decoder_last_pipeline_num_layers, distributed_backend=backend,
                          account_for_embedding=args.account_for_embedding_in_pipeline_split,
                          account_for_loss=args.account_for_loss_in_pipeline_split,
                          distributed_timeout_minutes=args.distributed_timeout_minutes,
                          use_distributed_optimizer=args.use_distributed_optimizer,
                          overlap_grad_reduce=args.overlap_grad_reduce,
                          ddp_bucket_size=args.ddp_bucket_size or ParallelConfig.ddp_bucket_size)


def check_model(args: argparse.Namespace, m: LlamaConfig, par: ParallelConfig) -> None:
    tp, pp = par.tp_size, par.pp_size
    check_layer_split(args, m.num_layers, par)
    if m.hidden_size % m.num_attention_heads:
        raise ArgumentError(f"--hidden-size {m.hidden_size} is not divisible by "
                            f"--num-attention-heads ({m.num_attention_heads})")
    if m.num_attention_heads % tp:
        raise ArgumentError(f"--num-attention-heads {m.num_attention_heads} is not divisible by "
                            f"--tensor-model-parallel-size ({tp})")
    if m.num_attention_heads % m.num_query_groups:
        raise ArgumentError(f"--num-query-groups {m.num_query_groups} does not divide "
                            f"--num-attention-heads ({m.num_attention_heads})")
    if m.num_query_groups % tp:
        raise ArgumentError(f"--num-query-groups {m.num_query_groups} is not divisible by "
                            f"--tensor-model-parallel-size ({tp})")
    if m.ffn_hidden_size % tp:
        raise ArgumentError(f"--ffn-hidden-size {m.ffn_hidden_size} is not divisible by "
                            f"--tensor-model-parallel-size ({tp})")
    if args.seq_length > m.max_position_embeddings:
        raise ArgumentError(f"--seq-length {args.seq_length} is larger than "
                            f"--max-position-embeddings ({m.max_position_embeddings})")
    if par.sequence_parallel and args.seq_length % tp:
        raise ArgumentError(f"--seq-length {args.seq_length} is not divisible by --tensor-model-parallel-size "
                            f"({tp}), which --sequence-parallel needs")
    for flag in ("attention_dropout", "hidden_dropout"):
        if getattr(args, flag):
            raise ArgumentError(f"{_flag(flag)} {getattr(args, flag)} is not supported: LLaMA pretraining here "
                                "uses no dropout (accepted only as 0 for Megatron script compatibility)")
    if args.recompute_num_layers is not None and args.recompute_granularity != "full":
        raise ArgumentError(f"--recompute-num-layers {args.recompute_num_layers} needs --recompute-granularity full")
    if args.recompute_method == "uniform" and (args.recompute_num_layers or 1) > 1:
        raise ArgumentError(f"--recompute-method uniform with --recompute-num-layers {args.recompute_num_layers} "
                            "is not supported; use --recompute-method block (the first N layers of each chunk)")
    if m.tie_word_embeddings and pp > 1:
        raise ArgumentError("--tie-embeddings-and-output-weights is supported only with "
                            f"--pipeline-model-parallel-size 1 (got {pp})")


def training_config(args: argparse.Namespace, par: ParallelConfig) -> TrainingConfig:
    mbs, dp = args.micro_batch_size, par.dp_size
    gbs = args.global_batch_size if args.global_batch_size is not None else mbs * dp
    if gbs % (mbs * dp):
        raise ArgumentError(f"--global-batch-size {gbs} is not divisible by --micro-batch-size ({mbs}) "
                            f"x data-parallel size ({dp})")
    decay_iters = args.lr_decay_iters if args.lr_decay_iters is not None else args.train_iters
    if args.lr_warmup_iters > decay_iters:
        raise ArgumentError(f"--lr-warmup-iters {args.lr_warmup_iters} is longer than the decay length "
                            f"({decay_iters}, from --lr-decay-iters or --train-iters)")
    if args.eval_interval is not None and args.eval_iters == 0:
        raise ArgumentError(f"--eval-interval {args.eval_interval} needs --eval-iters > 0")
    return TrainingConfig(micro_batch_size=mbs, global_batch_size=gbs, seq_length=args.seq_length,
                          train_iters=args.train_iters, seed=args.seed, eval_interval=args.eval_interval,
                          eval_iters=args.eval_iters, exit_interval=args.exit_interval,
                          exit_duration_in_mins=args.exit_duration_in_mins,
                          exit_signal_handler=args.exit_signal_handler,
                          skip_nonfinite_steps=args.skip_nonfinite_steps, num_microbatches=gbs // (mbs * dp),
                          profile_iters=args.pipeline_profile_iters,
                          keep_host_memory=not args.release_host_memory)


def optimizer_config(args: argparse.Namespace) -> OptimizerConfig:
    return OptimizerConfig(lr=args.lr, min_lr=args.min_lr, lr_decay_style=args.lr_decay_style,
                           lr_warmup_iters=args.lr_warmup_iters, lr_decay_iters=args.lr_decay_iters,
                           weight_decay=args.weight_decay, adam_beta1=args.adam_beta1, adam_beta2=args.adam_beta2,
                           adam_eps=args.adam_eps, clip_grad=args.clip_grad, bf16=args.bf16, fp16=args.fp16,
                           loss_scale=args.loss_scale, initial_loss_scale=args.initial_loss_scale,
                           min_loss_scale=args.min_loss_scale, loss_scale_window=args.loss_scale_window,
                           hysteresis=args.hysteresis, use_distributed_optimizer=args.use_distributed_optimizer)


def data_config(args: argparse.Namespace) -> DataConfig:
    if not args.mock_data and not args.data_path:
        raise ArgumentError("give --data-path PREFIX (from llamapipe preprocess) or --mock-data")
    if args.tokenizer_model is not None and not os.path.exists(args.tokenizer_model):
        raise ArgumentError(f"--tokenizer-model {args.tokenizer_model} does not exist")
    if args.data_path and not args.mock_data:
        if args.tokenizer_model is None:
            raise ArgumentError("--data-path needs --tokenizer-model (the tokenizer used to preprocess it)")
        for prefix in _data_prefixes(args.data_path):
            for ext in (".bin", ".idx"):
                if not os.path.isfile(prefix + ext):
                    raise ArgumentError(f"--data-path {prefix}: file {prefix + ext} does not exist")
    parts = args.split.split(",")
    if len(parts) != 3 or not all(p.strip().replace(".", "", 1).isdigit() for p in parts) or \
            sum(float(p) for p in parts) <= 0:
        raise ArgumentError(f"--split {args.split} must be three non-negative numbers like 969,30,1")
    if args.eval_iters and float(parts[1]) == 0:
        raise ArgumentError(f"--eval-iters {args.eval_iters} needs validation data, but --split {args.split} "
                            "gives the validation set weight 0")
    return DataConfig(data_path=tuple(args.data_path or ()), split=args.split, tokenizer_model=args.tokenizer_model,
                      tokenizer_type=args.tokenizer_type,
                      mock_data=args.mock_data, data_cache_path=args.data_cache_path, num_workers=args.num_workers,
                      seq_length=args.seq_length, seed=args.seed)


def _data_prefixes(data_path: Sequence[str]) -> list[str]:
    """`A B` -> [A, B]; `0.3 A 0.7 B` -> [A, B] (weights checked for form here)."""
    try:
        float(data_path[0])
    except ValueError:
        return list(data_path)
    if len(data_path) % 2:
        raise ArgumentError(f"--data-path with weights needs weight/prefix pairs, got {len(data_path)} values")
    for weight in data_path[0::2]:
        try:
            if float(weight) <= 0:
                raise ValueError
        except ValueError:
            raise ArgumentError(f"--data-path weight {weight} must be a positive number") from None
    return list(data_path[1::2])


def checkpoint_config(args: argparse.Namespace) -> CheckpointConfig:
    # --load equal to --save may not exist yet: the first launch of a restartable (torchrun) job.
    if args.load is not None and not os.path.isdir(args.load) and args.load != args.save:
        raise ArgumentError(f"--load {args.load} is not a directory")
    return CheckpointConfig(save=args.save, save_interval=args.save_interval, load=args.load,
                            no_load_optim=args.no_load_optim, no_load_rng=args.no_load_rng,
                            finetune=args.finetune, keep_last_n=args.keep_last_n)

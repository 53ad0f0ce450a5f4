"""Validation of parsed command-line arguments and the per-concern configs built from them.

Every inconsistent combination is rejected here, before any process group exists, with `ArgumentError`:
one plain sentence that names the flags and the numbers (DESIGN.md section 2). `core.arguments` defines
the flags and calls these in order; the first failing check is the one reported.
"""
from __future__ import annotations

import argparse
import os
from typing import Optional, Sequence

import torch

from core.config import CheckpointConfig, DataConfig, OptimizerConfig, ParallelConfig, SCHEDULES, TrainingConfig
from core.logger import get_logger
from core.pipeline_parallel.activation_memory import MemoryBytes
from core.resharding import stage_layer_ranges
from model.config import PRESETS, LlamaConfig

log = get_logger()


class ArgumentError(ValueError):
    """A user-caused configuration error; the message is one plain sentence."""


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
    vpp = _vpp_size(args)
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


def _vpp_size(args: argparse.Namespace) -> int:
    per_vstage, chunks = args.num_layers_per_virtual_pipeline_stage, args.num_virtual_stages_per_pipeline_rank
    pp = args.pipeline_model_parallel_size
    if chunks is not None:
        if per_vstage is not None:
            raise ArgumentError(f"--num-layers-per-virtual-pipeline-stage {per_vstage} and "
                                f"--num-virtual-stages-per-pipeline-rank {chunks} both set the model chunks per "
                                "pipeline rank; give only one")
        if pp == 1 and chunks > 1:
            raise ArgumentError(f"--num-virtual-stages-per-pipeline-rank {chunks} needs "
                                "--pipeline-model-parallel-size > 1, got 1")
        return chunks           # the layer split over pp x chunks stages is checked with the model
    if per_vstage is None:
        return 1
    if pp == 1:
        raise ArgumentError("--num-layers-per-virtual-pipeline-stage needs --pipeline-model-parallel-size > 1")
    num_layers = args.num_layers if args.num_layers is not None else PRESETS[args.model]["num_layers"]
    units, said, total = _layer_units(num_layers, args.account_for_embedding_in_pipeline_split,
                                      args.account_for_loss_in_pipeline_split)
    if units > num_layers and units % pp:
        raise ArgumentError(f"{said} is not divisible by --pipeline-model-parallel-size {pp}")
    per_rank = units // pp
    if units % pp == 0 and per_rank % per_vstage:
        raise ArgumentError(f"layers per pipeline rank ({per_rank} = {total} / "
                            f"--pipeline-model-parallel-size {pp}) is not divisible by "
                            f"--num-layers-per-virtual-pipeline-stage ({per_vstage})")
    return max(per_rank // per_vstage, 1)


def virtual_stage_flag(args: argparse.Namespace) -> Optional[str]:
    """The flag (with its value) that set the model chunks per rank, as the user gave it; None if neither."""
    for name in ("num_layers_per_virtual_pipeline_stage", "num_virtual_stages_per_pipeline_rank"):
        if getattr(args, name, None) is not None:
            return f"--{name.replace('_', '-')} {getattr(args, name)}"
    return None


def _layer_units(num_layers: int, embedding: bool, loss: bool) -> tuple[int, str, str]:
    """Layers counted by the split (the embedding / loss as one each when accounted for, as in Megatron),
    how to say that count ("(--num-layers 7 + 1 each for the loss) = 8 layers") and its sum alone."""
    counted = [part for part, on in (("embedding", embedding), ("loss", loss)) if on]
    if not counted:
        return num_layers, f"--num-layers {num_layers}", f"--num-layers {num_layers}"
    units, total = num_layers + len(counted), f"(--num-layers {num_layers} + 1 each for the {' and '.join(counted)})"
    return units, f"{total} = {units} layers", total


def _check_layer_split(args: argparse.Namespace, num_layers: int, par: ParallelConfig) -> None:
    """The even split, --decoder-first/last-pipeline-num-layers with one chunk per rank, or the split that
    counts the embedding / loss as layers (--account-for-*-in-pipeline-split)."""
    pp = par.pp_size
    uneven = [f"--decoder-{end}-pipeline-num-layers {n}" for end, n in
              (("first", par.first_stage_layers), ("last", par.last_stage_layers)) if n is not None]
    if uneven:
        flags = " and ".join(uneven)
        if pp == 1:
            raise ArgumentError(f"{flags} needs --pipeline-model-parallel-size > 1")
        # a layer count per virtual stage contradicts an uneven split; one chunk per rank does not
        virtual = virtual_stage_flag(args)
        if args.num_layers_per_virtual_pipeline_stage is not None or par.vpp_size > 1:
            raise ArgumentError(f"{flags} splits layers per pipeline rank (one model chunk each) and cannot be "
                                f"combined with {virtual}")
        if par.pipeline_schedule in ("zbv", "interleaved"):
            raise ArgumentError(f"{flags} needs one model chunk per pipeline rank, but --pipeline-schedule "
                                f"{par.pipeline_schedule} uses two or more; use 1f1b, gpipe, zb-h1, zb-h2 or auto")
    elif num_layers % pp and not (par.account_for_embedding or par.account_for_loss):
        raise ArgumentError(f"--num-layers {num_layers} is not divisible by --pipeline-model-parallel-size ({pp})")
    elif args.num_virtual_stages_per_pipeline_rank is not None and par.vpp_size > 1:
        units, total, _ = _layer_units(num_layers, par.account_for_embedding, par.account_for_loss)
        if units % (pp * par.vpp_size):
            raise ArgumentError(f"{total} is not divisible by --pipeline-model-parallel-size {pp}"
                                f" x --num-virtual-stages-per-pipeline-rank {par.vpp_size} "
                                f"({pp * par.vpp_size} virtual stages)")
    try:
        stage_layer_ranges(num_layers, pp, par.vpp_size, par.first_stage_layers, par.last_stage_layers,
                           embedding=par.account_for_embedding, loss=par.account_for_loss)
    except ValueError as err:
        raise ArgumentError(str(err)) from None


def check_model(args: argparse.Namespace, m: LlamaConfig, par: ParallelConfig) -> None:
    tp, pp = par.tp_size, par.pp_size
    _check_layer_split(args, m.num_layers, par)
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


def check_schedule(args: argparse.Namespace, par: ParallelConfig, m: int, num_layers: int) -> None:
    s, pp, vpp = par.pipeline_schedule, par.pp_size, par.vpp_size
    if pp == 1:
        if s == "zbv":
            raise ArgumentError("--pipeline-schedule zbv needs --pipeline-model-parallel-size > 1")
        return
    if s == "zbv" and vpp != 2:
        units, total, _ = _layer_units(num_layers, par.account_for_embedding, par.account_for_loss)
        given = f" (from {virtual_stage_flag(args)})" if virtual_stage_flag(args) else ""
        fix = (f"; set --num-virtual-stages-per-pipeline-rank 2 (or --num-layers-per-virtual-pipeline-stage "
               f"{units // (2 * pp)})" if units % (2 * pp) == 0 else
               f", and {total} is not divisible by the 2 x --pipeline-model-parallel-size {pp} = {2 * pp} "
               "virtual stages that would need")
        raise ArgumentError(f"--pipeline-schedule zbv needs exactly 2 model chunks per pipeline rank, got {vpp}"
                            f"{given}{fix}")
    if s == "interleaved" and vpp < 2:
        raise ArgumentError("--pipeline-schedule interleaved needs 2 or more model chunks per pipeline rank: set "
                            "--num-virtual-stages-per-pipeline-rank or --num-layers-per-virtual-pipeline-stage")
    if s == "auto" and vpp > 2:
        raise ArgumentError(f"--pipeline-schedule auto supports 1 or 2 model chunks per pipeline rank, got {vpp} "
                            f"(from {virtual_stage_flag(args)})")
    if s != "auto" and (par.pipeline_memory_limit is not None or par.pipeline_memory_limit_bytes is not None):
        raise ArgumentError(f"--pipeline-memory-limit caps the auto schedule's plan; --pipeline-schedule {s} "
                            "has a fixed memory use, so drop the flag or use --pipeline-schedule auto")
    if s == "auto" and par.pipeline_memory_limit is not None and par.pipeline_memory_limit < vpp:
        raise ArgumentError(f"--pipeline-memory-limit {par.pipeline_memory_limit:g} is below the {vpp} activation "
                            "units one microbatch needs on all model chunks of a rank")
    if s in ("1f1b", "gpipe", "zb-h1", "zb-h2") and vpp > 1:
        raise ArgumentError(f"--pipeline-schedule {s} uses one model chunk per pipeline rank, got {vpp}; drop "
                            f"{virtual_stage_flag(args)} or use interleaved or zbv")
    if m < pp:
        raise ArgumentError(f"number of microbatches ({m} = --global-batch-size {m * args.micro_batch_size * par.dp_size}"
                            f" / (--micro-batch-size {args.micro_batch_size} x data-parallel size {par.dp_size})) "
                            f"is smaller than --pipeline-model-parallel-size ({pp}), which --pipeline-schedule {s} needs")


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
        raise ArgumentError("give --data-path PREFIX (from scripts/preprocess_data.py) or --mock-data")
    if args.tokenizer_model is not None and not os.path.isfile(args.tokenizer_model):
        raise ArgumentError(f"--tokenizer-model {args.tokenizer_model} does not exist")
    if args.data_path and not args.mock_data:
        if args.tokenizer_model is None:
            raise ArgumentError("--data-path needs --tokenizer-model (the sentencepiece model used to preprocess it)")
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

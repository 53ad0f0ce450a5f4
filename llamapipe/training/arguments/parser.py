"""Command-line arguments with Megatron-LM flag names -> validated, frozen `Config`.

The flags are defined here; every inconsistent combination is rejected by the checks in
`training/arguments/validation.py` (the pipeline layout's in `training/arguments/pipeline.py`), before any process
group exists, as one plain sentence that names the flags and the numbers (docs/design.md section 2).
"""
from __future__ import annotations

import argparse
import os
import sys
from typing import Optional, Sequence

from llamapipe.training.arguments.pipeline import check_schedule
from llamapipe.training.arguments.validation import (check_model, check_positive, checkpoint_config, data_config,
                                       optimizer_config, parallel_config, training_config)
from llamapipe.core.config import SCHEDULES, ArgumentError
from llamapipe.training.config import Config, LoggingConfig
from llamapipe.core.pipeline_parallel.activation_memory import memory_limit
from llamapipe.model.config import PRESETS, LlamaConfig

__all__ = ["ArgumentError", "build_parser", "config_from_args", "parse_args"]


def _add_parallel(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("parallelism")
    g.add_argument("--tensor-model-parallel-size", type=int, default=1)
    g.add_argument("--pipeline-model-parallel-size", type=int, default=1)
    g.add_argument("--num-layers-per-virtual-pipeline-stage", type=int, default=None)
    g.add_argument("--num-virtual-stages-per-pipeline-rank", type=int, default=None,
                   help="model chunks per pipeline rank (newer Megatron's alternative to "
                        "--num-layers-per-virtual-pipeline-stage)")
    g.add_argument("--decoder-first-pipeline-num-layers", type=int, default=None,
                   help="layers on the first pipeline stage (uneven split; the rest split evenly)")
    g.add_argument("--decoder-last-pipeline-num-layers", type=int, default=None,
                   help="layers on the last pipeline stage, e.g. fewer to balance the LM head and loss")
    g.add_argument("--account-for-embedding-in-pipeline-split", action="store_true",
                   help="count the embedding as one layer when splitting layers over (virtual) stages")
    g.add_argument("--account-for-loss-in-pipeline-split", action="store_true",
                   help="count the LM head and loss as one layer when splitting layers over (virtual) stages")
    g.add_argument("--sequence-parallel", action="store_true")
    g.add_argument("--pipeline-schedule", default=None,
                   help=f"one of {', '.join(SCHEDULES)} (default 1f1b, or interleaved with virtual stages)")
    g.add_argument("--pipeline-memory-limit", type=memory_limit, default=None,
                   help="auto schedule: activation memory cap per rank, in microbatch-chunk units (a number) "
                        "or bytes (e.g. 24GiB, 512MB), measured while profiling")
    g.add_argument("--parallel-order", default="tp-dp-pp", help="rank order, fastest-varying first")
    g.add_argument("--distributed-backend", choices=("nccl", "gloo"), default=None)
    g.add_argument("--distributed-timeout-minutes", type=float, default=10.0)
    g.add_argument("--use-distributed-optimizer", action="store_true")
    g.add_argument("--overlap-grad-reduce", action="store_true",
                   help="start each gradient bucket's data-parallel all-reduce during the backward")
    g.add_argument("--ddp-bucket-size", type=int, default=None,
                   help="elements per data-parallel gradient all-reduce bucket (default 25000000)")


def _add_model(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("model")
    g.add_argument("--model", default="tiny", choices=tuple(PRESETS))
    for flag, typ in (("--num-layers", int), ("--hidden-size", int), ("--ffn-hidden-size", int),
                      ("--num-attention-heads", int), ("--num-query-groups", int), ("--vocab-size", int),
                      ("--max-position-embeddings", int), ("--rotary-base", float),
                      ("--norm-epsilon", float), ("--make-vocab-size-divisible-by", int),
                      ("--init-method-std", float), ("--recompute-num-layers", int)):
        g.add_argument(flag, type=typ, default=None)
    g.add_argument("--group-query-attention", action="store_true")
    g.add_argument("--untie-embeddings-and-output-weights", action="store_true")
    g.add_argument("--tie-embeddings-and-output-weights", action="store_true")
    g.add_argument("--recompute-granularity", choices=("full", "selective"), default=None)
    g.add_argument("--recompute-method", choices=("uniform", "block"), default=None)
    # Accepted so Megatron LLaMA scripts run unchanged; LLaMA already is exactly this.
    g.add_argument("--swiglu", action="store_true")
    g.add_argument("--disable-bias-linear", action="store_true")
    g.add_argument("--use-rotary-position-embeddings", action="store_true")
    g.add_argument("--normalization", choices=("RMSNorm",), default="RMSNorm")
    g.add_argument("--position-embedding-type", choices=("rope",), default="rope")
    g.add_argument("--attention-dropout", type=float, default=0.0)
    g.add_argument("--hidden-dropout", type=float, default=0.0)


def _add_training(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("training")
    g.add_argument("--micro-batch-size", type=int, default=1)
    g.add_argument("--global-batch-size", type=int, default=None)
    g.add_argument("--seq-length", type=int, default=128)
    g.add_argument("--train-iters", type=int, default=10)
    g.add_argument("--seed", type=int, default=1234)
    g.add_argument("--eval-interval", type=int, default=None)
    g.add_argument("--eval-iters", type=int, default=0)
    g.add_argument("--exit-interval", type=int, default=None)
    g.add_argument("--exit-duration-in-mins", type=float, default=None)
    g.add_argument("--exit-signal-handler", action="store_true")
    g.add_argument("--skip-nonfinite-steps", action="store_true")
    g.add_argument("--pipeline-profile-iters", type=int, default=3,
                   help="auto and zb-h2 schedules: 1F1B iterations profiled before switching")
    g.add_argument("--release-host-memory", action="store_true",
                   help="CPU runs: let malloc return freed memory to the OS (glibc's default) instead of "
                        "keeping it for the next step")


def _add_optimizer(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("optimizer and precision")
    g.add_argument("--optimizer", choices=("adam",), default="adam")
    g.add_argument("--lr", type=float, default=3e-4)
    g.add_argument("--min-lr", type=float, default=0.0)
    g.add_argument("--lr-decay-style", choices=("constant", "linear", "cosine"), default="cosine")
    g.add_argument("--lr-warmup-iters", type=int, default=0)
    g.add_argument("--lr-decay-iters", type=int, default=None)
    g.add_argument("--weight-decay", type=float, default=0.1)
    g.add_argument("--adam-beta1", type=float, default=0.9)
    g.add_argument("--adam-beta2", type=float, default=0.95)
    g.add_argument("--adam-eps", type=float, default=1e-8)
    g.add_argument("--clip-grad", type=float, default=1.0)
    g.add_argument("--bf16", action="store_true")
    g.add_argument("--fp16", action="store_true")
    g.add_argument("--loss-scale", type=float, default=None)
    g.add_argument("--initial-loss-scale", type=float, default=2.0 ** 32)
    g.add_argument("--min-loss-scale", type=float, default=1.0)
    g.add_argument("--loss-scale-window", type=int, default=1000)
    g.add_argument("--hysteresis", type=int, default=2)


def _add_data_ckpt_logging(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("data")
    g.add_argument("--data-path", nargs="+", default=None)
    g.add_argument("--split", default="969,30,1")
    g.add_argument("--tokenizer-model", default=None)
    g.add_argument("--tokenizer-type", default=None,
                   choices=("SentencePieceTokenizer", "Llama2Tokenizer", "GPTSentencePieceTokenizer",
                            "HuggingFaceTokenizer"),
                   help="kind of --tokenizer-model; default: guessed from it (a .model file is sentencepiece, a "
                        "tokenizer.json or a directory holding one is HuggingFaceTokenizer, e.g. LLaMA 3's)")
    g.add_argument("--mock-data", action="store_true")
    g.add_argument("--data-cache-path", default=None)
    g.add_argument("--num-workers", type=int, default=0)
    g = p.add_argument_group("checkpointing")
    g.add_argument("--save", default=None)
    g.add_argument("--save-interval", type=int, default=None)
    g.add_argument("--load", default=None)
    g.add_argument("--no-load-optim", action="store_true")
    g.add_argument("--no-load-rng", action="store_true")
    g.add_argument("--finetune", action="store_true")
    g.add_argument("--keep-last-n", type=int, default=None)
    g = p.add_argument_group("logging")
    g.add_argument("--log-interval", type=int, default=1)
    g.add_argument("--tensorboard-dir", default=None)
    g.add_argument("--metrics-jsonl", default=None)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="pretrain_llama.py", description="Pretrain LLaMA with TP/PP/VPP/DP.")
    for add in (_add_parallel, _add_model, _add_training, _add_optimizer, _add_data_ckpt_logging):
        add(p)
    return p


def parse_args(argv: Optional[Sequence[str]] = None, world_size: Optional[int] = None) -> Config:
    """Parse and validate; on a user error print one line (rank 0 only) and exit with status 2."""
    args = build_parser().parse_args(argv)
    if world_size is None:
        world_size = int(os.environ.get("WORLD_SIZE", "1"))
    try:
        return config_from_args(args, world_size)
    except ArgumentError as err:
        if int(os.environ.get("RANK", "0")) == 0:
            sys.stderr.write(f"pretrain_llama.py: error: {err}\n")
        raise SystemExit(2)


def config_from_args(args: argparse.Namespace, world_size: int) -> Config:
    """Build the frozen `Config`; raises `ArgumentError` on any inconsistent combination."""
    check_positive(args, world_size)
    model = LlamaConfig.from_args(args)
    parallel = parallel_config(args, world_size)
    check_model(args, model, parallel)
    training = training_config(args, parallel)
    check_schedule(args, parallel, training.num_microbatches, model.num_layers)
    optimizer = optimizer_config(args)
    data = data_config(args)
    checkpoint = checkpoint_config(args)
    logging_cfg = LoggingConfig(log_interval=args.log_interval, tensorboard_dir=args.tensorboard_dir,
                                metrics_jsonl=args.metrics_jsonl)
    return Config(model=model, parallel=parallel, training=training, optimizer=optimizer, data=data,
                  checkpoint=checkpoint, logging=logging_cfg)

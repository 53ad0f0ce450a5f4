"""Command-line arguments with Megatron-LM flag names -> validated, frozen `Config`.

The flags are defined by concern (flags_model, flags_training, flags_data) with Megatron's meanings and
defaults; Megatron flags with no effect here or refused here are two tables (megatron_compat). Every
inconsistent combination is rejected before any process group exists, as one plain sentence that names
the flags and the numbers (docs/design.md section 2). As in Megatron, abbreviated flags are not accepted; a
mistyped flag gets one line with the closest flag instead of argparse's usage of every flag (about 150 lines).
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from typing import Optional, Sequence

from llamapipe.core.config import ArgumentError, DataConfig, TrainingConfig
from llamapipe.training.flag_names import worded_as_flags
from llamapipe.training.flag_parser import FlagParser
from llamapipe.core.logger import get_logger
from llamapipe.training.arguments.auto_layout import device_of, resolve_auto_layout
from llamapipe.training.arguments.checkpoint_args import with_checkpoint_args
from llamapipe.training.arguments.data_args import data_config, with_end_of_document
from llamapipe.training.arguments.flags_data import add_checkpoint_flags, add_data_flags, add_logging_flags
from llamapipe.training.arguments.flags_model import add_model_flags, add_parallel_flags
from llamapipe.training.arguments.flags_training import add_optimizer_flags, add_training_flags
from llamapipe.training.arguments.megatron_compat import add_compat_flags, check_compat
from llamapipe.training.arguments.memory import check_fits_memory, machine_memory_bytes
from llamapipe.training.arguments.noop import noop_notices
from llamapipe.training.arguments.model_args import (check_model, model_config, run_seq_length, run_tokenizer,
                                                      run_vocab_size)
from llamapipe.training.arguments.pipeline import check_schedule
from llamapipe.training.arguments.training_args import optimizer_config, training_config
from llamapipe.training.arguments.validation import (check_positive, check_trace, checkpoint_config, logging_config,
                                                   parallel_config)
from llamapipe.training.config import Config
from llamapipe.training.initialize import first_to_report

__all__ = ["ArgumentError", "build_parser", "config_from_args", "parse_args"]


class _JobFlagParser(FlagParser):
    """FlagParser whose error line is written by the first rank of the job to reach it (`first_to_report`)."""

    def error(self, message: str):
        if first_to_report():
            self.print_usage(sys.stderr)
            sys.stderr.write(f"{self.prog}: error: {message}\n")
        raise SystemExit(2)


def build_parser() -> argparse.ArgumentParser:
    p = _JobFlagParser(prog="pretrain_llama.py", description="Pretrain LLaMA with TP/PP/VPP/DP.",
                   usage="%(prog)s [flags]   (--help lists every flag)",
                   allow_abbrev=False, formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    for add in (add_parallel_flags, add_model_flags, add_training_flags, add_optimizer_flags, add_data_flags,
                add_checkpoint_flags, add_logging_flags, add_compat_flags):
        add(p)
    p.add_argument("--dry-run", action="store_true",
                   help="check this job without its machines instead of training: every distinct rank's setup and "
                        "one step on fake process groups and meta tensors, with --world-size N (llamapipe dry-run, "
                        "docs/dry_run.md)")
    return p


def parse_args(argv: Optional[Sequence[str]] = None, world_size: Optional[int] = None) -> Config:
    """Parse and validate; on a user error print one line (rank 0 only) and exit with status 2."""
    args = build_parser().parse_args(argv)
    if world_size is None:
        world_size = int(os.environ.get("WORLD_SIZE", "1"))
    try:
        return config_from_args(args, world_size, check_memory=True)
    except ArgumentError as err:
        if first_to_report():
            sys.stderr.write(f"pretrain_llama.py: error: {err}\n")
        raise SystemExit(2)


def config_from_args(args: argparse.Namespace, world_size: int, check_memory: bool = False) -> Config:
    """Build the frozen `Config`; raises `ArgumentError` on any inconsistent combination, and with
    `check_memory` on sizes that cannot fit in this machine's memory (so the other checks, and the tests of
    them, do not depend on the machine).

    The start-up notices (flags with no effect here, values taken from a checkpoint) are logged once the
    whole configuration is valid, so a refused run prints only its error line. The library's checks name config
    fields; their errors are re-raised naming the flags (`flag_names.worded_as_flags`).
    """
    with worded_as_flags():
        return _build_config(args, world_size, check_memory)


def _build_config(args: argparse.Namespace, world_size: int, check_memory: bool) -> Config:
    notices = check_compat(args)
    args = with_checkpoint_args(args, notices)      # a copy: `args` itself stays as parsed
    check_positive(args, world_size)
    model = model_config(args, notices)
    seq_length = run_seq_length(args)
    data = data_config(args)
    tokenizer = run_tokenizer(args)
    model = run_vocab_size(args, model, notices, tokenizer)     # the tokenizer's vocabulary, which the split counts
    # an explicit layout from here on; a context-parallel rank computes seq / cp tokens of each sequence
    cp = max(getattr(args, "context_parallel_size", 1) or 1, 1)
    args = resolve_auto_layout(args, model, seq_length // cp, device_of(args), notices)
    parallel = parallel_config(args, world_size, model.num_layers)
    check_model(args, model, parallel, seq_length)
    training = training_config(args, parallel, seq_length)
    check_schedule(args, parallel, training.num_microbatches, model.num_layers)
    data = with_end_of_document(data, tokenizer, post_validation=training.post_validation)
    training = _without_evaluation_if_no_validation_data(args, training, data, notices)
    notices += noop_notices(args, parallel)
    check_trace(args, world_size, notices, training.train_iters)
    if check_memory:
        check_fits_memory(model, parallel, training, args.bf16 or args.fp16,
                          machine_memory_bytes(parallel.distributed_backend),
                          int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    config = Config(model=model, parallel=parallel, training=training, optimizer=optimizer_config(args, parallel),
                    data=data, checkpoint=checkpoint_config(args, model.family), logging=logging_config(args))
    for line in notices:
        get_logger().info(line)
    return config


def _without_evaluation_if_no_validation_data(args: argparse.Namespace, training: TrainingConfig, data: DataConfig,
                                              notices: list[str]) -> TrainingConfig:
    """Megatron skips evaluation without validation data; asking for periodic evaluation then is an error."""
    if not training.eval_iters or data.has_split(1):
        return training
    source = "no --valid-data-path is given" if any(data.per_split_paths) else f"--split {data.split} gives it weight 0"
    if args.eval_interval is not None:
        raise ArgumentError(f"--eval-interval {args.eval_interval} needs validation data, but {source}")
    notices.append(f"notice: no evaluation: {source.replace('gives it', 'gives the validation set')}")
    return dataclasses.replace(training, eval_iters=0)

"""`llamapipe dry-run --world-size N <pretrain_llama.py flags>`: check a job of N ranks on this machine.

    llamapipe dry-run --world-size 1024 --model llama3-70b --tensor-model-parallel-size 8 \
        --pipeline-model-parallel-size 8 --num-virtual-stages-per-pipeline-rank 2 --pipeline-schedule zbv \
        --seq-length 8192 --micro-batch-size 1 --global-batch-size 256 --bf16 --sequence-parallel --mock-data \
        --train-iters 1000 --gpu-memory-gb 80

(`pretrain_llama.py --dry-run --world-size N ...` is the same.) The flags go through the real argument checks
(`training.arguments`), with the memory check against `--gpu-memory-gb` as the GPU run makes it; then every
distinct role runs its real setup on fake process groups and meta tensors (`rank.RoleRun`), and the report
(`report`) says what each rank holds and whether it fits. What the real run refuses is refused here with its
one line (`llamapipe dry-run: error: ...`, exit 2); a rank over the device's memory, or a pipeline message
whose two sides disagree, exits 1. `--load` (or `--dry-run-checkpoint-layout METADATA_JSON`) checks the resume.
The dry run uses no real process group, no network, and reads no data or checkpoint tensor: only the files'
names, the tokenizer (for the vocabulary size, as the real run reads it) and a checkpoint's metadata.json.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time
from typing import Optional, Sequence

from llamapipe.core.config import ArgumentError
from llamapipe.training.arguments.memory import check_fits_memory
from llamapipe.training.arguments.parser import build_parser as build_training_parser, config_from_args
from llamapipe.training.config import Config
from llamapipe.training.dry_run.checkpoint import ResumeSource
from llamapipe.training.dry_run.rank import RoleRun
from llamapipe.training.dry_run.report import GIB, JobResult, over_memory, ranges, role_rows, size, summary
from llamapipe.training.dry_run.world import roles
from llamapipe.training.log import check_wandb
from llamapipe.training.startup import startup_lines

PROG = "llamapipe dry-run"
HEADROOM = 0.9         # `llamapipe plan --headroom`'s default: the share of a GPU a job should plan to use


def build_parser() -> argparse.ArgumentParser:
    """pretrain_llama.py's flags and the dry run's own."""
    p = build_training_parser()
    p.prog = PROG
    group = p.add_argument_group("dry run")
    group.add_argument("--world-size", type=int, required=True, help="ranks of the job to check (torchrun's "
                       "--nnodes x --nproc-per-node)")
    group.add_argument("--gpu-memory-gb", type=float, default=80.0, help="memory of one GPU in GiB (2^30 bytes): the "
                       "ranks that would need more are named, those above 0.9 of it warned of")
    group.add_argument("--dry-run-checkpoint-layout", default=None, metavar="METADATA_JSON",
                       help="check the resume from a checkpoint's saved metadata.json instead of --load's files")
    return p


MAX_LAYERS = 4096      # 1,000 layers took 42 s; a million would run for hours and take the machine's memory
MAX_WORLD = 131072     # 16,384 ranks: 341 MiB; 10^9 would take any machine's memory


def dry_run_config(args: argparse.Namespace) -> Config:
    """The job's Config through the real checks, for the GPUs it will run on: NCCL unless --distributed-backend
    gloo is given (this machine needs no CUDA for it), and the memory check against --gpu-memory-gb."""
    if not args.gpu_memory_gb > 0:
        raise ArgumentError(f"--gpu-memory-gb {args.gpu_memory_gb:g} must be positive")
    if args.world_size < 1:
        raise ArgumentError(f"--world-size {args.world_size} must be positive")
    if args.world_size > MAX_WORLD:
        raise ArgumentError(f"--world-size {args.world_size:,} is more than the dry run checks ({MAX_WORLD:,} ranks: "
                            "its rank grid grows by about 20 MiB a thousand ranks)")
    backend = args.distributed_backend or "nccl"
    config = config_from_args(argparse.Namespace(**{**vars(args), "distributed_backend": "gloo"}), args.world_size)
    config = dataclasses.replace(config, parallel=dataclasses.replace(config.parallel, distributed_backend=backend))
    if config.model.num_layers > MAX_LAYERS:
        raise ArgumentError(f"--num-layers {config.model.num_layers} is more than the dry run checks ({MAX_LAYERS:,}: "
                            "it builds every layer of a stage on meta tensors, about 40 ms each, and the largest "
                            "published models have 126)")
    check_fits_memory(config.model, config.parallel, config.training, args.bf16 or args.fp16,
                      int(args.gpu_memory_gb * GIB))
    check_wandb(config.logging)
    return config


def resume_source(args: argparse.Namespace, config: Config) -> Optional[ResumeSource]:
    if args.dry_run_checkpoint_layout is not None:
        return ResumeSource.from_metadata(args.dry_run_checkpoint_layout)
    if config.checkpoint.load and os.path.isdir(config.checkpoint.load):
        return ResumeSource.from_load(config.checkpoint.load)
    return None


def run(config: Config, source: Optional[ResumeSource] = None, progress=None) -> JobResult:
    """Every role of the job, in rank order (`progress(i, n)` after each); raises what the real setup raises."""
    start = time.perf_counter()
    job, todo = RoleRun(config, resume=source), roles(config.parallel)
    reports = []
    for i, role in enumerate(todo, 1):
        reports.append(job.run(role))
        if progress is not None:
            progress(i, len(todo))
    return JobResult(reports, job.ledger.problems(), len(job.steps), time.perf_counter() - start)


def _progress(done: int, total: int) -> None:
    if sys.stderr.isatty():
        sys.stderr.write(f"\rdry run: {done}/{total} roles" + ("\n" if done == total else ""))


def report_lines(config: Config, result: JobResult, memory: float) -> list[str]:
    par = config.parallel
    head = (f"dry run: {par.world_size} ranks in {len(result.reports)} roles, one step of the plan on meta tensors "
            f"for each of {result.steps} distinct shards, {result.seconds:.1f} s")
    return [head, *startup_lines(config), *role_rows(result), *summary(config, result, memory)]


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    memory = args.gpu_memory_gb * GIB
    try:
        config = dry_run_config(args)
        result = run(config, resume_source(args, config), _progress)
    except ValueError as err:       # what the real run refuses (ArgumentError among them), with its line
        sys.stderr.write(f"{PROG}: error: {err}\n")
        return 2
    print("\n".join(report_lines(config, result, memory)))
    if result.problems:
        sys.stderr.write(f"{PROG}: error: {len(result.problems)} pipeline messages disagree between sender and "
                         f"receiver, e.g. {result.problems[0]}\n")
        return 1
    over = over_memory(result, memory)
    if over:
        worst = max(over, key=lambda r: r.total)
        ranks = ranges([rank for r in over for rank in r.role.ranks])
        sys.stderr.write(f"{PROG}: error: ranks {ranks} would not fit in --gpu-memory-gb {args.gpu_memory_gb:g}: "
                         f"{worst.role.name()} needs {size(worst.total)}\n")
        return 1
    worst = max(result.reports, key=lambda r: r.total)
    if worst.total > HEADROOM * memory:
        sys.stderr.write(f"{PROG}: warning: {worst.role.name()} needs {size(worst.total)}, "
                         f"{worst.total / memory:.0%} of --gpu-memory-gb {args.gpu_memory_gb:g} (GiB), above the "
                         f"{HEADROOM:g} headroom that leaves room for the allocator's fragmentation (docs/dry_run.md)\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

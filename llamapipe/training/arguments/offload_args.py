"""Activation offload flags (PipeOffload, arXiv 2503.01328) with the zero-bubble fork's names and meaning.

The fork (sail-sg/zero-bubble-pipeline-parallelism, megatron/core/zbpp_utils.py) offloads the activations of the
model chunks below `--offload-chunk-num` (`should_offload = chunk < offload_chunk_num`) under `--cpu-offload`,
and places the copies from `--offload-time`, one copy's time as a share of F + B + W (its default 1.0), or
`--auto-offload-time`. Here the placement is a pass over any schedule's plan (`core.pipeline_parallel.
offload_plan`), so offload works with every --pipeline-schedule, not only the fork's grouped interleave.
Defaults that differ: `--offload-chunk-num` is 1 when `--cpu-offload` is given alone (the fork asserts it is set),
and without `--offload-time` the copies are assumed to overlap compute (time 0: every activation with an action
between its forward and its reload is offloaded), which is what `--auto-offload-time` measures on a GPU's copy
engine; `--auto-offload-time` here times this device's copy and matmul speeds at start-up.
"""
from __future__ import annotations

import argparse
import math
import time
from typing import Optional

import torch

from llamapipe.core.config import ArgumentError
from llamapipe.model.offload_modules import MODULE_PATHS, MOE_MODULES

DEFAULT_OFFLOAD_TIME = 0.0


def add_offload_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("activation offload (PipeOffload; the zero-bubble fork's flags)",
                             "Offload and reload are actions of the pipeline plan: D2H right after a forward, H2D "
                             "one backward before its backward; an activation whose gap is too short stays.")
    g.add_argument("--cpu-offload", action="store_true",
                   help="offload the activations of the model chunks below --offload-chunk-num to host memory")
    g.add_argument("--offload-chunk-num", type=int, default=None,
                   help="with --cpu-offload: local model chunks 0..N-1 of every rank offload (default 1)")
    g.add_argument("--offload-time", type=float, default=None,
                   help="one copy's time as a share of F + B + W: an activation stays unless its gap holds 3 round "
                        "trips (default 0: copies overlap compute)")
    g.add_argument("--auto-offload-time", action="store_true",
                   help="set --offload-time from this device's measured copy and matmul speeds")
    g.add_argument("--offload-overlap-sr", action="store_true",
                   help="no effect: on CUDA the copies always run on their own stream")
    g.add_argument("--offload-weight-grad-inputs", action="store_true",
                   help="with --cpu-offload on a schedule that splits B and W (zero bubble): also offload what each "
                        "deferred weight gradient holds from its B to its W (the layer inputs and output gradients)")
    g.add_argument("--fine-grained-activation-offloading", action="store_true",
                   help="Megatron's: offload what --offload-modules save, on every model chunk of a pipeline rank")
    g.add_argument("--offload-modules", nargs="+", default=None, metavar="NAME",
                   help=f"Megatron's module names: {', '.join(MODULE_PATHS)} (default: all of them)")
    g.add_argument("--activation-offload-fraction", type=float, default=1.0,
                   help="share of each forward's offloadable bytes that is offloaded, in [0, 1] (Megatron's)")
    g.add_argument("--min-offloaded-tensor-size", type=int, default=1024 * 1024,
                   help="saved tensors with fewer elements stay on the device (Megatron's default 1048576)")
    g.add_argument("--delta-offload-bytes-across-pp-ranks", type=int, default=0,
                   help="pipeline rank r offloads r x this many bytes fewer per step (Megatron's)")


def check_offload(args: argparse.Namespace, pp: int, vpp: int) -> tuple[int, Optional[float]]:
    """(local chunks that offload, --offload-time or None for auto) from the flags; (0, None) without offload.
    Megatron's --fine-grained-activation-offloading offloads every chunk (its modules: `check_offload_modules`).
    Raises ArgumentError naming the flag for what cannot run."""
    if args.fine_grained_activation_offloading and not args.cpu_offload:
        if pp < 2:
            raise ArgumentError("--fine-grained-activation-offloading places its copies in the pipeline schedule and "
                                f"needs --pipeline-model-parallel-size > 1, got {pp}; for one stage use "
                                "--recompute-granularity")
        return vpp, DEFAULT_OFFLOAD_TIME if args.offload_time is None else args.offload_time
    given = [f for f, v in (("--offload-chunk-num", args.offload_chunk_num), ("--offload-time", args.offload_time),
                            ("--auto-offload-time", args.auto_offload_time),
                            ("--offload-weight-grad-inputs", args.offload_weight_grad_inputs)) if v not in (None, False)]
    if not args.cpu_offload:
        if given:
            raise ArgumentError(f"{given[0]} tunes --cpu-offload, which is not given; add --cpu-offload")
        return 0, None
    if pp < 2:
        raise ArgumentError(f"--cpu-offload places its copies in the pipeline schedule and needs "
                            f"--pipeline-model-parallel-size > 1, got {pp}; for one stage use --recompute-granularity")
    chunks = 1 if args.offload_chunk_num is None else args.offload_chunk_num
    if not 1 <= chunks <= vpp:
        raise ArgumentError(f"--offload-chunk-num {chunks} must be between 1 and the {vpp} model chunk"
                            f"{'s' if vpp > 1 else ''} per pipeline rank")
    if args.offload_time is not None and args.auto_offload_time:
        raise ArgumentError(f"--offload-time {args.offload_time:g} and --auto-offload-time both set the copy time; "
                            "give one")
    if args.offload_time is not None and not (math.isfinite(args.offload_time) and args.offload_time >= 0):
        raise ArgumentError(f"--offload-time {args.offload_time} must be a non-negative share of F + B + W")
    if args.auto_offload_time:
        return chunks, None
    return chunks, DEFAULT_OFFLOAD_TIME if args.offload_time is None else args.offload_time


def check_offload_modules(args: argparse.Namespace) -> tuple[tuple[str, ...], float, int, int]:
    """(Megatron's module names, fraction, minimum elements, bytes fewer per rank) for the offload store; without
    --fine-grained-activation-offloading: every saved tensor, all of it, no minimum (the fork's --cpu-offload)."""
    fine = args.fine_grained_activation_offloading
    megatron = {"--offload-modules": args.offload_modules is not None,
                "--activation-offload-fraction": args.activation_offload_fraction != 1.0,
                "--delta-offload-bytes-across-pp-ranks": args.delta_offload_bytes_across_pp_ranks != 0}
    if not fine and any(megatron.values()):
        flag = next(f for f, given in megatron.items() if given)
        raise ArgumentError(f"{flag} tunes --fine-grained-activation-offloading, which is not given; add it")
    fraction = args.activation_offload_fraction
    if not (math.isfinite(fraction) and 0 <= fraction <= 1):
        raise ArgumentError(f"--activation-offload-fraction {fraction:g} must be within [0, 1]")
    if args.min_offloaded_tensor_size < 0 or args.delta_offload_bytes_across_pp_ranks < 0:
        raise ArgumentError("--min-offloaded-tensor-size and --delta-offload-bytes-across-pp-ranks must be "
                            f"non-negative, got {args.min_offloaded_tensor_size} and "
                            f"{args.delta_offload_bytes_across_pp_ranks}")
    names = tuple(args.offload_modules or MODULE_PATHS)
    for name in names:
        if name in MOE_MODULES:
            raise ArgumentError(f"--offload-modules {name} applies to mixture-of-experts layers; this model is dense "
                                f"(use {', '.join(MODULE_PATHS)})")
        if name not in MODULE_PATHS:
            raise ArgumentError(f"--offload-modules {name} is not a module Megatron offloads; use "
                                f"{', '.join(MODULE_PATHS)}")
    if not fine:
        return (), 1.0, 0, 0
    return names, fraction, args.min_offloaded_tensor_size, args.delta_offload_bytes_across_pp_ranks


def measured_offload_time(unit_bytes: float, unit_flops: float, device: torch.device) -> float:
    """One copy of `unit_bytes` over F + B + W of `unit_flops`, both timed on `device` (a copy to host memory and a
    square matmul, each the median of 5): the fork's --auto-offload-time, from this machine's own speeds."""
    src = torch.empty(min(int(unit_bytes), 64 << 20) or 1, dtype=torch.uint8, device=device)
    dst = torch.empty(src.numel(), dtype=torch.uint8, pin_memory=device.type == "cuda")
    a = torch.randn(512, 512, device=device)
    copy_s = _median_seconds(lambda: dst.copy_(src), device) * unit_bytes / src.numel()
    gemm_s = _median_seconds(lambda: a @ a, device) * unit_flops / (2 * 512 ** 3)
    return copy_s / gemm_s if gemm_s > 0 else 0.0


def _median_seconds(fn, device: torch.device) -> float:
    times = []
    for _ in range(5):
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - start)
    return sorted(times)[2]

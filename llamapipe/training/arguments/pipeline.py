"""Checks of the pipeline layout flags: model chunks per rank, the layer split over stages, and the schedule.

Split from `training/arguments/validation.py` (same contract: `ArgumentError`, one plain sentence naming the
flags and the numbers). Megatron gives the chunks per rank two ways (--num-layers-per-virtual-pipeline-stage,
newer --num-virtual-stages-per-pipeline-rank); errors name the flag the user gave.
"""
from __future__ import annotations

import argparse
from typing import Optional

from llamapipe.core.config import ArgumentError, ParallelConfig
from llamapipe.core.pipeline_parallel.layout import stage_layer_ranges
from llamapipe.model.config import PRESETS


def vpp_size(args: argparse.Namespace) -> int:
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


def check_layer_split(args: argparse.Namespace, num_layers: int, par: ParallelConfig) -> None:
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

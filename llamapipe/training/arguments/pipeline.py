"""Checks of the pipeline layout flags: model chunks per rank, the layer split over stages, and the schedule.

Split from `training/arguments/validation.py` (same contract: `ArgumentError`, one plain sentence naming the
flags and the numbers). Megatron gives the chunks per rank two ways (--num-layers-per-virtual-pipeline-stage,
newer --num-virtual-stages-per-pipeline-rank); errors name the flag the user gave. What each schedule
accepts comes from its spec (`core.pipeline_parallel.schedule_specs`).
"""
from __future__ import annotations

import argparse
import re
from typing import Optional

from llamapipe.core.config import ArgumentError, ParallelConfig
from llamapipe.core.pipeline_parallel.layout import layout_layer_counts, parse_layout, stage_layer_ranges
from llamapipe.core.pipeline_parallel.schedule_specs import SPECS, ScheduleSpec, megatron_grouped
from llamapipe.training.flag_names import as_flags, flag_message, flag_of

LAYOUT_FLAG = flag_of("pipeline_layout")


def vpp_size(args: argparse.Namespace, num_layers: int) -> int:
    """Model chunks per pipeline rank from the chunk flags or the layout string; `num_layers` is the model's."""
    per_vstage, chunks = args.num_layers_per_virtual_pipeline_stage, args.num_virtual_stages_per_pipeline_rank
    pp = args.pipeline_model_parallel_size
    if getattr(args, "pipeline_model_parallel_layout", None) is not None:
        return _layout_vpp(args, pp)
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


_MAX_LAYOUT_LETTERS = 10 ** 6     # far beyond any model's layers; expanding more would only exhaust memory
_LAYOUT_TOKEN = re.compile(r"\*\d+|[()]|[^\s,()*]")


def _expanded_letters(text: str) -> int:
    """How many letters a layout string expands to (its `x*N` and `(...)*N` repeats), counted without expanding
    it: `Et*999999999999|tL` would otherwise be built in memory before any check could see it."""
    groups, last = [0], 0       # letters of each open group; the size of the item a `*N` repeats
    for token in _LAYOUT_TOKEN.findall(text):
        if token == "(":
            groups.append(0)
        elif token == ")":
            last = groups.pop() if len(groups) > 1 else 0
            groups[-1] += last
        elif token.startswith("*"):
            groups[-1] += last * (int(token[1:]) - 1)
            last = min(last, 1)     # a later `*M` repeats the last letter (never fewer letters than counted)
        else:
            groups[-1], last = groups[-1] + 1, 1
    return sum(groups)


def _layout_vpp(args: argparse.Namespace, pp: int) -> int:
    """Model chunks per rank of a --pipeline-model-parallel-layout, checked against the chunk flags."""
    text = args.pipeline_model_parallel_layout
    letters = _expanded_letters(text)
    if letters > _MAX_LAYOUT_LETTERS:
        raise ArgumentError(f"{LAYOUT_FLAG} {text!r} expands to {letters} letters; a layout names each decoder layer "
                            f"once (t), so it cannot be that long (at most {_MAX_LAYOUT_LETTERS})")
    try:
        stages = parse_layout(text)
    except ValueError as err:
        raise ArgumentError(flag_message(err)) from None
    said = f"{LAYOUT_FLAG} {text!r} ({len(stages)} virtual stages)"
    if len(stages) % pp:
        raise ArgumentError(f"{said} is not a multiple of --pipeline-model-parallel-size {pp}")
    if pp == 1 and len(stages) > 1:
        raise ArgumentError(f"{said} needs --pipeline-model-parallel-size > 1, got 1")
    vpp, chunks = len(stages) // pp, args.num_virtual_stages_per_pipeline_rank
    if chunks is not None and chunks != vpp:
        raise ArgumentError(f"{said} gives {vpp} model chunks per pipeline rank with --pipeline-model-parallel-size "
                            f"{pp}, but --num-virtual-stages-per-pipeline-rank is {chunks}")
    per_vstage = args.num_layers_per_virtual_pipeline_stage
    counts = [stage.count("t") for stage in stages]
    if per_vstage is not None and any(n != per_vstage for n in counts):
        raise ArgumentError(f"{said} puts {', '.join(map(str, counts))} layers on its stages, but "
                            f"--num-layers-per-virtual-pipeline-stage is {per_vstage}")
    return vpp


def _check_layout(args: argparse.Namespace, num_layers: int, par: ParallelConfig) -> None:
    """A layout string sets the whole split: the other split flags may only repeat it."""
    text = args.pipeline_model_parallel_layout
    try:
        counts = layout_layer_counts(text, num_layers, par.pp_size)
    except ValueError as err:
        raise ArgumentError(flag_message(err)) from None
    for part, on in (("embedding", par.account_for_embedding), ("loss", par.account_for_loss)):
        if on:
            raise ArgumentError(f"--account-for-{part}-in-pipeline-split cannot be combined with {LAYOUT_FLAG} "
                                f"{text!r}, which places the {part} ({part[0].upper()}) itself")
    for end, given, layers in (("first", par.first_stage_layers, counts[0]), ("last", par.last_stage_layers,
                                                                             counts[-1])):
        if given is not None and layers != given:
            raise ArgumentError(f"--decoder-{end}-pipeline-num-layers {given} contradicts {LAYOUT_FLAG} {text!r}, "
                                f"which gives the {end} stage {layers} layers")


GROUP_FLAG = "--microbatch-group-size-per-virtual-pipeline-stage"


def check_seq_splits(args: argparse.Namespace, schedule: str, pp: int, vocab_parallel: bool, offload: bool) -> int:
    """--num-seq-splits K (Seq1F1B): K itself, after the checks that make each a one-line error (the sequence
    length: `check_seq_pieces`). Every --cp-comm-type runs with pieces (model/piece_attention.py)."""
    k = args.num_seq_splits
    if k < 1:
        raise ArgumentError(f"--num-seq-splits must be at least 1, got {k}")
    if k == 1:
        return 1
    spec = SPECS[schedule] if schedule in SPECS else None
    if pp > 1 and (spec is None or spec.seq_builder is None):
        supported = ", ".join(name for name, s in SPECS.items() if s.seq_builder is not None)
        raise ArgumentError(f"--num-seq-splits {k} needs --pipeline-schedule one of {supported}, got {schedule}")
    for flag, on in (("--enable-vocab-parallel", vocab_parallel), ("--cpu-offload", offload)):
        if on:
            raise ArgumentError(f"--num-seq-splits {k} does not run with {flag} yet")
    return k


def check_seq_pieces(par: ParallelConfig, seq_length: int) -> None:
    """One line when --num-seq-splits does not divide the sequence (into multiples of the TP size under sequence
    parallelism; under context parallelism each piece into the 2 x cp chunks of the load-balanced layout)."""
    from llamapipe.core.pipeline_parallel.seq_split import piece_align, piece_bounds
    k, cp = par.num_seq_splits, par.cp_size
    if k <= 1:
        return
    align = piece_align(par.tp_size, par.sequence_parallel, cp)
    try:
        piece_bounds(seq_length, k, "length", align=align)
    except ValueError as err:
        if cp == 1:
            raise ArgumentError(f"{flag_message(err)} (--seq-length {seq_length})") from None
        sp = f" x --tensor-model-parallel-size {par.tp_size} (sequence parallel)" if align > 2 * cp else ""
        raise ArgumentError(f"--num-seq-splits {k} does not divide the context-parallel shard: each piece is cut into "
                            f"2 x --context-parallel-size {cp}{sp} = {align} chunks, so --seq-length {seq_length} "
                            f"must be a multiple of {k} x {align} = {k * align}") from None


def grouped_schedule(args: argparse.Namespace, schedule: str, pp: int) -> str:
    """The schedule with Megatron's microbatch group size applied: interleaved with groups of N ("interleaved:N");
    N = pp, Megatron's default, is the plain interleaved order."""
    group = getattr(args, "microbatch_group_size_per_virtual_pipeline_stage", None)
    if group is None:
        return schedule
    grouped = megatron_grouped(schedule, group, pp)
    if grouped is None:
        raise ArgumentError(f"{GROUP_FLAG} {group} groups the interleaved schedule's microbatches; --pipeline-schedule "
                            f"{schedule} has no such groups (use interleaved, or --interleave-group-size for the "
                            "fork's group-interleaved)")
    if group < pp:
        raise ArgumentError(f"{GROUP_FLAG} {group} must be at least --pipeline-model-parallel-size {pp}: with smaller "
                            "groups the interleaved order deadlocks for most sizes (pp 4 with groups of 1 or 2)")
    return grouped


def virtual_stage_flag(args: argparse.Namespace) -> Optional[str]:
    """The flag (with its value) that set the model chunks per rank, as the user gave it; None if neither."""
    for name in ("num_layers_per_virtual_pipeline_stage", "num_virtual_stages_per_pipeline_rank"):
        if getattr(args, name, None) is not None:
            return f"--{name.replace('_', '-')} {getattr(args, name)}"
    return None


def schedule_chunks(args: argparse.Namespace, spec: ScheduleSpec, vpp: int, num_layers: int) -> int:
    """`vpp`, or the one chunk count a schedule of one shape runs (the V schedules' 2) when no flag sets the
    chunks or the split and the layers fill that many virtual stages evenly (else the refusal says why)."""
    given = (args.num_layers_per_virtual_pipeline_stage, args.num_virtual_stages_per_pipeline_rank,
             getattr(args, "pipeline_model_parallel_layout", None), args.decoder_first_pipeline_num_layers,
             args.decoder_last_pipeline_num_layers)
    pp = args.pipeline_model_parallel_size
    if pp == 1 or spec.min_chunks != spec.max_chunks or any(flag is not None for flag in given):
        return vpp
    units, _, _ = _layer_units(num_layers, args.account_for_embedding_in_pipeline_split,
                               args.account_for_loss_in_pipeline_split)
    return spec.min_chunks if units % (pp * spec.min_chunks) == 0 else vpp


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
    counts the embedding / loss as layers (--account-for-*-in-pipeline-split), or a layout string."""
    pp = par.pp_size
    if getattr(args, "pipeline_model_parallel_layout", None) is not None:
        _check_layout(args, num_layers, par)
        return
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
        spec = SPECS[par.pipeline_schedule]
        if not spec.accepts(1):
            one_chunk = [name for name, other in SPECS.items() if other.accepts(1)]
            raise ArgumentError(f"{flags} needs one model chunk per pipeline rank, but --pipeline-schedule "
                                f"{spec.name} {spec.chunks_text()}; use {_either(one_chunk)}")
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
        raise ArgumentError(flag_message(err)) from None


def _either(names: list[str]) -> str:
    return " or ".join(names) if len(names) < 3 else ", ".join(names[:-1]) + " or " + names[-1]


def _chunks_fix(args: argparse.Namespace, spec: ScheduleSpec, par: ParallelConfig, num_layers: int) -> str:
    """The end of the sentence when the chunks per rank do not fit the schedule: which flag set them and
    what to change."""
    flag, pp, vpp = virtual_stage_flag(args), par.pp_size, par.vpp_size
    given = f" (from {flag})" if flag else ""
    if spec.max_chunks is not None and vpp > spec.max_chunks:
        others = [name for name, other in SPECS.items() if other.accepts(vpp)]
        return f"{given}; drop {flag} or use {_either(others)}"
    units, total, _ = _layer_units(num_layers, par.account_for_embedding, par.account_for_loss)
    want, stages = spec.min_chunks, spec.min_chunks * pp
    if units % stages == 0:
        return (f"{given}; set --num-virtual-stages-per-pipeline-rank {want} (or "
                f"--num-layers-per-virtual-pipeline-stage {units // stages})")
    return (f"{given}, and {total} is not divisible by the {want} x --pipeline-model-parallel-size {pp} = "
            f"{stages} virtual stages that would need")


def check_schedule(args: argparse.Namespace, par: ParallelConfig, m: int, num_layers: int) -> None:
    spec, pp, vpp = SPECS[par.pipeline_schedule], par.pp_size, par.vpp_size
    s = spec.name
    if pp == 1:
        if spec.min_chunks > 1:     # the chunk flags need pp > 1, so it could never get its chunks
            raise ArgumentError(f"--pipeline-schedule {s} needs --pipeline-model-parallel-size > 1")
        return
    error = spec.chunks_error(vpp)
    if error is not None:
        raise ArgumentError(as_flags(error, ["pipeline_schedule"]) + _chunks_fix(args, spec, par, num_layers))
    capped = _either([name for name, other in SPECS.items() if other.memory_capped])
    limited = par.pipeline_memory_limit is not None or par.pipeline_memory_limit_bytes is not None
    if limited and not spec.memory_capped:
        raise ArgumentError(f"--pipeline-memory-limit caps the {capped} schedule's plan; --pipeline-schedule {s} "
                            f"has a fixed memory use, so drop the flag or use --pipeline-schedule {capped}")
    if spec.memory_capped and par.pipeline_memory_limit is not None and par.pipeline_memory_limit < vpp:
        raise ArgumentError(f"--pipeline-memory-limit {par.pipeline_memory_limit:g} is below the {vpp} activation "
                            "units one microbatch needs on all model chunks of a rank")
    if m < pp:
        raise ArgumentError(f"number of microbatches ({m} = --global-batch-size {m * args.micro_batch_size * par.dp_size}"
                            f" / (--micro-batch-size {args.micro_batch_size} x data-parallel size {par.dp_size})) "
                            f"is smaller than --pipeline-model-parallel-size ({pp}), which --pipeline-schedule {s} needs")

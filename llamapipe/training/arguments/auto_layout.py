"""--pipeline-model-parallel-layout auto: the run picks its split of layers over the (virtual) pipeline stages.

Resolved once, at argument-parse time, into an ordinary layout string ("Et*5|t*3L"), so everything downstream
(the checks, the model builder, checkpoint metadata, the schedule) sees an explicit layout. The split is
`core.pipeline_parallel.stage_balance.balanced_counts` over this run's pipeline ranks and placement, the one
`llamapipe plan --profile` prints, from:

- the costs a `llamapipe profile` measured, given as --pipeline-profile PROFILE.json (its setting for this
  run's micro-batch size and recompute, scaled to one tensor-parallel rank with its collectives), or
- without a profile, the analytic FLOP model (`stage_balance.analytic_parts`, the embedding and the output layer
  with its loss counted at the vocabulary size).

With --enable-vocab-parallel the two vocabulary layers' cost is spread over every rank, so the balanced split is
the even one. With --pipeline-schedule auto and without that flag the run chooses between the two itself
(`_vocab_parallel_pays`): vocabulary parallelism when its even split's busiest rank has less work than the best
layer split's by more than `VOCAB_PARALLEL_MARGIN`, what its per-microbatch synchronisation costs beyond the
work model (measured, docs/runtime.md). The chunks per rank come from
--num-virtual-stages-per-pipeline-rank or --num-layers-per-virtual-pipeline-stage (counted on the even split),
else the schedule's fewest (2 for the V schedules). One notice line says which split and why.
"""
from __future__ import annotations

import argparse
import copy
from typing import Optional

from llamapipe.core.config import ArgumentError
from llamapipe.core.pipeline_parallel.profile_costs import PassCosts
from llamapipe.core.pipeline_parallel.schedule_specs import default_schedule
from llamapipe.core.pipeline_parallel.stage_balance import (ELEMENT_FLOPS, analytic_parts, balanced_counts,
                                                            even_counts, layout_string, rank_work, stage_ranks,
                                                            tp_parts)
from llamapipe.model.llama import LlamaConfig
from llamapipe.training import profile_schema
from llamapipe.training.arguments.pipeline import LAYOUT_FLAG, vpp_size
from llamapipe.training.flag_names import flag_message
from llamapipe.training.schedule_file import load_schedule

AUTO = "auto"
PROFILE_FLAG = "--pipeline-profile"
ELEMENT_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
# What vocabulary parallelism costs beyond `rank_work`'s balance (the S/T synchronisation of every microbatch),
# as a share of the busiest rank's work: at vocabulary 8192 / hidden 256 (benchmarks/bench_pipeline_gaps.py) the
# model predicted 5.5% less work on the busiest rank and the run gained 0.3% over the layer split; at vocabulary
# 32768, where no layer split balances the output layer, it predicts 26% and the run gains (docs/runtime.md).
VOCAB_PARALLEL_MARGIN = 0.06


def resolve_auto_layout(args: argparse.Namespace, model: LlamaConfig, seq_length: int, device: str,
                        notices: list[str]) -> argparse.Namespace:
    """`args` with --pipeline-model-parallel-layout auto replaced by the chosen layout string (a copy; `args`
    as given when there is nothing to resolve). `device`: "cpu" or "cuda", for the analytic model; `seq_length`:
    the tokens of each sequence one rank computes (--seq-length / --context-parallel-size)."""
    profile_path = getattr(args, "pipeline_profile", None)
    if args.pipeline_model_parallel_layout != AUTO:
        if profile_path is not None:
            raise ArgumentError(f"{PROFILE_FLAG} {profile_path} is read only by {LAYOUT_FLAG} {AUTO}")
        return args
    _refuse_other_split_flags(args)
    out = copy.copy(args)
    pp = args.pipeline_model_parallel_size
    if pp == 1:
        out.pipeline_model_parallel_layout = None
        notices.append(f"notice: {LAYOUT_FLAG} {AUTO} has nothing to split at --pipeline-model-parallel-size 1")
        return out
    vpp, schedule = _chunks(args, model.num_layers)
    ranks = stage_ranks(pp, vpp, load_schedule(schedule).placement(vpp))
    vocab_parallel = bool(args.enable_vocab_parallel)
    if profile_path is not None:
        parts, unit, source = _profiled_parts(args, model, seq_length, profile_path), 1e3, \
            f"the measured costs in {PROFILE_FLAG} {profile_path}"
    else:
        parts = analytic_parts(hidden=model.hidden_size, ffn_hidden=model.ffn_hidden_size,
                               heads=model.num_attention_heads, kv_heads=model.num_query_groups,
                               head_dim=model.head_dim, vocab=model.padded_vocab_size(args.tensor_model_parallel_size),
                               seq_length=seq_length, micro_batch=args.micro_batch_size,
                               recompute=_recompute(model), element_flops=ELEMENT_FLOPS[device])
        unit = 1.0 / (parts["layer"].f + parts["layer"].b + parts["layer"].w)
        source = (f"the analytic FLOP model (no {PROFILE_FLAG}; the embedding and the output layer + loss counted at "
                  f"vocabulary {model.padded_vocab_size(args.tensor_model_parallel_size)})")
    counts = balanced_counts(parts, model.num_layers, ranks, vocab_parallel)
    chose_vocab = not vocab_parallel and args.pipeline_schedule == AUTO and _vocab_parallel_pays(parts, counts, ranks)
    if chose_vocab:
        vocab_parallel = out.enable_vocab_parallel = True
        counts = balanced_counts(parts, model.num_layers, ranks, vocab_parallel)
    out.pipeline_model_parallel_layout = layout_string(counts)
    out.num_layers_per_virtual_pipeline_stage = None     # a chunk count here; the layout now gives the layers
    out.num_virtual_stages_per_pipeline_rank = vpp if vpp > 1 else args.num_virtual_stages_per_pipeline_rank
    notices.append(_notice(out.pipeline_model_parallel_layout, counts, parts, ranks, vocab_parallel, unit,
                           "ms" if profile_path is not None else "decoder layers", source, chose_vocab))
    return out


def _vocab_parallel_pays(parts: dict[str, PassCosts], layer_split: list[int], ranks: list[int]) -> bool:
    """Whether the vocabulary layers split over every rank beat the best layer split by more than the margin."""
    even = even_counts(sum(layer_split), len(layer_split))
    split = max(rank_work(parts, even, ranks, vocab_parallel=True))
    return split < (1 - VOCAB_PARALLEL_MARGIN) * max(rank_work(parts, layer_split, ranks))


def _refuse_other_split_flags(args: argparse.Namespace) -> None:
    given = [f"--decoder-{end}-pipeline-num-layers" for end in ("first", "last")
             if getattr(args, f"decoder_{end}_pipeline_num_layers") is not None]
    given += [f"--account-for-{part}-in-pipeline-split" for part in ("embedding", "loss")
              if getattr(args, f"account_for_{part}_in_pipeline_split")]
    if given:
        raise ArgumentError(f"{LAYOUT_FLAG} {AUTO} picks the layer split itself; drop {' and '.join(given)}")


def _chunks(args: argparse.Namespace, num_layers: int) -> tuple[int, str]:
    """Model chunks per rank (the chunk flags', counted as on the even split, else the schedule's fewest) and
    the schedule that runs them."""
    explicit = copy.copy(args)
    explicit.pipeline_model_parallel_layout = None
    vpp = vpp_size(explicit, num_layers)
    schedule = args.pipeline_schedule or default_schedule(vpp)
    try:
        spec = load_schedule(schedule)
    except ValueError as err:
        raise ArgumentError(flag_message(err)) from None
    if not spec.accepts(vpp) and args.num_layers_per_virtual_pipeline_stage is None and \
            args.num_virtual_stages_per_pipeline_rank is None:
        vpp = spec.min_chunks
    stages = args.pipeline_model_parallel_size * vpp
    if num_layers < stages:
        raise ArgumentError(f"{LAYOUT_FLAG} {AUTO} needs a decoder layer on each of the {stages} virtual stages, "
                            f"but --num-layers is {num_layers}")
    return vpp, schedule


def _recompute(model: LlamaConfig) -> str:
    return "full" if model.recompute_granularity == "full" else "none"


def _profiled_parts(args: argparse.Namespace, model: LlamaConfig, seq_length: int,
                    path: str) -> dict[str, PassCosts]:
    said = f"{PROFILE_FLAG} {path}"
    try:
        profile = profile_schema.load(path, PROFILE_FLAG)
        profile_schema.check_same_model(profile, model, said,
                                        vocab_hint=" --tokenizer-model" if args.tokenizer_model is not None else "")
    except profile_schema.ProfileError as err:
        raise ArgumentError(str(err)) from None
    dtype = "bf16" if args.bf16 else "fp16" if args.fp16 else "fp32"
    cp = max(getattr(args, "context_parallel_size", 1) or 1, 1)
    tokens = "--seq-length" if cp == 1 else f"--seq-length / --context-parallel-size {cp} (tokens per rank)"
    for what, theirs, ours in ((tokens, profile["seq_length"], seq_length), ("precision", profile["dtype"], dtype)):
        if theirs != ours:
            raise ArgumentError(f"{said} was measured at {what} {theirs}, but this run's is {ours}")
    threads = profile_schema.threads_mismatch(profile, profile_schema.run_threads(), said,
                                              "each rank torchrun starts (OMP_NUM_THREADS, else 1)")
    if threads is not None:
        raise ArgumentError(threads)
    recompute = _recompute(model)
    parts = profile_schema.entry(profile, args.micro_batch_size, recompute)
    if parts is None:
        have = ", ".join(f"{b}/{r}" for b, r in profile_schema.settings(profile))
        raise ArgumentError(f"{said} has no entry for --micro-batch-size {args.micro_batch_size} with recompute "
                            f"{recompute} (it has micro-batch size/recompute {have})")
    tp, comm = args.tensor_model_parallel_size, profile.get("comm")
    message = seq_length * args.micro_batch_size * model.hidden_size * ELEMENT_BYTES[dtype]
    return tp_parts(parts, tp if comm else 1, 1.0, comm, message=message,
                    sequence_parallel=bool(args.sequence_parallel), recompute=recompute,
                    gloo=profile["device"] == "cpu", sync_s=profile_schema.collective_sync_s(profile))


def _notice(layout: str, counts: list[int], parts: dict[str, PassCosts], ranks: list[int], vocab_parallel: bool,
            unit: float, unit_name: str, source: str, chose_vocab: bool = False) -> str:
    def per_rank(split: list[int]) -> str:
        return "/".join(f"{x * unit:.1f}" for x in rank_work(parts, split, ranks, vocab_parallel))
    even = even_counts(sum(counts), len(counts))
    vocab = ", the vocabulary layers split over every rank (--enable-vocab-parallel)" if vocab_parallel else ""
    if chose_vocab:
        vocab = (", the vocabulary layers split over every rank (vocabulary parallelism, chosen with "
                 f"--pipeline-schedule {AUTO}: it lowers the busiest rank's work by more than "
                 f"{VOCAB_PARALLEL_MARGIN:.0%})")
    compare = "" if even == counts else f" (even split {'/'.join(map(str, even))}: {per_rank(even)} {unit_name})"
    if vocab_parallel and chose_vocab:
        layers = balanced_counts(parts, sum(counts), ranks)
        compare = (f" (best layer split {'/'.join(map(str, layers))} without it: "
                   f"{'/'.join(f'{x * unit:.1f}' for x in rank_work(parts, layers, ranks))} {unit_name})")
    return (f"notice: {LAYOUT_FLAG} {AUTO} chose {layout!r} (layers per virtual stage {'/'.join(map(str, counts))}) "
            f"from {source}{vocab}: F+B+W per microbatch on each pipeline rank {per_rank(counts)} "
            f"{unit_name}{compare}")


def device_of(args: argparse.Namespace) -> str:
    """"cuda" when the run uses NCCL (or CUDA is there and no backend is named), else "cpu"."""
    import torch
    backend: Optional[str] = getattr(args, "distributed_backend", None)
    return "cuda" if backend == "nccl" or (backend is None and torch.cuda.is_available()) else "cpu"

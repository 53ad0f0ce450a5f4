"""The layouts `llamapipe plan` considers, as flags the trainer takes.

`layouts` enumerates tp x cp x pp x dp = gpus, model chunks per rank and schedule (every --pipeline-schedule with
a fixed order, at every chunk count up to MAX_CHUNKS it takes: an uneven layout string where the layers do not
divide), micro-batch size, full activation recompute or none, the distributed optimizer, the context-parallel
attention (the ring, a2a where each rank gets whole query groups, a2a+p2p at every a2a level A of A x P = cp that
divides the query groups) and Seq1F1B (--num-seq-splits K for the schedules with a Seq1F1B builder, where K
pieces of a multiple of tp tokens divide each CP rank's sequence). `trainer_flags` is a layout's pretrain_llama.py
flags; `refusal` runs them through the dry run's own argument checks (`training.dry_run.main.dry_run_config`), so
the planner offers only what the trainer and the dry run accept (Seq1F1B rows come with every CP attention it
ranks: the ring, a2a and a2a+p2p).
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import itertools
import logging
import shlex
from typing import Optional

from llamapipe.core.config import ArgumentError, ConfigError
from llamapipe.core.logger import get_logger
from llamapipe.core.pipeline_parallel.schedule_specs import SPECS, default_schedule
from llamapipe.model.llama import LlamaConfig
from llamapipe.tools import profile_plan
from llamapipe.tools.parallel_layout import Layout, seq_plan

SCHEDULES = [name for name, spec in SPECS.items() if spec.planned and not spec.profiled]
SEQ_SCHEDULES = [name for name in SCHEDULES if SPECS[name].seq_builder is not None]
SEQ_SPLITS = (2, 4, 8)      # Seq1F1B's pieces per microbatch that `plan` tries by default
SEQ_MAX_CHUNKS = 2          # model chunks per rank of Seq1F1B layouts (each interleaved order is simulated: 8 chunks
                            # of 32 microbatches in 8 pieces take seconds)
MAX_CHUNKS = 8     # model chunks per pipeline rank that `plan` tries at most
RECOMPUTE_FLAGS = {"none": [], "selective": ["--recompute-activations"], "lgd": ["--recompute-lgd"],
                   "full": ["--recompute-granularity", "full", "--recompute-method", "uniform"]}


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def layouts(m: LlamaConfig, gpus: int, global_batch: int, max_mbs: int, max_cp: int = 1,
            seq_length: int = 0, seq_splits: tuple[int, ...] = ()) -> list[Layout]:
    """Every layout the flags could express for this model and cluster (context parallelism up to `max_cp`
    ranks, where `seq_length` splits into 2 x cp chunks of a multiple of tp tokens; Seq1F1B with each of
    `seq_splits` pieces)."""
    out = []
    for tp in [d for d in _divisors(gpus) if d <= 8 and m.num_query_groups % d == 0 and m.ffn_hidden_size % d == 0]:
        for cp, pp in [(cp, pp) for cp in _divisors(gpus // tp) if cp <= max_cp and seq_length % (2 * cp * tp) == 0
                       or cp == 1 for pp in _divisors(gpus // (tp * cp))]:
            dp = gpus // (tp * cp * pp)
            for mbs in [b for b in (1, 2, 4, 8) if b <= max_mbs and global_batch % (b * dp) == 0]:
                if pp > 1 and global_batch // (mbs * dp) < pp:
                    continue
                for (schedule, vpp, split), k in _pipelines(m.num_layers, pp, seq_length // cp, tp, seq_splits):
                    for recompute, (comm, a2a) in itertools.product(("none", "full"), _cp_comms(m, tp, cp)):
                        for dist_opt in (False, True) if dp * cp > 1 else (False,):   # ZeRO-1 over dp x cp
                            out.append(Layout(tp, pp, vpp, dp, schedule, mbs, recompute, dist_opt,
                                              pipeline_layout=split, cp=cp, cp_comm=comm, cp_a2a=a2a, seq_splits=k))
    return out


def _cp_comms(m: LlamaConfig, tp: int, cp: int) -> list[tuple[str, int]]:
    """(--cp-comm-type, a2a level) of the attentions a CP layout is ranked with: the ring, a2a where each rank gets
    whole query groups, a2a+p2p at each a2a level A (1 < A < cp, A dividing cp and the query groups per tp rank)."""
    if cp == 1:
        return [("p2p", 0)]
    groups = m.num_query_groups // tp
    out = [("p2p", 0)] + ([("a2a", 0)] if groups % cp == 0 else [])
    return out + [("a2a+p2p", a) for a in _divisors(cp) if 1 < a < cp and groups % a == 0]


def _pipelines(num_layers: int, pp: int, rank_tokens: int, tp: int,
               seq_splits: tuple[int, ...]) -> list[tuple[tuple[str, int, Optional[str]], int]]:
    """((schedule, chunks, layout string), Seq1F1B pieces) to rank: every schedule of `_schedules` unsplit, and
    those with a Seq1F1B builder, at up to SEQ_MAX_CHUNKS chunks, in K pieces for each K of `seq_splits` whose pieces
    of a multiple of tp tokens divide the CP rank's `rank_tokens` (only with a pipeline: one rank holds all its
    pieces at once)."""
    out = []
    for entry in _schedules(num_layers, pp):
        out.append((entry, 1))
        if pp > 1 and entry[0] in SEQ_SCHEDULES and entry[1] <= SEQ_MAX_CHUNKS:
            out += [(entry, k) for k in seq_splits if k > 1 and rank_tokens % (k * tp) == 0]
    return out


def _schedules(num_layers: int, pp: int) -> list[tuple[str, int, Optional[str]]]:
    """(schedule, model chunks per rank, layout string or None) to rank: every chunk count from 1 to MAX_CHUNKS
    that the schedule takes (Megatron's interleaved layouts have up to 8 and more), split evenly where pp x chunks
    divides the layers, else by `uneven_layout`."""
    if pp == 1:
        return [(default_schedule(1), 1, None)]
    out = []
    for name in SCHEDULES:
        spec = SPECS[name]
        for vpp in [v for v in range(1, MAX_CHUNKS + 1) if spec.accepts(v) and pp * v <= num_layers]:
            out.append((name, vpp, None if num_layers % (pp * vpp) == 0 else uneven_layout(num_layers, pp * vpp)))
    return out


def uneven_layout(num_layers: int, stages: int) -> str:
    """A --pipeline-model-parallel-layout string for layers that do not divide over the stages: each stage gets
    layers // stages and the rest go one each to the stages nearest the middle, so the first stage (with the
    embedding) and the last (with the output layer and the loss) are never the larger ones."""
    base, extra = divmod(num_layers, stages)
    by_middle = sorted(range(stages), key=lambda s: (abs(2 * s - (stages - 1)), s))
    counts = [base + (s in by_middle[:extra]) for s in range(stages)]
    parts = ["t" * n for n in counts]
    parts[0], parts[-1] = "E" + parts[0], parts[-1] + "L"
    return "|".join(parts)


def trainer_flags(args: argparse.Namespace, lay: Layout, m: Optional[LlamaConfig] = None) -> list[str]:
    """pretrain_llama.py's flags for one job of `lay` (`m`: the model, whose position limit a long --seq-length
    raises)."""
    shape = [f"--model {args.model}"] if args.model else [
        f"--{n.replace('_', '-')} {getattr(args, n)}" for n in ("num_layers", "hidden_size", "ffn_hidden_size",
                                                                   "num_attention_heads", "num_query_groups",
                                                                   "vocab_size") if getattr(args, n) is not None]
    if m is not None and args.seq_length > m.max_position_embeddings:
        shape.append(f"--max-position-embeddings {args.seq_length}")
    parts = [*shape, f"--tensor-model-parallel-size {lay.tp}", f"--pipeline-model-parallel-size {lay.pp}"]
    if lay.cp > 1:
        parts.append(f"--context-parallel-size {lay.cp}")
        parts += [f"--cp-comm-type {lay.cp_comm}"] if lay.cp_comm != "p2p" else []
        parts += [f"--hierarchical-context-parallel-sizes {lay.cp_a2a} {lay.cp // lay.cp_a2a}"] if lay.cp_a2a else []
    if lay.pp > 1:
        parts += [f"--num-virtual-stages-per-pipeline-rank {lay.vpp}", f"--pipeline-schedule {lay.schedule}"]
    if lay.pipeline_layout is not None:
        parts.append(f"--pipeline-model-parallel-layout '{lay.pipeline_layout}'")
    parts += [f"--num-seq-splits {lay.seq_splits}"] if lay.seq_splits > 1 else []
    parts += [f"--micro-batch-size {lay.micro_batch}", f"--global-batch-size {args.global_batch_size}",
              f"--seq-length {args.seq_length}", "--bf16"] + (["--sequence-parallel"] if lay.tp > 1 else [])
    parts += RECOMPUTE_FLAGS[lay.recompute] + (["--use-distributed-optimizer"] if lay.dist_opt else [])
    parts += [f"--cpu-offload --offload-chunk-num {lay.offload}"] if lay.offload else []
    parts += ["--offload-weight-grad-inputs"] if lay.offload and SPECS[lay.schedule].zero_bubble else []
    return parts + [profile_plan.MOCK_DATA]


def refusal(args: argparse.Namespace, lay: Layout, m: Optional[LlamaConfig] = None) -> Optional[str]:
    """Why the dry run refuses `lay`'s job on `args.gpus` GPUs of `args.gpu_memory_gb` before any rank runs (its
    argument checks' one-line error; under Seq1F1B also the pieces' plan, which the runtime builds for the job's
    microbatches and the planner simulates for at most 4 pp of them), or None when it accepts it."""
    flags = [token for part in trainer_flags(args, lay, m)
             for token in (shlex.split(part) if "'" in part else part.split())]
    refused = _refusal(("--world-size", str(args.gpus), "--gpu-memory-gb", f"{args.gpu_memory_gb:g}", *flags))
    if refused is None and lay.seq_splits > 1:
        micro = args.global_batch_size // (lay.micro_batch * lay.dp)
        for count in {micro, min(micro, 4 * lay.pp)}:
            try:
                seq_plan(lay.schedule, lay.pp, lay.vpp, count, lay.seq_splits)
            except ConfigError as err:
                return str(err)
    return refused


def shape_refusal(args: argparse.Namespace, lay: Layout, m: Optional[LlamaConfig] = None) -> Optional[str]:
    """`refusal` of `lay`'s parallel shape: its flags without recompute and the distributed optimizer, which the
    argument checks tie to no parallel size, so the layouts that differ only in them are checked once (the rows
    `plan` prints are checked whole by `refusal`)."""
    return refusal(args, dataclasses.replace(lay, recompute="none", dist_opt=False), m)


@functools.lru_cache(maxsize=None)
def _refusal(argv: tuple[str, ...]) -> Optional[str]:
    from llamapipe.training.dry_run.main import dry_run_config
    logger = get_logger()
    level, logger.level = logger.level, logging.WARNING     # the start-up notices are the job's, not the plan's
    try:
        dry_run_config(_dry_run_parser().parse_args(list(argv)))
    except ArgumentError as err:
        return str(err)
    finally:
        logger.setLevel(level)
    return None


@functools.lru_cache(maxsize=1)
def _dry_run_parser() -> argparse.ArgumentParser:
    from llamapipe.training.dry_run.main import build_parser
    return build_parser()

"""`llamapipe plan --profile profile.json`: rank layouts by the step time predicted from a measured profile.

Every layout `plan` enumerates for the profile's model (tp x pp x dp = --gpus, schedules, the profiled
micro-batch sizes and recompute settings) is predicted twice or more: with the even layer split (when the
layers divide evenly) and with the split `profile_predict.balanced_counts` picks, each without and, when the
trainer has --enable-vocab-parallel and pp > 1, with the output layer split over the pipeline. The fastest
variant of each layout is kept; rows print fastest first with each pipeline rank's predicted busy time and
the bubble, and the top row's command line carries the chosen --pipeline-model-parallel-layout.
"""
from __future__ import annotations

import argparse
import dataclasses
import math
import os
from typing import Optional

from llamapipe.model.llama import LlamaConfig
from llamapipe.training import profile_schema
from llamapipe.tools import launch_line
from llamapipe.tools.parallel_estimate import Layout
from llamapipe.tools.profile_predict import Prediction, balanced_counts, layer_counts, layout_string, predict

VOCAB_FLAG = "--enable-vocab-parallel"
MOCK_DATA = "--mock-data"      # both plans' commands run as printed; DATA_NOTE says what to give instead
DATA_NOTE = ("the top row's command trains on --mock-data (random tokens): for your data give --data-path PREFIX "
             "--tokenizer-model TOKENIZER instead (from `llamapipe preprocess`)")


def trainer_has_vocab_parallel() -> bool:
    """Whether the trainer's parser knows --enable-vocab-parallel (the planner only offers what runs)."""
    from llamapipe.training.arguments.parser import build_parser
    return VOCAB_FLAG in build_parser()._option_string_actions


def variants(profile: dict, lay: Layout, vocab: bool) -> list[tuple[Layout, Optional[list[int]]]]:
    """`lay` with each layer split worth predicting (None: the even one) and vocabulary split on or off."""
    out = []
    for vocab_parallel in ((False, True) if vocab and lay.pp > 1 else (False,)):
        v = dataclasses.replace(lay, vocab_parallel=vocab_parallel)
        splits: list[Optional[list[int]]] = []
        try:
            layer_counts(profile, v)
            splits.append(None)
        except ValueError:
            pass
        if lay.pp > 1:
            balanced = balanced_counts(profile, v)
            if not splits or balanced != layer_counts(profile, v):
                splits.append(balanced)
        out += [(v, s) for s in splits]
    return out


def best_variant(profile: dict, lay: Layout, global_batch: int, vocab: bool,
                 post_validation: bool) -> Optional[tuple[Layout, Prediction]]:
    """The fastest predicted variant of `lay` (its pipeline_layout set when the split is not even)."""
    best = None
    for v, counts in variants(profile, lay, vocab):
        pred = predict(profile, v, global_batch, counts=counts, post_validation=post_validation)
        if counts is not None:
            v = dataclasses.replace(v, pipeline_layout=layout_string(counts))
        if best is None or pred.step_s < best[1].step_s:
            best = (v, pred)
    return best


def rank_layouts(profile: dict, layouts: list[Layout], global_batch: int, *, vocab: bool = False,
                 post_validation: bool = False) -> list[tuple[Layout, Prediction]]:
    """Layouts the profile has settings for, each at its best split, fastest predicted first."""
    have = set(profile_schema.settings(profile))
    rows = [best_variant(profile, lay, global_batch, vocab, post_validation)
            for lay in layouts if (lay.micro_batch, lay.recompute) in have]
    rows = [r for r in rows if r is not None]
    rows.sort(key=lambda row: row[1].step_s)
    return rows


TIE = 0.02      # the measured spread of the model's errors on one layout between runs is larger than this


def near_ties(rows: list[tuple[Layout, Prediction]]) -> int:
    """How many of the first rows are predicted within `TIE` of the first."""
    best = rows[0][1].step_s
    return sum(1 for _, p in rows if p.step_s <= best * (1 + TIE))


def table(rows: list[tuple[Layout, Prediction]], top: int) -> str:
    head = (f"{'#':>3} {'tp':>3} {'pp':>3} {'vpp':>3} {'dp':>3} {'schedule':<11} {'mbs':>3} {'recompute':<9} "
            f"{'zero1':<5} {'vocab':<5} {'layers per stage':<18} {'busy per rank ms':<24} {'bubble':>6} {'step ms':>8}")
    lines = [head, "-" * len(head)]
    for i, (lay, p) in enumerate(rows[:top], 1):
        busy = "/".join(f"{b * 1e3:.0f}" for b in p.busy_s)
        split = "/".join(map(str, p.layer_counts))
        lines.append(f"{i:>3} {lay.tp:>3} {lay.pp:>3} {lay.vpp:>3} {lay.dp:>3} {lay.schedule:<11} "
                     f"{lay.micro_batch:>3} {lay.recompute:<9} {'yes' if lay.dist_opt else 'no':<5} "
                     f"{'yes' if lay.vocab_parallel else 'no':<5} "
                     f"{split:<18} {busy:<24} {p.bubble:>6.1%} {p.step_s * 1e3:>8.1f}")
    return "\n".join(lines)


def shape_flags(profile: dict) -> list[str]:
    """The profile's model as Megatron shape flags."""
    m = profile["model"]
    flags = ["--num-layers", m["num_layers"], "--hidden-size", m["hidden_size"], "--ffn-hidden-size",
             m["ffn_hidden_size"], "--num-attention-heads", m["num_attention_heads"], "--vocab-size", m["vocab_size"],
             "--seq-length", profile["seq_length"], "--max-position-embeddings", m["max_position_embeddings"]]
    if m["num_query_groups"] != m["num_attention_heads"]:
        flags += ["--group-query-attention", "--num-query-groups", m["num_query_groups"]]
    return [str(x) for x in flags]


def layout_flags(lay: Layout) -> list[str]:
    """The trainer's flags for the parallel part of `lay`."""
    flags = ["--tensor-model-parallel-size", str(lay.tp), "--pipeline-model-parallel-size", str(lay.pp),
             "--micro-batch-size", str(lay.micro_batch)]
    if lay.pp > 1:
        flags += ["--pipeline-schedule", lay.schedule]
        flags += (["--pipeline-model-parallel-layout", lay.pipeline_layout] if lay.pipeline_layout else
                  ["--num-virtual-stages-per-pipeline-rank", str(lay.vpp)])
    if lay.tp > 1:
        flags.append("--sequence-parallel")
    if lay.recompute == "full":
        flags += ["--recompute-granularity", "full", "--recompute-method", "uniform"]
    if lay.dist_opt:
        flags.append("--use-distributed-optimizer")
    if lay.vocab_parallel:
        flags.append(VOCAB_FLAG)
    return flags


def command(profile: dict, lay: Layout, global_batch: int, post_validation: bool) -> str:
    flags = [launch_line.launcher(lay.tp * lay.pp * lay.dp), *shape_flags(profile),
             *layout_flags(lay), "--global-batch-size", str(global_batch)]
    flags += (["--bf16"] if profile["dtype"] == "bf16" else []) + (
        ["--enable-optimizer-post-validation"] if post_validation else []) + [MOCK_DATA]
    return " ".join(f"'{f}'" if "|" in f else f for f in flags)


MAX_PASS_S = 3600.0    # no layer's pass takes an hour: a larger time is a broken or hand-edited profile


def check_plausible(profile: dict, said: str) -> None:
    """ProfileError when a per-layer pass time of `profile` is absurd (finite, as validate checks, yet over an
    hour: 1e308 s overflows every sum the planner makes)."""
    for i, entry in enumerate(profile["entries"]):
        for component in profile_schema.COMPONENTS:
            for field in ("f", "b", "w"):
                value = (entry.get(component) or {}).get(field, 0.0)
                if value > MAX_PASS_S:
                    raise profile_schema.ProfileError(
                        f"{said}: entries[{i}].{component}.{field} is {value:g} s, over {MAX_PASS_S:g} s for one "
                        "pass; remeasure it with `llamapipe profile`")


def run(args: argparse.Namespace, layouts_fn, asked: Optional[LlamaConfig] = None) -> int:
    """`plan --profile`: load, rank, print; `layouts_fn(model, gpus, global_batch, max_mbs)` enumerates. `asked`:
    the model --model and the shape flags give, if any: the profile must have been measured on it (the trainer's
    check), and its number of layers is planned (the profile's times are per layer)."""
    profile = profile_schema.load(args.profile)
    if asked is not None:
        profile_schema.check_same_model(profile, asked, f"--profile {args.profile}", "--model and the shape flags give")
        profile = {**profile, "model": {**profile["model"], "num_layers": asked.num_layers}}
    source = "OMP_NUM_THREADS" if "OMP_NUM_THREADS" in os.environ else "torchrun's OMP_NUM_THREADS=1"
    mismatch = profile_schema.threads_mismatch(profile, profile_schema.run_threads(), f"--profile {args.profile}",
                                               f"a torchrun rank of the planned command ({source})")
    if mismatch is not None:
        raise profile_schema.ProfileError(mismatch)
    model = profile_schema.model_of(profile)
    check_plausible(profile, f"--profile {args.profile}")
    rows = rank_layouts(profile, layouts_fn(model, args.gpus, args.global_batch_size, args.max_micro_batch_size),
                        args.global_batch_size, vocab=trainer_has_vocab_parallel(),
                        post_validation=args.post_validation)
    bad = next((p for _, p in rows if not all(map(math.isfinite, (p.step_s, p.bubble, *p.busy_s)))), None)
    if bad is not None:
        raise profile_schema.ProfileError(f"--profile {args.profile}: its times give a predicted step of "
                                          f"{bad.step_s!r} s; check the profile's times (remeasure it)")
    if not rows:
        raise SystemExit(f"llamapipe plan: no layout of {args.gpus} ranks has a profiled micro-batch size and "
                         f"recompute setting ({', '.join(f'{b}/{r}' for b, r in profile_schema.settings(profile))})")
    print(f"time model: measured profile {args.profile} ({profile['device']}, {profile['threads']} thread(s) per "
          f"rank), simulated per stage; predicted step per layout at its best layer split")
    note = profile_schema.notice(profile, args.profile)
    if note:
        print(f"note: {note}")
    print(table(rows, args.top))
    close = near_ties(rows)
    if close > 1:
        print(f"note: rows 1-{close} are predicted within {TIE:.0%} of each other, closer than the model separates "
              "on measurement (docs/planner.md, Accuracy): measure them before choosing")
    top = command(profile, rows[0][0], args.global_batch_size, args.post_validation)
    print(f"\n{launch_line.RUN_NOTE}\n{DATA_NOTE}\n{len(rows)} layouts predicted. "
          f"{launch_line.top_row(rows[0][0].tp * rows[0][0].pp * rows[0][0].dp, top)}")
    return 0

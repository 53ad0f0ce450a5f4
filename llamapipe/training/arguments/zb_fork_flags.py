"""The zero-bubble fork's flags (sail-sg/zero-bubble-pipeline-parallelism), with the fork's meaning.

People who run the zero-bubble authors' Megatron fork launch with its README's quick settings and its
examples/pretrain_zero_bubble.sh. So that those command lines run here unchanged, each of the fork's flags is
either translated into llamapipe's flags as it is parsed (the fork's meaning, e.g. `--zero-bubble-v-schedule
--zero-bubble-v-schedule-mem-setup half` is `--pipeline-schedule v-half` with two model chunks per rank),
accepted with one notice line where it has no meaning here, or refused in one line saying what to use instead.

The fork's rules (megatron/core/zbpp_utils.py and its zero-bubble runtime):
- `--zero-bubble-v-schedule` implies `--enable-zero-bubble` and two model chunks per rank on the V placement;
  `--zero-bubble-v-schedule-mem-setup` zb/half/min picks ZB-V, V-Half or V-Min (here zbv, v-half, v-min).
- `--enable-1f1b-v` is 1F1B on the V placement (here 1f1b-v, two chunks per rank; not with the zero-bubble flags);
  `--interleave-group-size N` (N > 0, with virtual stages) is the grouped interleaved 1F1B, here
  group-interleaved:N; the zero-bubble schedules take precedence over it, as in the fork's runtime.
- `--enable-zero-bubble` alone profiles F/B/W until `--zero-bubble-pipeline-timers-end-iter` and then runs
  the zero-bubble heuristic under `--zero-bubble-max-pending-backward` microbatches of activations (p: like
  ZB-1p, 2p: like ZB-2p): here `--pipeline-schedule auto` with `--pipeline-memory-limit N` and
  `--pipeline-profile-iters END`. The fork refuses virtual stages without the V schedule; so does this.
A translated flag writes llamapipe's flags while it is parsed, so the rest of the validation sees an ordinary
command line; a value the user gave those flags that contradicts the fork's is one error line.
"""
from __future__ import annotations

import argparse

from llamapipe.core.config import ArgumentError
from llamapipe.core.pipeline_parallel.schedule_specs import grouped_name
from llamapipe.training.arguments.memory_limit import memory_limit
from llamapipe.training.arguments.compat_table import CompatFlag, add_table, dest_of, said

V_SCHEDULES = {"zb": "zbv", "half": "v-half", "min": "v-min"}   # --zero-bubble-v-schedule-mem-setup -> schedule
TIMERS_END_DEFAULT = 110          # the fork's defaults: timers on from iteration 100 to 110
TIMERS_START_DEFAULT = 100
ADAPTIVE = "auto"                 # --zero-bubble-max-pending-backward's adaptive cap (not a schedule name)
_OFFLOAD_ONLY = ("it tunes the fork's CUDA copy runtime for --cpu-offload; here each copy is an action of the plan on "
                 "one copy stream (training/arguments/offload_args.py)")

NOTICES: tuple[CompatFlag, ...] = (
    CompatFlag("--enable-zb-runtime", "one executor runs every schedule here, as the fork's unified runtime does"),
    CompatFlag("--enable-exactly-numeric-match", "--enable-optimizer-post-validation always gives the results of "
               "the synchronous step exactly"),
    CompatFlag("--no-barrier-with-level-1-timing", "the timers never add a barrier: a rank's wait for the others is "
               "measured as its idle time"),
    CompatFlag("--no-pre-communication-optimization", "receives are posted ahead of time; there is no "
               "pre-communication to turn off"),
    CompatFlag("--offload-continuous-buffers", _OFFLOAD_ONLY),
    CompatFlag("--measure-activation-memory", "the activation probe measures every rank's saved bytes where a "
               "schedule needs them (--pipeline-schedule auto, --pipeline-memory-limit in bytes); the step's log "
               "line has max memory"),
    CompatFlag("--no-paired-barrier", _OFFLOAD_ONLY),
)

REFUSED: tuple[CompatFlag, ...] = ()   # the fork's --num-seq-splits (Seq1F1B) is a flag of llamapipe's own

# the flags translated into llamapipe's: (flag, dest, argparse keywords, help)
_SWITCH = {"nargs": 0, "default": False}
TRANSLATED = (
    ("--enable-zero-bubble", _SWITCH, "the fork's zero-bubble schedule: --pipeline-schedule auto (profiled, then the "
     "zero-bubble heuristic under --zero-bubble-max-pending-backward microbatches of activations)"),
    ("--zero-bubble-v-schedule", _SWITCH, "implies --enable-zero-bubble with two model chunks per rank on the V "
     "placement: --pipeline-schedule zbv, v-half or v-min after --zero-bubble-v-schedule-mem-setup"),
    ("--zero-bubble-v-schedule-mem-setup", {"default": "zb", "choices": tuple(V_SCHEDULES)},
     "with --zero-bubble-v-schedule: zb (ZB-V, 1F1B's memory), half (V-Half) or min (V-Min)"),
    ("--zero-bubble-max-pending-backward", {"default": ADAPTIVE, "type": str}, "with --enable-zero-bubble: the "
     "activation cap in microbatches per rank (--pipeline-memory-limit N; p is like ZB-1p, 2p like ZB-2p); the "
     "fork's adaptive auto is auto's default cap here, 1F1B's activation memory (like ZB-1p)"),
    ("--zero-bubble-adaptive-memory-limit-percentile", {"default": 85, "type": int}, "the fork's adaptive cap "
     "(a percentile of GPU memory) is not implemented; give --pipeline-memory-limit in bytes instead"),
    ("--zero-bubble-pipeline-timers-start-iter", {"default": TIMERS_START_DEFAULT, "type": int},
     "with --enable-zero-bubble: the first iteration timed (here every profiled iteration but the first is)"),
    ("--zero-bubble-pipeline-timers-end-iter", {"default": TIMERS_END_DEFAULT, "type": int},
     "with --enable-zero-bubble: the last profiled iteration, after which the fitted plan runs "
     "(--pipeline-profile-iters END)"),
    ("--enable-1f1b-v", _SWITCH, "1F1B on the V placement with two model chunks per rank: --pipeline-schedule 1f1b-v"),
    ("--interleave-group-size", {"default": 0, "type": int}, "N > 0: the fork's grouped interleaved 1F1B with groups "
     "of N microbatches: --pipeline-schedule group-interleaved:N (model chunks from the virtual-stage flags)"),
    ("--allow-padding-num-layers", _SWITCH, "allow --num-layers not divisible by the pipeline size, the first and "
     "last stages holding fewer layers (refused with the equivalent --pipeline-model-parallel-layout)"),
)
FLAGS = tuple(entry.flag for entry in NOTICES + REFUSED) + tuple(flag for flag, _, _ in TRANSLATED)


def wanted(ns: argparse.Namespace) -> dict:
    """llamapipe's flags (by dest) as the fork's flags in `ns` set them."""
    if getattr(ns, "enable_1f1b_v", False):
        return {"pipeline_schedule": "1f1b-v", "num_virtual_stages_per_pipeline_rank": 2}
    if getattr(ns, "zero_bubble_v_schedule", False):
        return {"pipeline_schedule": V_SCHEDULES[ns.zero_bubble_v_schedule_mem_setup],
                "num_virtual_stages_per_pipeline_rank": 2}
    if not getattr(ns, "enable_zero_bubble", False):        # the fork's zero-bubble schedules come first
        group = getattr(ns, "interleave_group_size", 0)
        return {"pipeline_schedule": grouped_name("group-interleaved", group)} if group > 0 else {}
    out = {"pipeline_schedule": "auto", "pipeline_profile_iters": ns.zero_bubble_pipeline_timers_end_iter}
    if _positive(ns.zero_bubble_max_pending_backward):
        out["pipeline_memory_limit"] = memory_limit(ns.zero_bubble_max_pending_backward)
    return out


def _positive(text: str) -> bool:
    try:
        return float(text) > 0
    except ValueError:
        return False


def _flag(dest: str) -> str:
    return "--" + dest.replace("_", "-")


class _Translated(argparse.Action):
    """Store the fork flag, then write llamapipe's flags the fork's flags now mean (undoing what they no longer
    mean); a value the user gave one of those flags that differs is an error."""

    def __call__(self, parser, namespace, values, option_string=None):
        before = wanted(namespace)
        setattr(namespace, self.dest, True if self.nargs == 0 else values)
        after = wanted(namespace)
        for dest in set(before) | set(after):
            current, default = getattr(namespace, dest), parser.get_default(dest)
            if current not in (default, before.get(dest)):
                parser.error(f"{option_string} sets {_flag(dest)} {after.get(dest, default)} (the zero-bubble "
                             f"fork's meaning), which contradicts {_flag(dest)} {current}; drop one")
            setattr(namespace, dest, after.get(dest, default))


def add_fork_flags(p: argparse.ArgumentParser) -> None:
    """The fork's flags in one group: translated ones first, then no-effect and refused ones."""
    g = p.add_argument_group("zero-bubble fork flags (sail-sg/zero-bubble-pipeline-parallelism)",
                             "The fork's flags with the fork's meaning, so that its README's settings and "
                             "examples/pretrain_zero_bubble.sh run unchanged (examples/zero_bubble/ has a copy): "
                             "--zero-bubble-v-schedule is --pipeline-schedule zbv, v-half or v-min with two model "
                             "chunks per rank; --enable-zero-bubble alone is --pipeline-schedule auto with "
                             "--pipeline-memory-limit from --zero-bubble-max-pending-backward and "
                             "--pipeline-profile-iters from --zero-bubble-pipeline-timers-end-iter. Giving those "
                             "flags other values as well is an error.")
    for flag, kwargs, text in TRANSLATED:
        g.add_argument(flag, dest=flag[2:].replace("-", "_"), action=_Translated, help=text, **kwargs)
    add_table(g, NOTICES, "no effect: ")
    add_table(g, REFUSED, "refused: ")


def _padding(args: argparse.Namespace) -> list[str]:
    """--allow-padding-num-layers: the fork pads --num-layers to a multiple of the pipeline size and drops the padding
    from the last virtual stage, then the first, the second, ... Here a layout string says that split."""
    pp, layers = args.pipeline_model_parallel_size, args.num_layers
    if layers is None:
        return []
    if layers % pp == 0:
        return [f"notice: --allow-padding-num-layers has no effect here: --num-layers {layers} is a multiple of "
                f"--pipeline-model-parallel-size {pp}"]
    stages = pp * (2 if args.zero_bubble_v_schedule else 1)
    padded = layers - layers % pp + pp
    if padded % stages:
        raise ArgumentError(f"--allow-padding-num-layers pads --num-layers {layers} to {padded}, which two model "
                            f"chunks on each of --pipeline-model-parallel-size {pp} ranks cannot split evenly")
    counts = [padded // stages] * stages
    for index in range(-1, padded - layers - 1):
        counts[index] -= 1
    text = "|".join(("E" if i == 0 else "") + "t" * n + ("L" if i == stages - 1 else "") for i, n in enumerate(counts))
    raise ArgumentError(f"--allow-padding-num-layers with --num-layers {layers} and --pipeline-model-parallel-size "
                        f"{pp}: give the split it makes as --pipeline-model-parallel-layout \"{text}\"")


def _translated_notices(args: argparse.Namespace) -> list[str]:
    """One line for each translated flag given where it means nothing, or means less than in the fork."""
    v, zb, lines = args.zero_bubble_v_schedule, args.enable_zero_bubble, []
    given = {dest_of(flag): getattr(args, dest_of(flag)) for flag, _, _ in TRANSLATED}
    tuning = ("zero_bubble_max_pending_backward", "zero_bubble_adaptive_memory_limit_percentile",
              "zero_bubble_pipeline_timers_start_iter", "zero_bubble_pipeline_timers_end_iter")
    defaults = {"zero_bubble_max_pending_backward": ADAPTIVE, "zero_bubble_adaptive_memory_limit_percentile": 85,
                "zero_bubble_pipeline_timers_start_iter": TIMERS_START_DEFAULT,
                "zero_bubble_pipeline_timers_end_iter": TIMERS_END_DEFAULT}
    changed = [d for d in tuning if given[d] != defaults[d]]
    group, pp = args.interleave_group_size, args.pipeline_model_parallel_size
    if group > 0 and (v or zb):
        lines.append(f"--interleave-group-size has no effect here: {args.pipeline_schedule} runs instead, as in the fork")
    elif group > pp:
        lines.append(f"--interleave-group-size {group} is more than --pipeline-model-parallel-size {pp}: groups of {pp} "
                     "are built, as the fork resets it")
    if given["zero_bubble_v_schedule_mem_setup"] != "zb" and not v:
        lines.append("--zero-bubble-v-schedule-mem-setup has no effect here: it needs --zero-bubble-v-schedule")
    if v:
        lines += [f"{_flag(d)} has no effect here: {args.pipeline_schedule} is a fixed order, not fitted to profiled "
                  "costs" for d in changed]
    elif not zb:
        lines += [f"{_flag(d)} has no effect here: it needs --enable-zero-bubble" for d in changed]
    else:
        if args.zero_bubble_max_pending_backward == ADAPTIVE:
            lines.append("--zero-bubble-max-pending-backward auto: the fork's adaptive cap is not implemented; auto "
                         "plans under its default cap, 1F1B's activation memory (give N, e.g. 2p for ZB-2p, or "
                         "--pipeline-memory-limit BYTES)")
        elif "zero_bubble_adaptive_memory_limit_percentile" in changed:
            lines.append("--zero-bubble-adaptive-memory-limit-percentile has no effect here: "
                         "--zero-bubble-max-pending-backward is not auto")
        if args.zero_bubble_pipeline_timers_start_iter > 1:
            lines.append(f"--zero-bubble-pipeline-timers-start-iter {args.zero_bubble_pipeline_timers_start_iter}: "
                         "every profiled iteration but the first (warm-up) is timed here")
    return ["notice: " + line for line in lines]


def _check_translated(args: argparse.Namespace) -> None:
    """What the fork refuses, and a llamapipe flag given after a fork flag that contradicts it."""
    v, zb = args.zero_bubble_v_schedule, args.enable_zero_bubble
    if (v or zb) and args.pipeline_model_parallel_size < 2:
        raise ArgumentError(f"{'--zero-bubble-v-schedule' if v else '--enable-zero-bubble'} needs "
                            f"--pipeline-model-parallel-size > 1, got {args.pipeline_model_parallel_size}")
    if v and args.num_layers_per_virtual_pipeline_stage is not None:
        raise ArgumentError("--zero-bubble-v-schedule sets two model chunks per rank; drop "
                            f"--num-layers-per-virtual-pipeline-stage {args.num_layers_per_virtual_pipeline_stage}")
    chunks = args.num_virtual_stages_per_pipeline_rank or args.num_layers_per_virtual_pipeline_stage
    if zb and not v and chunks is not None:
        raise ArgumentError("--enable-zero-bubble without --zero-bubble-v-schedule runs one model chunk per rank; "
                            "add --zero-bubble-v-schedule or drop the virtual-stage flag")
    if args.enable_1f1b_v and (v or zb):
        raise ArgumentError("--enable-1f1b-v runs a fused backward; it cannot be combined with "
                            f"{'--zero-bubble-v-schedule' if v else '--enable-zero-bubble'} (as in the fork)")
    if args.interleave_group_size < 0:
        raise ArgumentError(f"--interleave-group-size {args.interleave_group_size} must be a positive number of "
                            "microbatches, or 0 for none")
    pending = args.zero_bubble_max_pending_backward
    if pending != ADAPTIVE and not _positive(pending):
        raise ArgumentError(f"--zero-bubble-max-pending-backward {pending} must be a positive number of microbatches "
                            "or auto")
    start, end = args.zero_bubble_pipeline_timers_start_iter, args.zero_bubble_pipeline_timers_end_iter
    if (zb or v) and end < 1:
        raise ArgumentError(f"--zero-bubble-pipeline-timers-end-iter {end} must be at least 1")
    if start != TIMERS_START_DEFAULT and start > end:     # both given: a window that ends before it starts
        raise ArgumentError(f"--zero-bubble-pipeline-timers-start-iter {start} is after "
                            f"--zero-bubble-pipeline-timers-end-iter {end}; the timers run from the start iteration "
                            "to the end one")
    for dest, value in wanted(args).items():
        if getattr(args, dest) != value:
            raise ArgumentError(f"{_flag(dest)} {getattr(args, dest)} contradicts {_flag(dest)} {value} that the "
                                "zero-bubble fork's flags set; drop one")


def check_fork_flags(args: argparse.Namespace) -> list[str]:
    """Raise ArgumentError for a refused fork flag or combination; return the notice lines of the rest."""
    for e in REFUSED:
        value = getattr(args, dest_of(e.flag))
        if value not in (None, False) and value not in e.off:
            raise ArgumentError(f"{said(e, value)} is not supported: {e.why}")
    _check_translated(args)
    notices = _padding(args) if args.allow_padding_num_layers else []
    notices += _translated_notices(args)
    return notices + [f"notice: {said(e, getattr(args, dest_of(e.flag)))} has no effect here: {e.why}"
                      for e in NOTICES if getattr(args, dest_of(e.flag)) not in (None, False)]

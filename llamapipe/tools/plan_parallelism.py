"""`llamapipe plan`: rank the parallel layouts that fit a LLaMA model on a cluster.

    llamapipe plan --model llama2-7b --gpus 8 --gpu-memory-gb 80 --seq-length 4096 --global-batch-size 512

Takes the candidates of `plan_candidates` (tp x cp x pp x dp = gpus, schedules and chunk counts, micro-batch
sizes, full activation recompute or none, the distributed optimizer, ring / a2a / a2a+p2p attention up to
--max-context-parallel-size, Seq1F1B with --num-seq-splits; selective recompute is left out: attention runs on
SDPA's flash kernels, which never store the s^2 scores, so it saves nothing) that the dry run's argument checks
accept, estimates each one's memory on its most loaded rank and its step time (llamapipe.tools.parallel_estimate),
keeps those that fit under --headroom x the GPU memory and prints them fastest first, with the best row of each
way to split a long sequence. The top row's command line is printed ready to run, with its `llamapipe dry-run`;
--explain N shows the memory breakdown of row N.

With --profile PROFILE.json (written by `llamapipe profile` on the machine to plan for) the step times come
from the measured profile instead (`profile_plan`): per-stage simulated costs, the layer split and the
vocabulary split chosen for each layout, predicted busy time and bubble per pipeline rank.
"""
from __future__ import annotations

import argparse
import dataclasses
import sys
from typing import Optional

from llamapipe.training.flag_parser import FlagParser
from llamapipe.core.pipeline_parallel.schedule_specs import SPECS
from llamapipe.model.llama import LlamaConfig
from llamapipe.model.families import FAMILIES, PRESETS, family_of_preset
from llamapipe.tools import launch_line, profile_plan
from llamapipe.training import profile_schema
from llamapipe.tools.parallel_estimate import DEVICES, GIB, Estimate, Layout, estimate
from llamapipe.tools.plan_candidates import (  # noqa: F401  (the planner's names, as before the split)
    MAX_CHUNKS, RECOMPUTE_FLAGS, SCHEDULES, SEQ_SPLITS, layouts, refusal, shape_refusal, trainer_flags,
    uneven_layout)

SHAPE_FIELDS = ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "num_query_groups", "vocab_size")


def build_parser() -> argparse.ArgumentParser:
    p = FlagParser(prog="llamapipe plan", description=__doc__.split("\n")[0])
    p.add_argument("--model", choices=tuple(PRESETS), default=None, help="named architecture")
    for flag in ("--num-layers", "--hidden-size", "--ffn-hidden-size", "--num-attention-heads",
                 "--num-query-groups", "--vocab-size"):
        p.add_argument(flag, type=int, default=None, help="shape override (or the whole shape without --model)")
    p.add_argument("--gpus", type=int, required=True, help="GPUs in all")
    p.add_argument("--gpu-memory-gb", type=float, default=80.0, help="memory per GPU in GiB (2^30 bytes)")
    p.add_argument("--seq-length", type=int, default=4096)
    p.add_argument("--global-batch-size", type=int, required=True, help="sequences per step")
    p.add_argument("--device", choices=tuple(DEVICES), default="h100", help="preset for the two figures below")
    p.add_argument("--device-tflops", type=float, default=None, help="dense bf16 peak per GPU, TFLOP/s")
    p.add_argument("--link-gbps", type=float, default=None, help="intra-node link per GPU, Gbit/s")
    p.add_argument("--headroom", type=float, default=0.9, help="share of the GPU memory a layout may plan to use")
    p.add_argument("--max-micro-batch-size", type=int, default=8)
    p.add_argument("--max-context-parallel-size", type=int, default=1,
                   help="also rank layouts that split each sequence over up to this many ranks "
                        "(--context-parallel-size; ring, a2a and a2a+p2p attention)")
    p.add_argument("--num-seq-splits", type=int, nargs="+", default=None, metavar="K",
                   help="Seq1F1B pieces per microbatch to rank besides the unsplit layouts (--num-seq-splits; "
                        f"1 alone: none); default {' '.join(map(str, SEQ_SPLITS))} from --seq-length "
                        f"{LONG_SEQUENCE} on, where pieces pay, else none (their plans are slow to simulate on "
                        "deep pipelines)")
    p.add_argument("--top", type=int, default=10, help="rows to print")
    p.add_argument("--explain", type=int, default=None, metavar="N", help="memory breakdown of row N (1 = top)")
    p.add_argument("--profile", default=None, metavar="JSON",
                   help="predict step times from this `llamapipe profile` output instead of FLOPs")
    p.add_argument("--post-validation", action="store_true",
                   help="with --profile: plan for --enable-optimizer-post-validation (longest stage span)")
    return p


def model_from_args(args: argparse.Namespace) -> LlamaConfig:
    fields = dict(PRESETS[args.model]) if args.model else {}
    for name in SHAPE_FIELDS:
        if getattr(args, name) is not None:
            fields[name] = getattr(args, name)
    missing = [n for n in ("num_layers", "hidden_size", "num_attention_heads") if n not in fields]
    if missing:
        raise SystemExit("llamapipe plan: give --model or --" + ", --".join(m.replace("_", "-") for m in missing))
    fields.setdefault("ffn_hidden_size", int(4 * fields["hidden_size"] * 2 / 3 / 64) * 64)
    fields.setdefault("num_query_groups", fields["num_attention_heads"])
    family = family_of_preset(args.model) if args.model else FAMILIES["llama"]
    return family.config_class(**fields)


LONG_SEQUENCE = 32768      # from here on `plan` ranks Seq1F1B rows without being asked


def seq_splits_of(args: argparse.Namespace) -> tuple[int, ...]:
    """The Seq1F1B piece counts to rank: --num-seq-splits, else SEQ_SPLITS for long sequences, else none."""
    if args.num_seq_splits is not None:
        return tuple(args.num_seq_splits)
    return SEQ_SPLITS if args.seq_length >= LONG_SEQUENCE else (1,)


def rank(m: LlamaConfig, args: argparse.Namespace, dev) -> list[tuple[Layout, Estimate]]:
    budget = args.headroom * args.gpu_memory_gb * GIB
    rows = []
    for lay in layouts(m, args.gpus, args.global_batch_size, args.max_micro_batch_size,
                       args.max_context_parallel_size, args.seq_length, seq_splits_of(args)):
        if shape_refusal(args, lay, m) is not None:     # the trainer's own checks, as the dry run runs them
            continue
        est = estimate(m, lay, args.seq_length, args.global_batch_size, dev)
        if est.total > budget:      # a pipeline that does not fit may with its cheap parts recomputed or offloaded
            lay, est = _with_levers(m, lay, est, args, dev, budget)
        if est is not None and est.total <= budget:
            rows.append((lay, est))
    rows.sort(key=lambda row: (row[1].step_s, row[1].total))
    return rows


def _with_levers(m: LlamaConfig, lay: Layout, est: Estimate, args: argparse.Namespace, dev,
                 budget: float) -> tuple[Layout, Optional[Estimate]]:
    """`lay` with the fork's --recompute-lgd (the norms and the activation recomputed: element-wise work, no GEMM)
    or with offload (`_with_offload`), whichever fits and steps faster (lgd when they tie: it needs no host
    memory); (lay, None) when neither fits. Only layouts without recompute, and only where the weights and optimizer
    state leave room (`est`, the layout's estimate without them): neither lever moves those."""
    if lay.recompute != "none" or est.total - est.activations > budget:
        return lay, None
    lgd = dataclasses.replace(lay, recompute="lgd")
    options = [(lgd, estimate(m, lgd, args.seq_length, args.global_batch_size, dev)),
               _with_offload(m, lay, args, dev, budget)]
    fits = [(l, e) for l, e in options if e is not None and e.total <= budget and refusal(args, l, m) is None]
    return min(fits, key=lambda row: row[1].step_s) if fits else (lay, None)


def _with_offload(m: LlamaConfig, lay: Layout, args: argparse.Namespace, dev,
                  budget: float) -> tuple[Layout, Optional[Estimate]]:
    """The fewest chunks per rank whose offload (PipeOffload, --cpu-offload) makes `lay` fit, or (lay, None);
    only without recompute: offload is the lever that costs no FLOPs."""
    if lay.pp == 1 or lay.recompute != "none":
        return lay, None
    found: tuple[Layout, Optional[Estimate]] = (lay, None)
    low, high = 1, lay.vpp          # more chunks offloaded never hold more: search the fewest that fit
    while low <= high:
        chunks = (low + high) // 2
        offloaded = dataclasses.replace(lay, offload=chunks)
        est = estimate(m, offloaded, args.seq_length, args.global_batch_size, dev)
        if est.total <= budget:
            found, high = (offloaded, est), chunks - 1
        else:
            low = chunks + 1
    return found


def command(args: argparse.Namespace, lay: Layout, m: Optional[LlamaConfig] = None) -> str:
    """The command line of `lay`'s job: torchrun on one node, scripts/launch_multi_node.sh on each of several."""
    return " ".join([launch_line.launcher(args.gpus), *trainer_flags(args, lay, m)])


def dry_run_command(args: argparse.Namespace, lay: Layout, m: Optional[LlamaConfig] = None) -> str:
    """The `llamapipe dry-run` of `command`'s job on all its ranks (docs/dry_run.md), with mock data as `command`
    has it: the run's own --data-path and --tokenizer-model go in its place to check them too."""
    flags = " ".join(trainer_flags(args, lay, m))
    return f"llamapipe dry-run --world-size {args.gpus} --gpu-memory-gb {args.gpu_memory_gb:g} {flags}"


def table(rows: list[tuple[Layout, Estimate]], top: int) -> str:
    width = max([11] + [len(lay.schedule) for lay, _ in rows[:top]])     # group-interleaved is longer
    cp_width = max([8] + [len(_cp_text(lay)) for lay, _ in rows[:top]])    # "16 a2a+p2p 2x8"
    head = (f"{'#':>3} {'tp':>3} {'cp':>{cp_width}} {'pp':>3} {'vpp':>3} {'dp':>3} {'schedule':<{width}} {'seq':>3} "
            f"{'mbs':>3} {'recompute':<9} "
            f"{'offload':<7} {'distopt':<7} {'params':>7} {'grads':>7} {'optim':>7} {'activ':>7} {'comm':>7} {'total':>7} {'step s':>8} "
            f"{'MFU':>6}")
    memory = head.index("params") - 1         # the unit of the six memory columns, over them
    lines = [" " * memory + "GiB on the most loaded GPU".center(len(head) - memory - 16).rstrip(), head,
             "-" * len(head)]
    for i, (lay, e) in enumerate(rows[:top], 1):
        gib = [x / GIB for x in (e.params, e.grads, e.optimizer, e.activations, e.comm, e.total)]
        seq = lay.seq_splits if lay.seq_splits > 1 else "-"
        lines.append(f"{i:>3} {lay.tp:>3} {_cp_text(lay):>{cp_width}} {lay.pp:>3} {lay.vpp:>3} {lay.dp:>3} "
                     f"{lay.schedule:<{width}} {seq:>3} {lay.micro_batch:>3} "
                     f"{lay.recompute:<9} {_offload_text(lay):<7} {'yes' if lay.dist_opt else 'no':<7} "
                     + " ".join(f"{x:>7.1f}" for x in gib) + f" {e.step_s:>8.2f} {e.mfu:>6.1%}")
    return "\n".join(lines)


def checked(rows: list[tuple[Layout, Estimate]], args: argparse.Namespace, m: LlamaConfig,
            top: int) -> list[tuple[Layout, Estimate]]:
    """`rows` less those whose whole flags the dry run's checks refuse (`refusal`), checked for the rows `plan`
    prints: the first `top` and the best of each way to split a sequence (`attention_options`)."""
    out, seen = [], set()
    for lay, est in rows:
        if (len(out) < top or _option(lay) not in seen) and refusal(args, lay, m) is not None:
            continue
        seen.add(_option(lay))
        out.append((lay, est))
    return out


def _option(lay: Layout) -> tuple[str, bool]:
    return (_comm_name(lay) if lay.cp > 1 else "", lay.seq_splits > 1)


def attention_options(rows: list[tuple[Layout, Estimate]]) -> str:
    """One line per way of splitting a long sequence among the ranked rows (each context-parallel attention,
    Seq1F1B): its best row, also below the table's top."""
    best: dict[str, int] = {}
    for i, (lay, _) in enumerate(rows, 1):
        if lay.cp > 1:
            best.setdefault(f"{_comm_name(lay)} context parallelism", i)
        if lay.seq_splits > 1:
            best.setdefault("Seq1F1B (--num-seq-splits)", i)
    lines = []
    for option, i in best.items():
        lay, e = rows[i - 1]
        what = [f"cp {lay.cp}"] if lay.cp > 1 else []
        what += [f"{lay.seq_splits} pieces, {lay.schedule}"] if lay.seq_splits > 1 else []
        lines.append(f"best {option}: row {i} ({', '.join(what)}, step {e.step_s:.2f} s, {e.total / GIB:.1f} GiB)")
    return "\n".join(lines)


def _comm_name(lay: Layout) -> str:
    return "ring" if lay.cp_comm == "p2p" else lay.cp_comm


def _cp_text(lay: Layout) -> str:
    """The CP size with its attention: "8 ring", "8 a2a", "8 a2a+p2p 2x4" (the a2a and ring levels; just "1"
    without context parallelism)."""
    if lay.cp == 1:
        return "1"
    return f"{lay.cp} {_comm_name(lay)}" + (f" {lay.cp_a2a}x{lay.cp // lay.cp_a2a}" if lay.cp_a2a else "")


def _offload_text(lay: Layout) -> str:
    return f"{lay.offload} of {lay.vpp}" if lay.offload else "-"


def explain(lay: Layout, e: Estimate) -> str:
    offload = ([f"  offload: the activations of chunk{'s' if lay.offload > 1 else ''} 0-{lay.offload - 1} of every "
                f"rank go to host memory between forward and backward (--cpu-offload, PipeOffload)"
                + (" and what deferred weight gradients hold between B and W (--offload-weight-grad-inputs)"
                   if SPECS[lay.schedule].zero_bubble else "") + ": without it this layout does not fit"]
               if lay.offload else [])
    zero1 = ", ZeRO-1's gather" if lay.dist_opt and lay.dp * lay.cp > 1 else ""
    seq = f" in {lay.seq_splits} sequence pieces (Seq1F1B)" if lay.seq_splits > 1 else ""
    if lay.recompute == "lgd":
        offload.append("  recompute lgd: each layer's norms and SwiGLU activation are recomputed instead of kept "
                       "(--recompute-lgd, element-wise work, no GEMM): without it this layout does not fit")
    return "\n".join([
        f"layout: tp {lay.tp}, cp {_cp_text(lay)}, pp {lay.pp}, {lay.vpp} chunk(s) per rank, dp {lay.dp}, "
        f"--pipeline-schedule {lay.schedule}{seq}, micro-batch {lay.micro_batch}, recompute {lay.recompute}, "
        f"distributed optimizer {'on' if lay.dist_opt else 'off'}",
        f"  parameters (bf16, 2 B each)          {e.params / GIB:8.2f} GiB",
        f"  gradients (fp32, 4 B each)           {e.grads / GIB:8.2f} GiB",
        f"  optimizer (fp32 master, m, v: 12 B{'/dp' if lay.dist_opt else ''}) {e.optimizer / GIB:8.2f} GiB",
        f"  activations (peak of the plan, {e.peak_units:.2f} x the largest chunk's microbatch) "
        f"{e.activations / GIB:8.2f} GiB",
        f"  communication buffers (p2p receives, gradient buckets{zero1}; the dry run's model) {e.comm / GIB:8.2f} GiB",
        f"  total on the most loaded rank        {e.total / GIB:8.2f} GiB",
        f"  step {e.step_s:.3f} s, MFU {e.mfu:.1%}", *offload])


def main(argv: Optional[list[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    if args.num_seq_splits is not None and min(args.num_seq_splits) < 1:
        sys.stderr.write(f"llamapipe plan: --num-seq-splits takes piece counts of at least 1, got "
                         f"{' '.join(map(str, args.num_seq_splits))}\n")
        return 2
    if args.profile:
        shaped = args.model is not None or any(getattr(args, name) is not None for name in SHAPE_FIELDS)
        try:
            return profile_plan.run(args, layouts, model_from_args(args) if shaped else None)
        except profile_schema.ProfileError as e:
            sys.stderr.write(f"llamapipe plan: {e}\n")
            return 2
    m = model_from_args(args)
    dev = DEVICES[args.device]
    dev = dataclasses.replace(dev, tflops=args.device_tflops or dev.tflops, link_gbps=args.link_gbps or dev.link_gbps)
    rows = checked(rank(m, args, dev), args, m, args.top)
    if not rows:
        sys.stderr.write(f"llamapipe plan: no layout fits {args.gpus} GPUs of {args.gpu_memory_gb:g} GiB "
                         f"(x {args.headroom:g} headroom) for this model at --seq-length {args.seq_length}\n")
        return 1
    if args.explain is not None:
        if not 1 <= args.explain <= len(rows):
            sys.stderr.write(f"llamapipe plan: --explain {args.explain} is not a row (1..{len(rows)})\n")
            return 2
        print(explain(*rows[args.explain - 1]))
        return 0
    print(f"time model: FLOPs at {dev.efficiency:.0%} of {args.device}'s peak (no --profile; `llamapipe profile` "
          "measures this machine)")
    print(table(rows, args.top))
    print(attention_options(rows))
    print(f"\n{launch_line.RUN_NOTE}\n{profile_plan.DATA_NOTE}\n{len(rows)} layouts fit. Check the top row on this machine first (every "
          f"rank's setup and one step on meta tensors, docs/dry_run.md):\n  {dry_run_command(args, rows[0][0], m)}")
    print(launch_line.top_row(args.gpus, command(args, rows[0][0], m)))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""What --enable-optimizer-post-validation costs when clipping triggers on every step, per schedule and layer split.

When every step clips, speculation cannot pay: each speculative update would be rolled back and its next
iteration run again. The speculation policy (core/optimizer/post_validation.SpeculationPolicy) pauses it, so
such a run should cost about what the synchronous run costs (the target: at most 1.03x). This benchmark runs
pretrain_llama.py on 2 pipeline ranks (torchrun, gloo, one thread per rank) with and without the flag, for
each schedule, split (even, --pipeline-model-parallel-layout auto) and --clip-grad, in alternating rounds (the
order flips every round, so a drift in machine speed hits both alike). Per run: the mean time per iteration
after the warm-up iterations as logged (a mean, not a median: a replayed iteration must count in full; with the
flag an iteration's time spans from one step to the next, the loop between them included, so the ratio leans
against the flag); per case: the
median over rounds of the per-round ratio with / without and its spread (min-max), the post-validation line of
the last run, and whether the losses were identical (they must be).

    python -m benchmarks.bench_post_validation --rounds 5 --iters 20 \\
        --out benchmarks/results/bench_post_validation.json
"""
from __future__ import annotations

import argparse
import os
import re
import statistics
import sys
import tempfile

from benchmarks.launch import read_metrics, torchrun
from benchmarks.results_io import write_json

MODEL = ["--mock-data", "--num-layers", "8", "--hidden-size", "256", "--ffn-hidden-size", "512",
         "--num-attention-heads", "4", "--vocab-size", "256", "--seq-length", "256",
         "--max-position-embeddings", "256", "--seed", "1234", "--lr", "1e-3", "--lr-warmup-iters", "1",
         "--log-interval", "1", "--eval-iters", "0", "--num-workers", "0", "--micro-batch-size", "2",
         "--global-batch-size", "16", "--pipeline-model-parallel-size", "2"]
SCHEDULES = {"1f1b": ["--pipeline-schedule", "1f1b"], "auto": ["--pipeline-schedule", "auto"],
             "zb-h2": ["--pipeline-schedule", "zb-h2"],
             "zbv": ["--pipeline-schedule", "zbv", "--num-virtual-stages-per-pipeline-rank", "2"]}
SUMMARY = re.compile(r"post-validation: [^\n]*")


def case_flags(schedule: str, layout: str, clip: str) -> list[str]:
    if layout == "auto":     # the chunks per rank come from the schedule
        return ["--pipeline-schedule", schedule, "--pipeline-model-parallel-layout", "auto", "--clip-grad", clip]
    return SCHEDULES[schedule] + ["--clip-grad", clip]


def run(flags: list[str], iters: int, warmup: int, post_validation: bool) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        jsonl = os.path.join(tmp, "m.jsonl")
        args = MODEL + flags + ["--train-iters", str(iters), "--metrics-jsonl", jsonl]
        proc = torchrun(2, args + (["--enable-optimizer-post-validation"] if post_validation else []),
                        timeout=3600)
        if proc.returncode != 0:
            return {"error": (proc.stdout + proc.stderr).strip().splitlines()[-1]}
        records = read_metrics(jsonl)
    timed = [r["elapsed_ms"] / 1000 for r in records[warmup:]]
    summary = SUMMARY.findall(proc.stdout)
    return {"iteration_s": sum(timed) / len(timed), "losses": [r["lm_loss"] for r in records],
            "grad_norms": [r["grad_norm"] for r in records], "summary": summary[-1] if summary else None}


def measure(case: dict, rounds: int, iters: int, warmup: int) -> dict:
    """Alternating rounds of one case; the per-round ratios with / without and their median and spread."""
    flags = case_flags(case["schedule"], case["layout"], case["clip"])
    runs: dict[bool, list[dict]] = {False: [], True: []}
    for i in range(rounds):
        for post_validation in ((False, True) if i % 2 == 0 else (True, False)):
            runs[post_validation].append(run(flags, iters, warmup, post_validation))
    failed = [r["error"] for r in runs[False] + runs[True] if "error" in r]
    if failed:
        return {**case, "error": failed[0]}
    ratios = [w["iteration_s"] / s["iteration_s"] for s, w in zip(runs[False], runs[True])]
    return {**case, "ratio_median": statistics.median(ratios), "ratio_min": min(ratios), "ratio_max": max(ratios),
            "ratios": ratios, "without_s": [r["iteration_s"] for r in runs[False]],
            "with_s": [r["iteration_s"] for r in runs[True]],
            "same_losses": all(w["losses"] == runs[False][0]["losses"] for w in runs[True]),
            "grad_norms": runs[False][0]["grad_norms"], "summary": runs[True][-1]["summary"]}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--schedules", nargs="+", choices=list(SCHEDULES), default=list(SCHEDULES))
    p.add_argument("--layouts", nargs="+", choices=["even", "auto"], default=["even", "auto"])
    p.add_argument("--clips", nargs="+", default=["0.01", "1.0"], help="--clip-grad values (1.0: grad norms 2-6)")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--warmup", type=int, default=5, help="untimed first iterations (auto and zb-h2 profile 3)")
    p.add_argument("--out", default="benchmarks/results/bench_post_validation.json")
    args = p.parse_args(argv)
    if args.iters <= args.warmup:
        p.error(f"--iters {args.iters} leaves no timed iteration after --warmup {args.warmup}")
    cases = [{"schedule": s, "layout": lay, "clip": c} for s in args.schedules for lay in args.layouts
             for c in args.clips]
    rows = [measure(case, args.rounds, args.iters, args.warmup) for case in cases]
    print(f"{'schedule':<7} {'layout':<6} {'clip':>5} {'with/without':>13} {'spread':>13} {'same':>5}  post-validation")
    for row in rows:
        head = f"{row['schedule']:<7} {row['layout']:<6} {row['clip']:>5}"
        if "error" in row:
            print(f"{head} failed: {row['error']}")
            continue
        spread = f"{row['ratio_min']:.3f}-{row['ratio_max']:.3f}"
        print(f"{head} {row['ratio_median']:>12.3f}x {spread:>13} {str(row['same_losses']):>5}  {row['summary']}")
    write_json(args.out, {"model": MODEL, "rounds": args.rounds, "iters": args.iters, "warmup": args.warmup,
                          "rows": rows}, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())

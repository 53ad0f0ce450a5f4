"""Where a 2-rank pipeline loses time on real compute, through pretrain_llama.py as a user runs it (issue 42).

The shapes of the issue: 2 pipeline ranks (torchrun, gloo, one thread each), 8 layers, hidden 256, FFN 688, 8 heads,
seq 256, micro-batch 2, global batch 16 (8 microbatches), fp32. Two groups of cases:

  vocab     vocabulary 8192 (LLaMA 3's vocabulary-to-hidden ratio): synchronous ZB-V with the even split (the
            baseline), ZB-V with vocabulary parallelism alone and with post-validation, the layer split alone
            (--pipeline-model-parallel-layout auto), and the automatic configuration (auto schedule, auto layout,
            post-validation);
  wide-vocab vocabulary 32768 (the output layer alone outweighs the 8 decoder layers: no layer split balances it),
            the same cases;
  balanced  vocabulary 256 (the head is negligible), --clip-grad 100: one process without a pipeline (the ideal is
            its iteration / 2), 1F1B, ZB-V, ZB-V with post-validation.

Every run logs the timers (--timing-log-level 1), so each case also says where each rank's time went: compute,
communication and idle (the measured bubble), in ms per iteration. Cases run in alternating rounds (the order
rotates every round, so a drift of the machine hits all alike); per case the median over rounds of the mean
iteration time after the warm-up iterations, its spread, and the median ratio to the group's baseline paired by
round.

    python -m benchmarks.bench_pipeline_gaps --rounds 3 --iters 14 --out benchmarks/results/bench_pipeline_gaps.json
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile

from benchmarks.launch import read_metrics, torchrun
from benchmarks.results_io import write_json

MODEL = ["--mock-data", "--num-layers", "8", "--hidden-size", "256", "--ffn-hidden-size", "688",
         "--num-attention-heads", "8", "--seq-length", "256", "--max-position-embeddings", "256", "--seed", "1234",
         "--lr", "1e-4", "--lr-warmup-iters", "1", "--log-interval", "1", "--eval-iters", "0", "--num-workers", "0",
         "--micro-batch-size", "2", "--global-batch-size", "16", "--timing-log-level", "1"]
PP2 = ["--pipeline-model-parallel-size", "2"]
ZBV = PP2 + ["--pipeline-schedule", "zbv", "--num-virtual-stages-per-pipeline-rank", "2"]
VP, PV = ["--enable-vocab-parallel"], ["--enable-optimizer-post-validation"]
GROUPS = {
    "vocab": (["--vocab-size", "8192"], {
        "zbv-even": (2, ZBV),
        "zbv-vocab-parallel": (2, ZBV + VP),
        "zbv-vocab-parallel-post-validation": (2, ZBV + VP + PV),
        "zbv-layout-auto": (2, PP2 + ["--pipeline-schedule", "zbv", "--pipeline-model-parallel-layout", "auto"]),
        "auto-layout-auto-post-validation": (2, PP2 + ["--pipeline-schedule", "auto",
                                                       "--pipeline-model-parallel-layout", "auto"] + PV),
    }),
    "wide-vocab": (["--vocab-size", "32768"], {
        "zbv-even": (2, ZBV),
        "zbv-layout-auto": (2, PP2 + ["--pipeline-schedule", "zbv", "--pipeline-model-parallel-layout", "auto"]),
        "zbv-vocab-parallel": (2, ZBV + VP),
        "zbv-vocab-parallel-post-validation": (2, ZBV + VP + PV),
        "auto-layout-auto-post-validation": (2, PP2 + ["--pipeline-schedule", "auto",
                                                       "--pipeline-model-parallel-layout", "auto"] + PV),
    }),
    "balanced": (["--vocab-size", "256", "--clip-grad", "100"], {
        "one-process": (1, []),
        "1f1b": (2, PP2 + ["--pipeline-schedule", "1f1b"]),
        "zbv": (2, ZBV),
        "zbv-post-validation": (2, ZBV + PV),
    }),
}
BASELINE = {"vocab": "zbv-even", "wide-vocab": "zbv-even", "balanced": "one-process"}


def run(nproc: int, flags: list[str], iters: int, warmup: int) -> dict:
    """Mean seconds per iteration after `warmup`, and each rank's compute / communication / idle ms per iteration."""
    with tempfile.TemporaryDirectory() as tmp:
        jsonl = os.path.join(tmp, "m.jsonl")
        proc = torchrun(nproc, MODEL + flags + ["--train-iters", str(iters), "--metrics-jsonl", jsonl], timeout=3600)
        if proc.returncode != 0:
            return {"error": (proc.stdout + proc.stderr).strip().splitlines()[-1]}
        records = read_metrics(jsonl)[warmup:]
    timed = [r for r in records if "timers" in r]
    split = {rank: {k: statistics.fmean(r["timers"][rank][k] for r in timed)
                    for k in ("iteration", "compute", "communication", "idle")} for rank in timed[0]["timers"]}
    return {"iteration_s": statistics.fmean(r["elapsed_ms"] for r in records) / 1e3, "split_ms": split,
            "bubble_max": statistics.fmean(r["bubble_max"] for r in timed), "timed_records": len(timed)}


def measure(group: str, rounds: int, iters: int, warmup: int) -> list[dict]:
    base_flags, cases = GROUPS[group]
    names = list(cases)
    runs: dict[str, list[dict]] = {n: [] for n in names}
    for k in range(rounds):
        for name in names[k % len(names):] + names[:k % len(names)]:
            nproc, flags = cases[name]
            runs[name].append(run(nproc, base_flags + flags, iters, warmup))
    base = runs[BASELINE[group]]
    rows = []
    for name in names:
        failed = [r["error"] for r in runs[name] if "error" in r]
        if failed:
            rows.append({"group": group, "case": name, "error": failed[0]})
            continue
        times = [r["iteration_s"] for r in runs[name]]
        ratios = [r["iteration_s"] / b["iteration_s"] for r, b in zip(runs[name], base) if "error" not in b]
        rows.append({"group": group, "case": name, "iteration_s": statistics.median(times),
                     "spread_s": [min(times), max(times)], "ratio_to_baseline": statistics.median(ratios),
                     "ratio_spread": [min(ratios), max(ratios)], "split_ms": runs[name][-1]["split_ms"],
                     "bubble_max": statistics.median(r["bubble_max"] for r in runs[name])})
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--groups", nargs="+", choices=list(GROUPS), default=list(GROUPS))
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--iters", type=int, default=14)
    p.add_argument("--warmup", type=int, default=5, help="untimed first iterations (auto profiles 3)")
    p.add_argument("--out", default="benchmarks/results/bench_pipeline_gaps.json")
    args = p.parse_args(argv)
    rows = [row for group in args.groups for row in measure(group, args.rounds, args.iters, args.warmup)]
    for row in rows:
        if "error" in row:
            print(f"{row['group']:<9} {row['case']:<36} failed: {row['error']}")
            continue
        split = "; ".join(f"{rank}: compute {v['compute']:.0f} comm {v['communication']:.0f} idle {v['idle']:.0f}"
                          for rank, v in row["split_ms"].items())
        print(f"{row['group']:<9} {row['case']:<36} {row['iteration_s']:.3f} s  {row['ratio_to_baseline']:.3f}x "
              f"({row['ratio_spread'][0]:.3f}-{row['ratio_spread'][1]:.3f})  bubble {100 * row['bubble_max']:.1f}%"
              f"  [{split}]")
    write_json(args.out, {"model": MODEL, "rounds": args.rounds, "iters": args.iters, "warmup": args.warmup,
                          "rows": rows}, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Data-parallel sharding benchmark on the CPU: step time of each --data-parallel-sharding-strategy side by side.

Runs pretrain_llama.py with torchrun on gloo (benchmarks/launch.py, one thread per rank) for each strategy and
DP size, and reports the median step time over the iterations after the first (warm-up), its ratio to no_shard
at the same DP size, and the final loss (equal across strategies). A benchmark, not a test: CPU timings vary
with the machine and its load.

    python -m benchmarks.bench_fsdp --dp 2 4 --iters 5 --out benchmarks/results/bench_fsdp.json
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile

from benchmarks.launch import read_metrics, torchrun
from benchmarks.results_io import write_json
from llamapipe.core.config import SHARDING_STRATEGIES as STRATEGIES

MODEL = ["--mock-data", "--num-layers", "8", "--hidden-size", "256", "--ffn-hidden-size", "704",
         "--num-attention-heads", "8", "--vocab-size", "4096", "--seq-length", "128",
         "--max-position-embeddings", "128", "--lr", "1e-4", "--log-interval", "1", "--eval-iters", "0",
         "--num-workers", "0", "--micro-batch-size", "2"]


def run(strategy: str, dp: int, iters: int, extra: list[str]) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        jsonl = os.path.join(tmp, "m.jsonl")
        args = MODEL + ["--train-iters", str(iters), "--global-batch-size", str(4 * dp),
                        "--data-parallel-sharding-strategy", strategy, "--metrics-jsonl", jsonl] + extra
        proc = torchrun(dp, args, timeout=1200)
        if proc.returncode != 0:
            return {"strategy": strategy, "dp": dp, "error": proc.stderr.strip().splitlines()[-1]}
        records = read_metrics(jsonl)
    steps = [r["elapsed_ms"] / 1000 for r in records[1:]]
    return {"strategy": strategy, "dp": dp, "step_s": statistics.median(steps), "steps_s": steps,
            "final_loss": records[-1]["lm_loss"]}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dp", type=int, nargs="+", default=[2, 4])
    p.add_argument("--iters", type=int, default=6)
    p.add_argument("--extra", default="", help="more pretrain_llama.py flags, e.g. \"--optimizer-cpu-offload\"")
    p.add_argument("--out", default="benchmarks/results/bench_fsdp.json")
    args = p.parse_args(argv)
    if args.iters < 2:
        p.error(f"--iters {args.iters} is too few: the first iteration is warm-up and not timed, so at least 2")
    rows = [run(s, dp, args.iters, args.extra.split()) for dp in args.dp for s in STRATEGIES]
    print(f"{'dp':>3} {'strategy':<20} {'step s':>8} {'vs no_shard':>12} {'final loss':>12}")
    for row in rows:
        if "error" in row:
            print(f"{row['dp']:>3} {row['strategy']:<20} failed: {row['error']}")
            continue
        base = next(r for r in rows if r["dp"] == row["dp"] and r["strategy"] == "no_shard")
        row["vs_no_shard"] = row["step_s"] / base["step_s"] if "step_s" in base else None
        ratio = f"{row['vs_no_shard']:.2f}x" if row["vs_no_shard"] else "-"
        print(f"{row['dp']:>3} {row['strategy']:<20} {row['step_s']:>8.3f} {ratio:>12} {row['final_loss']:>12.6f}")
    write_json(args.out, {"model": MODEL, "iters": args.iters, "extra": args.extra, "rows": rows}, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())

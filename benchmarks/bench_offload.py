"""What activation offload and partial recompute cost a step: pretrain_llama.py, 2 ranks, ZB-V.

The shape of issue 47: 8 layers, hidden 256 (FFN 688, 8 heads), sequence 1024, micro-batch 1, 8 microbatches, fp32
on gloo. Variants (each only where this checkout has its flags): the plain run; `--cpu-offload --offload-chunk-num
1`, and with `--offload-weight-grad-inputs`; Megatron's `--fine-grained-activation-offloading`; `--recompute-granularity selective --recompute-modules
core_attn mlp`; `--recompute-lgd`. Alternating rounds (every variant once per round), each run's median time per
iteration over its steady iterations (the first two dropped); per round the ratio to that round's plain run; the
table gives the median ratio with its spread, each rank's compute / communication / idle from the timers
(--timing-log-level 2, so the copies are counted: their time is the timers' activation-offload and
activation-reload, communication on the rank's timeline since on a CPU a copy is a memcpy on the compute cores).

    python -m benchmarks.bench_offload --rounds 3 --out benchmarks/results/offload.json
    python -m benchmarks.bench_offload --only "offload chunk 0 + W inputs"     # with the plain run, as always
"""
from __future__ import annotations

import argparse
import os
import re
import statistics
import tempfile

from benchmarks.launch import read_metrics, torchrun
from benchmarks.results_io import write_json
from llamapipe.training.arguments.parser import build_parser, config_from_args

SHAPE = ["--mock-data", "--num-layers", "8", "--hidden-size", "256", "--ffn-hidden-size", "688",
         "--num-attention-heads", "8", "--vocab-size", "256", "--seq-length", "1024", "--max-position-embeddings",
         "1024", "--micro-batch-size", "1", "--global-batch-size", "8", "--lr", "1e-4", "--log-interval", "1",
         "--eval-iters", "0", "--num-workers", "0", "--pipeline-model-parallel-size", "2",
         "--num-virtual-stages-per-pipeline-rank", "2", "--pipeline-schedule", "zbv", "--timing-log-level", "2"]
VARIANTS = {
    "plain": [],
    "offload chunk 0": ["--cpu-offload", "--offload-chunk-num", "1"],
    "offload chunk 0 + W inputs": ["--cpu-offload", "--offload-chunk-num", "1", "--offload-weight-grad-inputs"],
    "megatron fine-grained": ["--fine-grained-activation-offloading", "--min-offloaded-tensor-size", "0"],
    "recompute core_attn mlp": ["--recompute-granularity", "selective", "--recompute-modules", "core_attn", "mlp"],
    "recompute lgd": ["--recompute-lgd"],
}
COPY = re.compile(r"activation-(offload|reload) \.+: \(([0-9.]+), ([0-9.]+)\)")


def available(flags: list[str]) -> bool:
    """Whether this checkout takes `flags` (a variant whose flags are missing or refused is reported, not run)."""
    try:
        config_from_args(build_parser().parse_args(SHAPE + flags), 2)
        return True
    except (SystemExit, ValueError):
        return False


def run(flags: list[str], iters: int) -> dict:
    """One run: median seconds per steady iteration, the per-rank split of the last record and the copy times."""
    with tempfile.TemporaryDirectory() as tmp:
        jsonl = os.path.join(tmp, "m.jsonl")
        proc = torchrun(2, SHAPE + flags + ["--train-iters", str(iters), "--metrics-jsonl", jsonl])
        assert proc.returncode == 0, proc.stderr[-3000:]
        records = read_metrics(jsonl)
        copies = {kind: float(hi) for kind, _, hi in COPY.findall(proc.stdout + proc.stderr)}
        return {"iter_s": statistics.median(r["elapsed_ms"] / 1e3 for r in records[2:]),
                "timers": records[-1].get("timers", {}), "copy_ms": copies}


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--iters", type=int, default=6)
    p.add_argument("--out", default=None)
    p.add_argument("--only", nargs="+", choices=list(VARIANTS), default=list(VARIANTS), metavar="VARIANT",
                   help=f"run these variants (and the plain run): {', '.join(map(repr, VARIANTS))}")
    args = p.parse_args(argv)
    chosen = {name: VARIANTS[name] for name in VARIANTS if name == "plain" or name in args.only}
    variants = {name: flags for name, flags in chosen.items() if available(flags)}
    missing = sorted(set(chosen) - set(variants))
    runs: dict[str, list[dict]] = {name: [] for name in variants}
    for _ in range(args.rounds):
        for name, flags in variants.items():
            runs[name].append(run(flags, args.iters))
    rows = []
    for name, results in runs.items():
        ratios = [r["iter_s"] / base["iter_s"] for r, base in zip(results, runs["plain"])]
        rows.append({"variant": name, "ratio_median": statistics.median(ratios), "ratio_spread": [min(ratios),
                     max(ratios)], "iter_s": statistics.median(r["iter_s"] for r in results),
                     "timers_last_round": results[-1]["timers"], "copy_ms_last_round": results[-1]["copy_ms"]})
    print(f"{'variant':<26} {'step s':>7} {'x plain':>8} {'spread':>13}  per rank: compute/communication/idle ms; copies")
    for row in rows:
        split = "; ".join(f"{rank} {t['compute']:.0f}/{t['communication']:.0f}/{t['idle']:.0f}"
                          for rank, t in sorted(row["timers_last_round"].items()))
        lo, hi = row["ratio_spread"]
        print(f"{row['variant']:<26} {row['iter_s']:>7.3f} {row['ratio_median']:>8.3f} {lo:>6.3f}-{hi:<6.3f}  {split}; "
              f"{row['copy_ms_last_round'] or '-'}")
    for name in missing:
        print(f"{name}: not run, this checkout's parser does not take {' '.join(VARIANTS[name])}")
    out = {"rounds": args.rounds, "iters": args.iters, "rows": rows, "not_run": missing}
    if args.out:
        write_json(args.out, out)
    return out


if __name__ == "__main__":
    main()

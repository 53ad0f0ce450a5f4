"""ZB-V with --compile against ZB-V eager at p=2, through the CLI (torchrun, gloo, one thread per rank).

Each round runs `pretrain_llama.py` twice with the same flags, eager and then with --compile (the order
alternates between rounds), and reads the per-iteration records of --metrics-jsonl: a run's tokens/s is the
median over its iterations after the first (the trainer's own throughput; the first iteration is never
timed). The compiled run's compile seconds come from its log line. The table gives each round's ratio,
their median and min-max spread, and the 1-minute load average around every run; rounds are decided up
front (--rounds), so a slow spell hits one round, not the median. Inductor's on-disk cache is shared by
all runs: the first compiled run pays the full compile, later ones mostly load kernels. Writes JSON.

    python -m benchmarks.bench_compile --out benchmarks/results/bench_compile.json
"""
from __future__ import annotations

import argparse
import importlib.metadata
import os
import platform
import re
import statistics
import tempfile

from benchmarks.bench_model import add_model_shape_args
from benchmarks.launch import read_metrics, torchrun
from benchmarks.results_io import write_json

COMPILED_RE = re.compile(r"--compile: compiled \d+ decoder layers .* in ([\d.]+) s")


def cli_flags(args: argparse.Namespace) -> list[str]:
    return ["--mock-data", "--num-layers", str(args.num_layers), "--hidden-size", str(args.hidden_size),
            "--ffn-hidden-size", str(args.ffn_hidden_size), "--num-attention-heads", str(args.num_heads),
            "--group-query-attention", "--num-query-groups", str(args.num_groups),
            "--vocab-size", str(args.vocab_size), "--seq-length", str(args.seq_length),
            "--max-position-embeddings", str(args.seq_length), "--micro-batch-size", "1",
            "--global-batch-size", str(args.microbatches), "--train-iters", str(args.iters),
            "--lr", "1e-4", "--log-interval", "1", "--eval-iters", "0", "--num-workers", "0",
            "--pipeline-model-parallel-size", "2", "--num-virtual-stages-per-pipeline-rank", "2",
            "--pipeline-schedule", "zbv"]


def run_once(args: argparse.Namespace, compiled: bool, workdir: str, tag: str) -> dict:
    """One training run; its median tokens/s after the first iteration, losses and compile seconds."""
    jsonl = os.path.join(workdir, f"{tag}.jsonl")
    flags = [*cli_flags(args), "--metrics-jsonl", jsonl, *(["--compile"] if compiled else [])]
    load_before = os.getloadavg()[0]
    proc = torchrun(2, flags, timeout=1800, env={"TORCHINDUCTOR_CACHE_DIR": args.cache_dir})
    if proc.returncode != 0:
        raise RuntimeError(f"pretrain_llama.py {' '.join(flags)} failed:\n{proc.stderr[-3000:]}")
    records = read_metrics(jsonl)
    timed = [r["tokens_per_sec"] for r in records if r.get("tokens_per_sec")]
    match = COMPILED_RE.search(proc.stdout + proc.stderr)
    return {"tokens_per_s": statistics.median(timed), "iterations_timed": len(timed),
            "losses": [r["lm_loss"] for r in records], "compile_s": float(match.group(1)) if match else None,
            "loadavg_1min_before": load_before, "loadavg_1min_after": os.getloadavg()[0]}


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_shape_args(p, num_layers=8)   # 8 layers: two per ZB-V stage
    p.add_argument("--microbatches", type=int, default=8, help="global batch of microbatches of one sample")
    p.add_argument("--iters", type=int, default=8)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--cache-dir", default=os.path.join(tempfile.gettempdir(), "llamapipe_bench_compile_inductor"))
    p.add_argument("--out", default="benchmarks/results/bench_compile.json")
    return p.parse_args()


def main() -> None:
    args = parse_args()
    rounds = []
    with tempfile.TemporaryDirectory() as workdir:
        for r in range(args.rounds):
            order = (False, True) if r % 2 == 0 else (True, False)
            runs = {compiled: run_once(args, compiled, workdir, f"r{r}-{'compiled' if compiled else 'eager'}")
                    for compiled in order}
            eager, compiled = runs[False], runs[True]
            rounds.append({"eager": eager, "compiled": compiled,
                           "ratio": compiled["tokens_per_s"] / eager["tokens_per_s"],
                           "max_loss_rel_diff": max(abs(a - b) / abs(b) for a, b in
                                                    zip(compiled["losses"], eager["losses"]))})
    ratios = [r["ratio"] for r in rounds]
    print(f"{'round':>5} {'eager tok/s':>11} {'compiled tok/s':>14} {'ratio':>6} {'compile s':>9} "
          f"{'loss rel diff':>13} {'load':>9}")
    for i, r in enumerate(rounds):
        e, c = r["eager"], r["compiled"]
        print(f"{i:>5} {e['tokens_per_s']:>11.0f} {c['tokens_per_s']:>14.0f} {r['ratio']:>6.3f} "
              f"{c['compile_s'] or float('nan'):>9.1f} {r['max_loss_rel_diff']:>13.1e} "
              f"{e['loadavg_1min_before']:>4.1f}/{c['loadavg_1min_after']:<4.1f}")
    print(f"zbv p=2 compiled / eager tokens/s: median {statistics.median(ratios):.3f} over {len(ratios)} rounds "
          f"(min-max {min(ratios):.3f}-{max(ratios):.3f})")
    result = {"benchmark": "compile_zbv_p2", "config": vars(args), "platform": platform.platform(),
              "torch": importlib.metadata.version("torch"),
              "median_ratio": statistics.median(ratios), "spread": [min(ratios), max(ratios)], "rounds": rounds}
    write_json(args.out, result)


if __name__ == "__main__":
    main()

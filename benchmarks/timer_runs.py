"""What bench_timers and bench_straggler share: the timer hooks called as the executor calls them, one small
pretrain_llama.py run's median time per iteration, and the modes' table and JSON.

Why here: both benchmarks time the same hooks and the same p = 2 run, with and without a timer feature; one copy
keeps their numbers comparable."""
from __future__ import annotations

import os
import statistics
import tempfile
import time
from typing import Callable

from benchmarks.launch import read_metrics, torchrun
from benchmarks.results_io import write_json

# 2 ranks, 8 layers, hidden 256: the shape both overhead modes run
SMALL_PP2 = ["--mock-data", "--num-layers", "8", "--hidden-size", "256", "--ffn-hidden-size", "688",
             "--num-attention-heads", "8", "--vocab-size", "256", "--seq-length", "256", "--max-position-embeddings",
             "256", "--micro-batch-size", "2", "--global-batch-size", "16", "--lr", "1e-4", "--log-interval", "1",
             "--eval-iters", "0", "--num-workers", "0", "--pipeline-model-parallel-size", "2"]


def hook_pass(timers, n: int, interval_every: int = 0) -> float:
    """Microseconds per action of `n` actions' hooks on `timers` (a StepTimers after step_begin): one action_done,
    one message received and sent, one post between actions; `timers.interval()` every `interval_every` actions."""
    from llamapipe.core.pipeline_parallel.p2p_communication import Message
    from llamapipe.core.pipeline_parallel.schedule_ir import Action
    action, msg = Action("F", 0, 3), Message("act", 1, 3, 0, 1)
    start = time.perf_counter()
    for i in range(n):
        t0 = time.perf_counter()
        t1 = time.perf_counter()
        timers.message_received(msg, t1)
        timers.action_done(action, t0, time.perf_counter(), 0.0)
        timers.message_sent(msg, time.perf_counter())
        t2 = time.perf_counter()
        timers.comm_done("post", t2, time.perf_counter())
        if interval_every and i % interval_every == interval_every - 1:
            timers.interval()
    return (time.perf_counter() - start) / n * 1e6


def median_iteration_s(iters: int, extra: list[str]) -> float:
    """Median seconds per iteration over iterations 3.. of one SMALL_PP2 run with `extra` flags."""
    with tempfile.TemporaryDirectory() as tmp:
        jsonl = os.path.join(tmp, "m.jsonl")
        proc = torchrun(2, [*SMALL_PP2, "--train-iters", str(iters), "--metrics-jsonl", jsonl, *extra])
        assert proc.returncode == 0, proc.stderr[-3000:]
        return statistics.median(r["elapsed_ms"] / 1e3 for r in read_metrics(jsonl)[2:])


def run_modes(args, modes: tuple[tuple[str, Callable], ...]) -> dict:
    """Each mode named in args.modes: its rows, printed as a table, then all of them written to args.out."""
    results: dict = {}
    for mode, fn in modes:
        if mode in args.modes.split(","):
            results[mode] = fn(args)
            print(mode)
            for row in results[mode]:
                print("  " + "  ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()
                                       if not isinstance(v, list)))
    write_json(args.out, results)
    return results

"""Runs pretrain_llama.py the way users do (torchrun in a subprocess) and reads its JSONL metrics.

`torchrun` and `read_metrics` live in benchmarks/launch.py, which the benchmarks share."""
from __future__ import annotations

from benchmarks.launch import ROOT, free_port, read_metrics, torchrun

__all__ = ["ROOT", "TINY", "free_port", "read_metrics", "torchrun", "train"]

# Megatron's defaults log every 100 iterations, evaluate 100 iterations and load data in 2 worker processes;
# the tiny runs log every iteration, evaluate only when a test asks for it, and read data in-process.
TINY = ["--mock-data", "--num-layers", "8", "--hidden-size", "64", "--ffn-hidden-size", "128",
        "--num-attention-heads", "4", "--group-query-attention", "--num-query-groups", "2", "--vocab-size", "256",
        "--seq-length", "32", "--max-position-embeddings", "64", "--seed", "1234",
        "--lr", "1e-3", "--lr-warmup-iters", "1", "--clip-grad", "1.0", "--log-interval", "1",
        "--eval-iters", "0", "--num-workers", "0"]


def train(nproc: int, args: list[str], jsonl: str, *, tiny: list[str] | None = None, **kw) -> list[dict]:
    """Run to completion (asserting success) and return the per-iteration records (`tiny`: other base flags)."""
    proc = torchrun(nproc, (tiny or TINY) + args + ["--metrics-jsonl", jsonl], **kw)
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    return read_metrics(jsonl)

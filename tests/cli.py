"""Runs pretrain_llama.py the way users do (torchrun in a subprocess) and reads its JSONL metrics."""
from __future__ import annotations

import json
import os
import subprocess
import sys

from tests.harness import ROOT, free_port

# Megatron's defaults log every 100 iterations, evaluate 100 iterations and load data in 2 worker processes;
# the tiny runs log every iteration, evaluate only when a test asks for it, and read data in-process.
TINY = ["--mock-data", "--num-layers", "8", "--hidden-size", "64", "--ffn-hidden-size", "128",
        "--num-attention-heads", "4", "--group-query-attention", "--num-query-groups", "2", "--vocab-size", "256",
        "--seq-length", "32", "--max-position-embeddings", "64", "--seed", "1234",
        "--lr", "1e-3", "--lr-warmup-iters", "1", "--clip-grad", "1.0", "--log-interval", "1",
        "--eval-iters", "0", "--num-workers", "0"]


def torchrun(nproc: int, args: list[str], *, script: str = "pretrain_llama.py", extra: list[str] | None = None,
             timeout: float = 300, env: dict | None = None) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc),
           "--master_addr", "127.0.0.1", "--master_port", str(free_port()), *(extra or []), script, *args]
    full_env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT, **(env or {}))
    return subprocess.run(cmd, cwd=ROOT, env=full_env, capture_output=True, text=True, timeout=timeout)


def read_metrics(path: str) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f if '"lm_loss"' in line]


def train(nproc: int, args: list[str], jsonl: str, *, tiny: list[str] | None = None, **kw) -> list[dict]:
    """Run to completion (asserting success) and return the per-iteration records (`tiny`: other base flags)."""
    proc = torchrun(nproc, (tiny or TINY) + args + ["--metrics-jsonl", jsonl], **kw)
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    return read_metrics(jsonl)

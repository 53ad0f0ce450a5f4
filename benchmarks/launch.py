"""How benchmarks (and the tests, through tests/harness.py and tests/cli.py) start ranks on one machine.

Two ways, both on gloo with one thread per rank:
- `run_distributed(fn, world_size, *args)` spawns `world_size` processes, calls `fn(rank, world_size, *args)`
  on each after `init_process_group("gloo")`, and returns the per-rank results in rank order, or raises
  `RankFailure` with the first failing rank's traceback; a hung group is killed after `timeout` seconds.
  `fn` must be importable by name (a module-level function) because ranks are spawned, not forked.
- `torchrun(nproc, args)` runs `pretrain_llama.py` (or another script) the way users do, under torchrun in a
  subprocess; `read_metrics` reads the per-iteration records of its `--metrics-jsonl`.

Why here: benchmarks run from a checkout with `python -m benchmarks.<name>` and must not depend on the test
suite, while the tests use the very same launchers, so there is one copy.
"""
from __future__ import annotations

import json
import os
import pickle
import queue
import socket
import subprocess
import sys
import time
import traceback
from typing import Any, Callable

import torch
import torch.multiprocessing as mp

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class RankFailure(AssertionError):
    pass


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world_size: int, port: int, fn: Callable, args: tuple, out: Any) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    try:
        import torch.distributed as dist
        dist.init_process_group("gloo", rank=rank, world_size=world_size)
        # Plain pickle copies tensor data inline; the queue's own pickler would share storage through
        # file descriptors that vanish when this process exits.
        result = pickle.dumps(fn(rank, world_size, *args))
        out.put((rank, "ok", result))
        dist.barrier()
        dist.destroy_process_group()
        out.close()
        out.join_thread()       # the result is in the pipe
    except BaseException:  # report everything, including SystemExit, to the parent
        out.put((rank, "error", traceback.format_exc()))
        sys.exit(1)
    from llamapipe.process_exit import exit_process
    exit_process(0)             # skips the interpreter's teardown of torch, 1.3 s a rank (llamapipe/process_exit.py)


def run_distributed(fn: Callable, world_size: int, *args: Any, timeout: float = 180.0) -> list:
    """Run `fn(rank, world_size, *args)` on `world_size` gloo ranks; results in rank order."""
    if ROOT not in os.environ.get("PYTHONPATH", "").split(os.pathsep):
        os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p)
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_worker, args=(r, world_size, port, fn, args, out), daemon=True)
             for r in range(world_size)]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    deadline = time.monotonic() + timeout
    try:
        while len(results) < world_size:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise RankFailure(f"distributed test timed out after {timeout:.0f}s; "
                                  f"ranks without a result: {sorted(set(range(world_size)) - set(results))}")
            try:
                rank, status, payload = out.get(timeout=min(remaining, 1.0))
            except queue.Empty:
                dead = [i for i, p in enumerate(procs) if p.exitcode not in (None, 0) and i not in results]
                if dead:
                    _drain_error(out)
                    raise RankFailure(f"rank {dead[0]} exited with code {procs[dead[0]].exitcode} "
                                      "without reporting a result")
                continue
            if status == "error":
                raise RankFailure(f"rank {rank} failed:\n{payload}")
            results[rank] = pickle.loads(payload)
    finally:
        _stop(procs)
    return [results[r] for r in range(world_size)]


def _drain_error(out: Any) -> None:
    try:
        while True:
            rank, status, payload = out.get(timeout=0.5)
            if status == "error":
                raise RankFailure(f"rank {rank} failed:\n{payload}")
    except queue.Empty:
        return


def _stop(procs: list) -> None:
    deadline = time.monotonic() + 10
    for p in procs:
        p.join(timeout=max(deadline - time.monotonic(), 0.1))
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join()


def torchrun(nproc: int, args: list[str], *, script: str = "pretrain_llama.py", extra: list[str] | None = None,
             timeout: float = 300, env: dict | None = None) -> subprocess.CompletedProcess:
    """`torchrun --nproc_per_node nproc script args` from the repository root, one thread per rank."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc),
           "--master_addr", "127.0.0.1", "--master_port", str(free_port()), *(extra or []), script, *args]
    full_env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT, **(env or {}))
    return subprocess.run(cmd, cwd=ROOT, env=full_env, capture_output=True, text=True, timeout=timeout)


def read_metrics(path: str) -> list[dict]:
    """The per-iteration training records of a --metrics-jsonl file (validation records left out)."""
    with open(path) as f:
        return [json.loads(line) for line in f if '"lm_loss"' in line]

"""Multi-process CPU test harness (gloo): spawn N ranks, run a function, collect results or fail fast.

`run_distributed(fn, world_size, *args)` calls `fn(rank, world_size, *args)` on every rank after
`init_process_group("gloo")`. It returns the per-rank results in rank order, or raises `RankFailure`
with the first failing rank's traceback; a hung group is killed after `timeout` seconds.
`fn` must be importable by name (a module-level function) because ranks are spawned, not forked.
"""
from __future__ import annotations

import os
import pickle
import queue
import socket
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
    except BaseException:  # report everything, including SystemExit, to the parent
        out.put((rank, "error", traceback.format_exc()))
        sys.exit(1)


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

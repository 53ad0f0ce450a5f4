"""Multi-process CPU test harness (gloo): spawn N ranks, run a function, collect results or fail fast.

`run_distributed(fn, world_size, *args)` calls `fn(rank, world_size, *args)` on every rank after
`init_process_group("gloo")`. It returns the per-rank results in rank order, or raises `RankFailure`
with the first failing rank's traceback; a hung group is killed after `timeout` seconds.
`fn` must be importable by name (a module-level function) because ranks are spawned, not forked.

The launcher lives in benchmarks/launch.py, which the benchmarks share; the tests import it from here.
"""
from benchmarks.launch import ROOT, RankFailure, free_port, run_distributed

__all__ = ["ROOT", "RankFailure", "free_port", "run_distributed"]

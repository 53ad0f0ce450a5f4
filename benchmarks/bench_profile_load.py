"""`llamapipe profile` on a machine other processes load: does a decoder layer's F stay what a training rank sees?

Rounds alternate between the machine as it is and the machine with `--hogs` extra processes that spin on the
CPU (one per core by default, so every core is shared). Each round measures the docs' model (`--model tiny
--seq-length 128`, micro-batch 1, no recompute) as `llamapipe profile` does, with one thread per process as a
torchrun rank computes (`profile_model.measure_entry`, timed in the thread's CPU time); the layer's F, B and W
are compared as the median over rounds of the loaded / unloaded ratio (target: F within 1.15x). Then it asks
`profile_machine.load_refusal` what a profile with 2 threads (timed in wall time) would do with the hogs running.
Example: python -m benchmarks.bench_profile_load --rounds 5
"""
from __future__ import annotations

import argparse
import multiprocessing
import os
import statistics
import time

import torch

from benchmarks.results_io import write_json
from llamapipe.model.llama import LlamaConfig
from llamapipe.tools import profile_machine
from llamapipe.tools.profile_model import measure_entry


def _spin(stop) -> None:
    x = 0
    while not stop.is_set():
        x += 1


def _layer(repeats: int) -> dict:
    m = LlamaConfig.from_name("tiny")
    entry = measure_entry(m, 128, 1, "none", torch.float32, torch.device("cpu"), repeats, layers=8)
    return {k: entry["layer"][k] for k in ("f", "b", "w")}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--hogs", type=int, default=os.cpu_count() or 1, help="spinning processes in a loaded round")
    p.add_argument("--out", default="benchmarks/results/bench_profile_load.json")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    rows = []
    for r in range(args.rounds):
        quiet = _layer(args.repeats)
        stop = multiprocessing.Event()
        hogs = [multiprocessing.Process(target=_spin, args=(stop,), daemon=True) for _ in range(args.hogs)]
        for h in hogs:
            h.start()
        time.sleep(0.5)                 # the hogs are running before the busy cores are measured
        busy = profile_machine.busy_cores()
        loaded = _layer(args.repeats)
        refusal = profile_machine.load_refusal(2, busy)
        stop.set()
        for h in hogs:
            h.join()
        rows.append({"round": r, "quiet_ms": {k: v * 1e3 for k, v in quiet.items()},
                     "loaded_ms": {k: v * 1e3 for k, v in loaded.items()}, "busy_cores_loaded": busy,
                     "two_threads_refused": refusal is not None})
        print(f"round {r}: F {quiet['f'] * 1e3:.3f} -> {loaded['f'] * 1e3:.3f} ms, B {quiet['b'] * 1e3:.3f} -> "
              f"{loaded['b'] * 1e3:.3f}, W {quiet['w'] * 1e3:.3f} -> {loaded['w'] * 1e3:.3f} (busy cores with "
              f"the hogs {busy if busy is None else round(busy, 2)}; 2 threads refused: {refusal is not None})")
    ratios = {k: statistics.median(row["loaded_ms"][k] / row["quiet_ms"][k] for row in rows) for k in "fbw"}
    spread = {k: (min(row["loaded_ms"][k] / row["quiet_ms"][k] for row in rows),
                  max(row["loaded_ms"][k] / row["quiet_ms"][k] for row in rows)) for k in "fbw"}
    print("loaded / unloaded, median (min-max): " + ", ".join(
        f"{k.upper()} {ratios[k]:.3f} ({spread[k][0]:.3f}-{spread[k][1]:.3f})" for k in "fbw"))
    write_json(args.out, {"hogs": args.hogs, "repeats": args.repeats, "rounds": rows, "median_ratio": ratios,
                          "ratio_range": spread})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

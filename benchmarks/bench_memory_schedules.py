"""Memory-controlled schedules on CPU: step time of v-half and v-min against 1f1b and zbv at p=2, with each
plan's simulated peak activation memory (whole-stage microbatches, M_W = 0.5).

Runs the real-compute mode of bench_schedules.py (two gloo ranks, one core each, a small LlamaModel; every
schedule timed round-robin) and keeps the four rows; prints a table and writes JSON. Not a timed test.

    python -m benchmarks.bench_memory_schedules --real-m 8 --real-rounds 5
"""
from __future__ import annotations

import argparse
import os
import sys

from benchmarks import bench_schedules
from benchmarks.results_io import write_json
from llamapipe.core.pipeline_parallel.schedule_specs import build
from llamapipe.core.pipeline_parallel.simulator import Costs, peak_memory

NAMES = {"1f1b": 1, "zbv": 2, "v-half": 2, "v-min": 2}


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results",
                                                      "bench_memory_schedules.json"))
    args, rest = parser.parse_known_args(argv)
    results = bench_schedules.main(["--modes", "real", "--out", args.out + ".all.json"] + rest)
    rows = []
    for r in results["real"]:
        if r["schedule"] in NAMES and r.get("step_s") is not None:
            plan = build(r["schedule"], 2, NAMES[r["schedule"]], r["m"])
            peak = max(peak_memory(plan, Costs())) / NAMES[r["schedule"]]
            rows.append({"schedule": r["schedule"], "m": r["m"], "step_ms": 1e3 * r["step_s"], "peak_mb_units": peak})
    base = {r["m"]: r["step_ms"] for r in rows if r["schedule"] == "1f1b"}
    print(f"{'schedule':<8} {'m':>3} {'step ms':>9} {'vs 1f1b':>8} {'sim. peak (stage-microbatches)':>32}")
    for r in rows:
        print(f"{r['schedule']:<8} {r['m']:>3} {r['step_ms']:>9.1f} {r['step_ms'] / base[r['m']]:>8.3f} "
              f"{r['peak_mb_units']:>32.2f}")
    write_json(args.out, {"rows": rows}, indent=1)
    return {"rows": rows}


if __name__ == "__main__":
    sys.exit(0 if main() else 1)

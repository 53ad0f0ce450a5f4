"""Pool the real-mode rounds of several bench_schedules.py runs into paired ratios with bootstrap intervals.

Why: on a shared 2-core VM one round of a schedule varies by +-20%, so 9 rounds cannot separate a 5%
difference. Rounds are interleaved, so the ratio of two schedules within one round cancels slow spells;
pooling those per-round ratios over runs gives the median, a 95% bootstrap interval of the median, and how
many rounds the first schedule won.

    python benchmarks/pool_runs.py benchmarks/results/bench_schedules*.json
"""
from __future__ import annotations

import argparse
import json
import random
import statistics

PAIRS = [("zbv", "1f1b"), ("zb-h2", "1f1b"), ("zb-h1", "1f1b"), ("interleaved", "1f1b"), ("auto", "1f1b"),
         ("1f1b", "1f1b-fused"), ("zb-h2", "1f1b-fused"), ("zbv", "1f1b-fused"), ("1f1b", "torch-1f1b"),
         ("zbv", "torch-zbv")]


def round_ratios(runs: list[dict], ours: str, base: str, m: int) -> list[float]:
    """ours / base per round, over every run that timed both at this m."""
    out = []
    for run in runs:
        rows = {r["schedule"]: r for r in run["real"] if r["m"] == m and r.get("step_s") is not None}
        if ours in rows and base in rows:
            out += [a / b for a, b in zip(rows[ours]["rounds_s"], rows[base]["rounds_s"])]
    return out


def bootstrap_median(values: list[float], draws: int = 2000, seed: int = 0) -> tuple[float, float]:
    """2.5% and 97.5% quantiles of the median of resamples (with replacement) of `values`."""
    rng = random.Random(seed)
    meds = sorted(statistics.median(rng.choices(values, k=len(values))) for _ in range(draws))
    return meds[int(0.025 * draws)], meds[int(0.975 * draws) - 1]


def pooled(runs: list[dict], pairs=PAIRS) -> list[dict]:
    ms = sorted({r["m"] for run in runs for r in run["real"]})
    rows = []
    for m in ms:
        for ours, base in pairs:
            ratios = round_ratios(runs, ours, base, m)
            if not ratios:
                continue
            low, high = bootstrap_median(ratios)
            rows.append({"m": m, "ours": ours, "base": base, "rounds": len(ratios),
                         "median": statistics.median(ratios), "ci95": [low, high],
                         "wins": sum(r < 1 for r in ratios)})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="+", help="bench_schedules.py JSON files with a real mode")
    args = parser.parse_args()
    runs = [json.load(open(path)) for path in args.runs]
    runs = [run for run in runs if run.get("real")]       # synthetic- or simulated-only files have no rounds
    if not runs:
        parser.error("none of the files has real-mode results (bench_schedules.py --modes real)")
    print(f"{'m':>2} {'schedule / baseline':>26} {'rounds':>6} {'median':>7} {'95% interval':>15} {'wins':>5}")
    for r in pooled(runs):
        print(f"{r['m']:>2} {r['ours'] + ' / ' + r['base']:>26} {r['rounds']:>6} {r['median']:>7.3f} "
              f"{r['ci95'][0]:>7.3f}-{r['ci95'][1]:<7.3f} {r['wins']:>5}")


if __name__ == "__main__":
    main()

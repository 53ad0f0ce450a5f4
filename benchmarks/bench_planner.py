"""How well `llamapipe plan --profile` predicts a training step on this machine (issue 29).

Profiles the benchmark model once (`llamapipe profile` under torchrun with 2 ranks, one thread each, so the
communication figures are measured too), predicts every layout below with `profile_predict.predict` (the
planner's own path, CPU oversubscription included: 4 single-thread ranks on 2 cores compute at half speed),
then runs each layout with pretrain_llama.py (mock data, `benchmarks.launch.torchrun`, one thread per rank)
and takes the median iteration time of the iterations after the first `--skip` (warm-up and the 1F1B
profiling iterations of zb-h2). The profile times CPU passes in the main thread's CPU time (one thread per
rank), so it predicts the step of an otherwise idle machine; on a shared one the measured median also holds
the neighbours' load, so each row also gives predicted / fastest iteration and the 1-minute load average. Writes predicted, measured and their ratio per layout, whether the layout the
planner ranks first is within 5% of the fastest measured, and the load average before and after, to
benchmarks/results/bench_planner.json, and prints the table.

    python -m benchmarks.bench_planner --out benchmarks/results/bench_planner.json
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import tempfile

from benchmarks.launch import read_metrics, torchrun
from benchmarks.results_io import write_json
from llamapipe.tools import profile_schema
from llamapipe.tools.parallel_estimate import Layout
from llamapipe.tools.profile_plan import layout_flags, shape_flags
from llamapipe.tools.profile_predict import balanced_counts, layout_string, predict

MODEL = ["--num-layers", "8", "--hidden-size", "256", "--ffn-hidden-size", "704", "--num-attention-heads", "8",
         "--vocab-size", "8192", "--seq-length", "128", "--max-position-embeddings", "128"]
TRAIN = ["--mock-data", "--lr", "1e-4", "--log-interval", "1", "--eval-iters", "0", "--num-workers", "0"]


def layouts(profile: dict) -> list[tuple[str, Layout]]:
    """The benchmark's layouts (world size <= 4): schedules, recompute, micro-batch sizes, tp/pp/dp."""
    def lay(tp=1, pp=1, dp=1, schedule="1f1b", mbs=1, recompute="none", vpp=1) -> Layout:
        return Layout(tp, pp, vpp, dp, schedule, mbs, recompute, False, precision="fp32")
    rows = [("single", lay()), ("single mbs2", lay(mbs=2)), ("pp2 1f1b", lay(pp=2)),
            ("pp2 1f1b mbs2", lay(pp=2, mbs=2)), ("pp2 1f1b recompute", lay(pp=2, recompute="full")),
            ("pp2 zbv", lay(pp=2, schedule="zbv", vpp=2)), ("pp2 zb-h2", lay(pp=2, schedule="zb-h2")),
            ("pp2 v-half", lay(pp=2, schedule="v-half", vpp=2)), ("dp2", lay(dp=2)), ("tp2", lay(tp=2)),
            ("pp4 1f1b", lay(pp=4)), ("pp2 dp2 1f1b", lay(pp=2, dp=2))]
    for name, base in (("pp2 1f1b balanced", lay(pp=2)), ("pp2 zbv balanced", lay(pp=2, schedule="zbv", vpp=2))):
        balanced = layout_string(balanced_counts(profile, base))
        rows.append((name, dataclasses.replace(base, pipeline_layout=balanced)))
    return rows


def make_profile(path: str, repeats: int) -> dict:
    proc = torchrun(2, ["llamapipe.tools.profile_model", *MODEL, "--micro-batch-size", "1", "2", "--recompute",
                        "none", "full", "--threads", "1", "--repeats", str(repeats), "--out", path],
                    script="-m", timeout=1200)
    if proc.returncode != 0:
        raise SystemExit(f"llamapipe profile failed:\n{proc.stderr[-3000:]}")
    print(proc.stdout)
    return profile_schema.load(path)


def measure(lay: Layout, global_batch: int, iters: int, skip: int) -> dict:
    """Median iteration seconds of one layout after `skip` iterations, and all of them."""
    with tempfile.TemporaryDirectory() as tmp:
        jsonl = os.path.join(tmp, "m.jsonl")
        args = [*MODEL, *TRAIN, *layout_flags(lay), "--global-batch-size", str(global_batch),
                "--train-iters", str(iters), "--metrics-jsonl", jsonl]
        proc = torchrun(lay.tp * lay.pp * lay.dp, args, timeout=1200)
        if proc.returncode != 0:
            return {"error": (proc.stderr.strip().splitlines() or ["?"])[-1]}
        steps = [r["elapsed_ms"] / 1000 for r in read_metrics(jsonl)]
    timed = steps[skip:]
    return {"measured_s": statistics.median(timed), "spread_s": [min(timed), max(timed)], "steps_s": steps,
            "loadavg_1min_after": os.getloadavg()[0]}


def run(args: argparse.Namespace) -> dict:
    load_before = os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as tmp:
        profile = make_profile(os.path.join(tmp, "profile.json"), args.repeats)
    rows = []
    for name, lay in layouts(profile):
        pred = predict(profile, lay, args.global_batch_size)
        row = {"layout": name, "flags": " ".join(layout_flags(lay)), "predicted_s": pred.step_s,
               "predicted_busy_s": list(pred.busy_s), "predicted_bubble": pred.bubble, "slowdown": pred.slowdown,
               **measure(lay, args.global_batch_size, args.iters, args.skip)}
        if "measured_s" in row:
            row["ratio"] = row["predicted_s"] / row["measured_s"]
            row["ratio_to_fastest_iteration"] = row["predicted_s"] / row["spread_s"][0]
        rows.append(row)
        print(f"{name:<20} predicted {row['predicted_s'] * 1e3:8.1f} ms  measured "
              + (f"{row['measured_s'] * 1e3:8.1f} ms  ratio {row['ratio']:.3f}" if "ratio" in row else row["error"]),
              flush=True)
    done = [r for r in rows if "ratio" in r]
    first = min(done, key=lambda r: r["predicted_s"])
    fastest = min(done, key=lambda r: r["measured_s"])
    return {"model": MODEL, "global_batch_size": args.global_batch_size, "iters": args.iters, "skip": args.skip,
            "profile": profile, "rows": rows,
            "within_10pct": sum(abs(r["ratio"] - 1) <= 0.10 for r in done), "layouts": len(rows),
            "first_ranked": first["layout"], "fastest_measured": fastest["layout"],
            "first_over_fastest": first["measured_s"] / fastest["measured_s"],
            "loadavg_before": load_before, "loadavg_after": os.getloadavg()[0]}


def table(result: dict) -> str:
    lines = [f"{'layout':<20} {'predicted ms':>12} {'measured ms':>12} {'ratio':>6}  spread ms  {'/min':>6} load",
             "-" * 80]
    for r in result["rows"]:
        if "ratio" not in r:
            lines.append(f"{r['layout']:<20} {r['predicted_s'] * 1e3:>12.1f}  failed: {r['error']}")
            continue
        lo, hi = (x * 1e3 for x in r["spread_s"])
        lines.append(f"{r['layout']:<20} {r['predicted_s'] * 1e3:>12.1f} {r['measured_s'] * 1e3:>12.1f} "
                     f"{r['ratio']:>6.3f}  {lo:.0f}-{hi:.0f}  {r['ratio_to_fastest_iteration']:>6.3f} "
                     f"{r['loadavg_1min_after']:.1f}")
    lines.append(f"{result['within_10pct']} of {result['layouts']} within 10%; planner's first "
                 f"({result['first_ranked']}) measures {result['first_over_fastest']:.3f}x the fastest "
                 f"({result['fastest_measured']}); load average {result['loadavg_before']:.1f} before, "
                 f"{result['loadavg_after']:.1f} after")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--global-batch-size", type=int, default=8)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--skip", type=int, default=4, help="first iterations left out (warm-up, zb-h2's profiling)")
    p.add_argument("--repeats", type=int, default=20, help="profile repeats per pass")
    p.add_argument("--out", default="benchmarks/results/bench_planner.json")
    args = p.parse_args()
    result = run(args)
    print(table(result))
    write_json(args.out, result)


if __name__ == "__main__":
    main()

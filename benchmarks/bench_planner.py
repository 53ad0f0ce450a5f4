"""How well `llamapipe plan --profile` predicts a training step on this machine (issue 29).

Profiles the benchmark model once (`llamapipe profile` under torchrun with 2 ranks, one thread each, so the
communication figures are measured too), predicts every layout below with `profile_predict.predict` (the
planner's own path, CPU oversubscription included: 4 single-thread ranks on 2 cores compute at half speed),
then runs each layout with pretrain_llama.py (mock data, `benchmarks.launch.torchrun`, one thread per rank)
and takes the median iteration time of the iterations after the first `--skip` (warm-up and the 1F1B
profiling iterations of zb-h2). The profile times CPU passes in the main thread's CPU time (one thread per
rank), so the planner predicts the step of an otherwise idle machine ("idle": ranks beyond the cores share
them). This machine is shared with other work, so around each run `cpu_share` measures the CPU seconds per
second that as many busy single-thread processes as the layout has ranks get (before and after the run,
averaged), and the row's prediction stretches compute by its inverse (`predict(..., cpu_share=)`); both
predictions are recorded, and the prediction without the profile's runtime overhead (`profile_overhead`) for
comparison. The planner's first-ranked layout is the one with the smallest idle prediction.
Writes predicted, measured and their ratio per layout, whether the layout the planner ranks first is within
5% of the fastest measured, and the load average before and after, to
benchmarks/results/bench_planner.json, and prints the table.

    python -m benchmarks.bench_planner --out benchmarks/results/bench_planner.json
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import multiprocessing as mp
import os
import statistics
import tempfile
import time
from typing import Optional

from benchmarks.launch import read_metrics, torchrun
from benchmarks.results_io import write_json
from llamapipe.training import profile_schema
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
            ("pp4 1f1b", lay(pp=4)), ("pp2 dp2 1f1b", lay(pp=2, dp=2)),
            ("pp2 1f1b vocab", dataclasses.replace(lay(pp=2), vocab_parallel=True)),
            ("pp2 zbv vocab", dataclasses.replace(lay(pp=2, schedule="zbv", vpp=2), vocab_parallel=True))]
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


def _spin(seconds: float, out) -> None:
    wall, cpu, x = time.perf_counter(), time.thread_time(), 0
    while time.perf_counter() - wall < seconds:
        x += 1
    out.put((time.thread_time() - cpu) / (time.perf_counter() - wall))


def cpu_share(ranks: int, seconds: float = 2.0) -> float:
    """CPU seconds per second that each of `ranks` busy single-thread processes gets on this machine now: 1 on
    an idle machine with enough cores, cores / ranks when they oversubscribe it, less under others' load."""
    ctx = mp.get_context("fork")
    out = ctx.Queue()
    procs = [ctx.Process(target=_spin, args=(seconds, out)) for _ in range(ranks)]
    for proc in procs:
        proc.start()
    shares = [out.get(timeout=60) for _ in procs]
    for proc in procs:
        proc.join()
    return statistics.mean(shares)


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


def wait_for_load(limit: float | None, patience_s: float) -> float:
    """Wait (at most `patience_s`) until the 1-minute load average is at most `limit`; returns the load then."""
    deadline = time.monotonic() + patience_s
    while limit is not None and os.getloadavg()[0] > limit and time.monotonic() < deadline:
        time.sleep(5)
    return os.getloadavg()[0]


def selected(profile: dict, names: Optional[str]) -> list[tuple[str, Layout]]:
    """The benchmark's layouts, or those named in `names` (comma-separated), in the benchmark's order."""
    rows = layouts(profile)
    if names is None:
        return rows
    wanted = [n.strip() for n in names.split(",") if n.strip()]
    unknown = [n for n in wanted if n not in dict(rows)]
    if unknown:
        raise SystemExit(f"--layouts: unknown {', '.join(unknown)}; the layouts are {', '.join(n for n, _ in rows)}")
    return [(n, lay) for n, lay in rows if n in wanted]


def measure_rounds(chosen: list[tuple[str, Layout]], args: argparse.Namespace) -> dict[str, dict]:
    """Each layout measured `args.rounds` times, the layouts in turn within each round (paired rounds: a load
    change hits every layout alike); per layout the median over rounds of each round's median, the spread of
    those, every step, and the mean CPU share bracketing its runs."""
    runs: dict[str, list[dict]] = {name: [] for name, _ in chosen}
    for round_ in range(args.rounds):
        for name, lay in chosen:
            ranks = lay.tp * lay.pp * lay.dp
            load_at_start = wait_for_load(args.wait_for_load, args.patience)
            share_before = cpu_share(ranks)
            run = measure(lay, args.global_batch_size, args.iters, args.skip)
            run.update(cpu_share=(share_before + cpu_share(ranks)) / 2, loadavg_1min_at_start=load_at_start)
            runs[name].append(run)
            print(f"round {round_ + 1}/{args.rounds} {name:<20} " + (
                f"{run['measured_s'] * 1e3:8.1f} ms, cpu share {run['cpu_share']:.2f}" if "measured_s" in run
                else run["error"]), flush=True)
    out = {}
    for name, done in runs.items():
        ok = [r for r in done if "measured_s" in r]
        if not ok:
            out[name] = {"error": done[-1]["error"]}
            continue
        medians = [r["measured_s"] for r in ok]
        out[name] = {"measured_s": statistics.median(medians), "spread_s": [min(medians), max(medians)],
                     "round_medians_s": medians, "steps_s": [s for r in ok for s in r["steps_s"]],
                     "cpu_share": statistics.mean(r["cpu_share"] for r in ok),
                     "loadavg_1min_at_start": statistics.mean(r["loadavg_1min_at_start"] for r in ok),
                     "loadavg_1min_after": ok[-1]["loadavg_1min_after"]}
    return out


def predicted_rows(profile: dict, chosen: list[tuple[str, Layout]], measured: dict[str, dict],
                   global_batch: int) -> list[dict]:
    """Per layout: the idle prediction (an otherwise idle machine), the one at its measured CPU share, the one
    without the runtime overhead, and their ratios to the measured median."""
    bare = {**profile, "overhead": None}        # the prediction without the runtime overhead, for comparison
    rows = []
    for name, lay in chosen:
        idle = predict(profile, lay, global_batch)
        row = {"layout": name, "flags": " ".join(layout_flags(lay)), "predicted_idle_s": idle.step_s,
               "predicted_busy_s": list(idle.busy_s), "predicted_bubble": idle.bubble, **measured[name]}
        if "measured_s" in row:
            shared = predict(profile, lay, global_batch, cpu_share=row["cpu_share"])
            row["predicted_s"], row["predicted_overhead_s"] = shared.step_s, shared.overhead_s
            row["predicted_without_overhead_s"] = predict(bare, lay, global_batch,
                                                          cpu_share=row["cpu_share"]).step_s
            row["ratio"] = row["predicted_s"] / row["measured_s"]
            row["ratio_idle"] = row["predicted_idle_s"] / row["measured_s"]
            row["ratio_without_overhead"] = row["predicted_without_overhead_s"] / row["measured_s"]
        rows.append(row)
    return rows


def summary(rows: list[dict]) -> dict:
    """How many predictions are within 10%, and the planner's first-ranked layout (smallest idle prediction)
    against the fastest measured."""
    done = [r for r in rows if "ratio" in r]
    first = min(done, key=lambda r: r["predicted_idle_s"])
    fastest = min(done, key=lambda r: r["measured_s"])
    return {"within_10pct": sum(abs(r["ratio"] - 1) <= 0.10 for r in done), "layouts": len(rows),
            "within_10pct_without_overhead": sum(abs(r["ratio_without_overhead"] - 1) <= 0.10 for r in done),
            "first_ranked": first["layout"], "fastest_measured": fastest["layout"],
            "first_over_fastest": first["measured_s"] / fastest["measured_s"]}


def load_profile(path: str) -> dict:
    """A profile file, or the profile a stored bench_planner result was measured with."""
    with open(path) as f:
        stored = json.load(f)
    return profile_schema.validate(stored.get("profile", stored), f"--profile {path}")


def run(args: argparse.Namespace) -> dict:
    load_before = os.getloadavg()[0]
    if args.profile:
        profile = load_profile(args.profile)
    else:
        with tempfile.TemporaryDirectory() as tmp:
            profile = make_profile(os.path.join(tmp, "profile.json"), args.repeats)
    chosen = selected(profile, args.layouts)
    rows = predicted_rows(profile, chosen, measure_rounds(chosen, args), args.global_batch_size)
    return {"model": MODEL, "global_batch_size": args.global_batch_size, "iters": args.iters, "skip": args.skip,
            "rounds": args.rounds, "profile": profile, "rows": rows, **summary(rows),
            "loadavg_before": load_before, "loadavg_after": os.getloadavg()[0]}


def replay(path: str) -> dict:
    """A stored result with its predictions made again by today's model from its own profile and CPU shares
    (nothing is run): how a change to the model would have scored on the measurements already taken."""
    with open(path) as f:
        stored = json.load(f)
    profile, chosen = stored["profile"], layouts(stored["profile"])
    by_name = {r["layout"]: r for r in stored["rows"]}
    chosen = [(n, lay) for n, lay in chosen if n in by_name]
    keep = ("measured_s", "spread_s", "round_medians_s", "steps_s", "cpu_share", "loadavg_1min_at_start",
            "loadavg_1min_after", "error")
    measured = {n: {k: by_name[n][k] for k in keep if k in by_name[n]} for n, _ in chosen}
    rows = predicted_rows(profile, chosen, measured, stored["global_batch_size"])
    return {**stored, "rows": rows, **summary(rows), "replayed_from": path}


def table(result: dict) -> str:
    lines = [f"{'layout':<20} {'idle ms':>8} {'share':>5} {'predicted ms':>12} {'measured ms':>12} {'ratio':>6}  "
             "spread ms", "-" * 78]
    for r in result["rows"]:
        if "ratio" not in r:
            lines.append(f"{r['layout']:<20} {r['predicted_idle_s'] * 1e3:>8.1f}  failed: {r['error']}")
            continue
        lo, hi = (x * 1e3 for x in r["spread_s"])
        lines.append(f"{r['layout']:<20} {r['predicted_idle_s'] * 1e3:>8.1f} {r['cpu_share']:>5.2f} "
                     f"{r['predicted_s'] * 1e3:>12.1f} {r['measured_s'] * 1e3:>12.1f} {r['ratio']:>6.3f}  "
                     f"{lo:.0f}-{hi:.0f}")
    lines.append(f"{result['within_10pct']} of {result['layouts']} within 10% "
                 f"({result['within_10pct_without_overhead']} without the overhead "
                 f"terms); planner's first "
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
    p.add_argument("--profile", default=None,
                   help="use this profile (or a stored result's, e.g. benchmarks/results/bench_planner.json) instead "
                        "of profiling first")
    p.add_argument("--layouts", default=None, help="comma-separated layout names to run (default: all)")
    p.add_argument("--rounds", type=int, default=1, help="paired rounds: every layout measured once per round")
    p.add_argument("--replay", default=None, metavar="RESULT.json",
                   help="run nothing: predict a stored result's layouts again with today's model and print the table")
    p.add_argument("--out", default=None, help="JSON to write (default: benchmarks/results/bench_planner.json; "
                                               "with --replay nothing unless given)")
    p.add_argument("--wait-for-load", type=float, default=None,
                   help="before each layout, wait until the 1-minute load average is at most this")
    p.add_argument("--patience", type=float, default=90.0, help="seconds to wait for --wait-for-load at most")
    p.add_argument("--autogroup-nice", type=int, default=None,
                   help="set this session's scheduler autogroup nice value first (Linux, /proc/self/autogroup; "
                        "negative needs root): on a machine shared with other sessions' work, a negative value lets "
                        "the measured runs approach the idle machine the profile predicts; recorded in the result")
    args = p.parse_args()
    if args.replay:
        result = replay(args.replay)
        print(table(result))
        if args.out:
            write_json(args.out, result)
        return
    if args.autogroup_nice is not None:
        with open("/proc/self/autogroup", "w") as f:
            f.write(str(args.autogroup_nice))
    result = run(args)
    result["autogroup_nice"] = args.autogroup_nice
    print(table(result))
    write_json(args.out or "benchmarks/results/bench_planner.json", result)


if __name__ == "__main__":
    main()

"""--pipeline-trace through the CLI at p = 2 and p = 4: one merged Chrome trace that follows the trace-event
format (what Perfetto and chrome://tracing load), holds every planned action of the traced iterations once per
rank, draws an arrow from each send to its receive, leaves the losses alone, and `llamapipe plot-trace` draws."""
from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest

from llamapipe.core.pipeline_parallel.schedule_ir import Plan
from tests.cli import ROOT, TINY, read_metrics, torchrun, train

ITERS = ["--train-iters", "4", "--micro-batch-size", "1", "--global-batch-size", "8"]
WINDOW = ["--profile-step-start", "1", "--profile-step-end", "3"]
CASES = {
    "p2-zbv": (2, ["--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage", "2",
                   "--pipeline-schedule", "zbv"]),
    "p4-1f1b-timers": (4, ["--pipeline-model-parallel-size", "4", "--timing-log-level", "1"]),
}
PHASES = {"X", "M", "s", "f"}


def check_chrome_trace(trace: dict) -> None:
    """The JSON Object Format of the Trace Event Format: `traceEvents`, each event with the keys its phase needs
    (complete events X: name, ts, dur >= 0, pid, tid; metadata M: a name and its args; flow s/f: an id and a
    category, each id started once and finished once, never before it started)."""
    assert isinstance(trace["traceEvents"], list) and trace.get("displayTimeUnit") in ("ms", "ns")
    starts, finishes = {}, {}
    for e in trace["traceEvents"]:
        assert e["ph"] in PHASES, e
        assert isinstance(e["pid"], int) and isinstance(e["name"], str), e
        if e["ph"] == "X":
            assert isinstance(e["tid"], int) and e["ts"] >= 0 and e["dur"] >= 0, e
        elif e["ph"] == "M":
            assert e["name"] in ("process_name", "process_sort_index", "thread_name") and e["args"], e
        else:
            assert isinstance(e["id"], int) and e["cat"] == "message" and e["ts"] >= 0, e
            (starts if e["ph"] == "s" else finishes).setdefault(e["id"], []).append(e)
    assert starts.keys() == finishes.keys() and starts, "every arrow has both ends"
    for ident, [s] in starts.items():
        [f] = finishes[ident]
        assert f["bp"] == "e" and s["pid"] != f["pid"], (s, f)
        # the ranks' clocks are aligned NTP-style, good to half the shortest of 32 round trips: on two cores that
        # two test workers' ranks share, up to about a millisecond
        assert f["ts"] >= s["ts"] - 1000.0, f"a message received {s['ts'] - f['ts']:.0f} us before it was sent"


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    return [r["lm_loss"] for r in train(1, ITERS, str(tmp_path_factory.mktemp("ref") / "m.jsonl"))]


@pytest.mark.parametrize("case", sorted(CASES))
def test_the_merged_trace_is_a_chrome_trace_of_every_action(case, reference, tmp_path):
    nproc, flags = CASES[case]
    path, jsonl = tmp_path / "trace.json", str(tmp_path / "m.jsonl")
    proc = torchrun(nproc, TINY + ITERS + flags + WINDOW + ["--pipeline-trace", str(path), "--metrics-jsonl", jsonl])
    assert proc.returncode == 0, proc.stderr[-3000:]
    for it, (got, want) in enumerate(zip((r["lm_loss"] for r in read_metrics(jsonl)), reference), 1):
        assert math.isclose(got, want, rel_tol=1e-5), f"iteration {it}: {got} vs {want}"
    trace = json.loads(path.read_text())
    check_chrome_trace(trace)
    data = trace["otherData"]["llamapipe"]
    assert data["iterations"] == [2, 3] and len(data["steps"]) == nproc
    names = {e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "process_name"}
    assert names == {f"rank {r} (pp {r})" for r in range(nproc)}
    for rank, info in data["steps"].items():
        assert [s["iteration"] for s in info["steps"]] == [2, 3]
        plan = Plan.from_json(data["plans"][info["steps"][0]["plan"]])
        for iteration in (2, 3):
            ran = sorted((e["args"]["kind"], e["args"]["chunk"], e["args"]["mb"]) for e in trace["traceEvents"]
                         if e["ph"] == "X" and e["pid"] == int(rank) and e["args"].get("iteration") == iteration
                         and "kind" in e["args"])
            assert ran == sorted(tuple(a) for a in plan.actions[info["pp_rank"]]), (rank, iteration)
    drawn = subprocess.run([sys.executable, "-m", "llamapipe", "plot-trace", str(path), "--top", "3"], cwd=ROOT,
                           capture_output=True, text=True, timeout=120)
    assert drawn.returncode == 0, drawn.stderr
    assert "measured step" in drawn.stdout and drawn.stdout.count(" excess ") == 3
    assert (tmp_path / "trace.png").stat().st_size > 10_000


def test_a_window_that_traces_nothing_is_refused_in_one_line(tmp_path):
    proc = subprocess.run([sys.executable, "pretrain_llama.py", *TINY, *ITERS, "--pipeline-trace",
                           str(tmp_path / "t.json"), "--profile-step-start", "3", "--profile-step-end", "3"],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "--pipeline-trace needs 0 <= --profile-step-start < --profile-step-end" in proc.stderr
    assert not (tmp_path / "t.json").exists()


def test_a_window_after_the_run_ends_is_refused_in_one_line(tmp_path):
    """The default window (iterations 11-12) on a 4-iteration run: refused up front, not an empty file."""
    proc = subprocess.run([sys.executable, "pretrain_llama.py", *TINY, *ITERS, "--pipeline-trace",
                           str(tmp_path / "t.json")], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert ("--pipeline-trace: --profile-step-start 10 and --profile-step-end 12 trace iterations 11-12, but the "
            "run ends at iteration 4; set --profile-step-start 2 --profile-step-end 4") in proc.stderr
    assert not (tmp_path / "t.json").exists()


def test_a_run_that_ends_inside_the_window_traces_its_last_iterations(tmp_path):
    path = tmp_path / "t.json"
    proc = subprocess.run([sys.executable, "pretrain_llama.py", *TINY, "--train-iters", "3", "--micro-batch-size",
                           "1", "--global-batch-size", "2", "--pipeline-trace", str(path), "--profile-step-start",
                           "1", "--profile-step-end", "5"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0 and "Traceback" not in out, out[-3000:]
    assert "--pipeline-trace traces iterations 2-3" in out
    assert "pipeline trace: iterations 2-3 of 1 ranks (" in out and "(0 actions)" not in out
    trace = json.loads(path.read_text())
    assert trace["otherData"]["llamapipe"]["iterations"] == [2, 3]
    ran = {e["args"]["iteration"] for e in trace["traceEvents"] if e["ph"] == "X" and "kind" in e.get("args", {})}
    assert ran == {2, 3}


def test_a_link_at_the_trace_path_is_refused_and_its_target_untouched(tmp_path):
    victim = tmp_path / "victim.txt"
    victim.write_text("keep")
    (tmp_path / "t.json").symlink_to(victim)
    proc = subprocess.run([sys.executable, "pretrain_llama.py", *TINY, *ITERS, "--pipeline-trace",
                           str(tmp_path / "t.json")], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "--pipeline-trace: " in proc.stderr and "is a symbolic link" in proc.stderr
    assert victim.read_text() == "keep"

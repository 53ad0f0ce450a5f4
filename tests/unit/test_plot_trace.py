"""`llamapipe plot-trace` on traces made here: the costs it fits, the waits it reports, its one-line errors."""
from __future__ import annotations

import json

import pytest

from llamapipe.core.pipeline_parallel.builders import one_f_one_b
from llamapipe.core.pipeline_parallel.simulator import Costs, simulate
from llamapipe.tools import plot_trace
from llamapipe.training.trace_log import chrome_trace


def _trace_of(plan, timeline, iteration=3) -> dict:
    """The trace --pipeline-trace would write for one iteration of `plan` run exactly as `timeline` says."""
    key = "p"
    payloads = []
    for rank, row in enumerate(timeline):
        events = [{"ph": "X", "pid": rank, "tid": 0, "name": "", "ts": s * 1e6, "dur": (e - s) * 1e6,
                   "args": {"kind": a.kind, "chunk": a.chunk, "mb": a.microbatch, "iteration": iteration}}
                  for s, e, a in row]
        # a BW that sends does so after its B (3 of its 4 ms here): the arrow's start inside the action
        events += [{"ph": "s", "pid": rank, "tid": 0, "name": "grad", "cat": "message", "id": i, "ts": (s + 0.003) * 1e6}
                   for i, (s, e, a) in enumerate(row) if a.kind == "BW" and rank > 0]
        payloads.append({"rank": rank, "pp_rank": rank, "name": f"rank {rank} (pp {rank})", "events": events,
                         "plans": {key: plan.to_json()}, "steps": [{"iteration": iteration, "plan": key}]})
    return chrome_trace(payloads, plan.name, iteration - 1, iteration)


def test_a_run_that_follows_its_plan_is_fitted_exactly_and_waits_no_more_than_planned(tmp_path):
    plan, costs = one_f_one_b(2, 4), Costs(f=0.002, b=0.003, w=0.001)
    sim = simulate(plan, costs)
    path = tmp_path / "t.json"
    path.write_text(json.dumps(_trace_of(plan, sim.timeline)))
    data = plot_trace.load(str(path))
    iteration, got_plan, ranks, _ = plot_trace.pipeline(data, None)
    assert (iteration, got_plan, ranks) == (3, plan, {0: 0, 1: 1})
    timeline = plot_trace.measured_timeline(data, plan, ranks, iteration)
    fitted = plot_trace.mean_costs(plan, timeline, plot_trace.b_share_of_bw(data, iteration))
    assert (fitted.f, fitted.b, fitted.w) == pytest.approx((costs.f, costs.b, costs.w))
    waits = plot_trace.excess_waits(plan, timeline, simulate(plan, fitted).timeline)
    assert len(waits) == sum(map(len, plan.actions)) and max(abs(w["excess_ms"]) for w in waits) < 1e-6


def test_a_late_action_tops_the_list(tmp_path):
    plan, costs = one_f_one_b(2, 4), Costs(f=0.002, b=0.003, w=0.001)
    timeline = [list(row) for row in simulate(plan, costs).timeline]
    s, e, a = timeline[1][3]          # rank 1 waits 5 ms more before its fourth action, and so does all after it
    timeline[1] = timeline[1][:3] + [(s + 0.005, e + 0.005, a)] + [(x + 0.005, y + 0.005, b) for x, y, b in timeline[1][4:]]
    path = tmp_path / "t.json"
    path.write_text(json.dumps(_trace_of(plan, timeline)))
    assert plot_trace.main([str(path), "--top", "1", "--out", str(tmp_path / "t.png")]) == 0
    data = plot_trace.load(str(path))
    measured = plot_trace.measured_timeline(data, plan, {0: 0, 1: 1}, 3)
    fitted = plot_trace.mean_costs(plan, measured, plot_trace.b_share_of_bw(data, 3))
    top = plot_trace.excess_waits(plan, measured, simulate(plan, fitted).timeline)[0]
    assert top["pp_rank"] == 1 and top["action"] == f"{a.kind}{a.chunk}.{a.microbatch}"
    assert top["excess_ms"] == pytest.approx(5.0, abs=0.5)


def test_files_that_are_not_traces_are_refused_in_one_line(tmp_path, capsys):
    bad = tmp_path / "bad.json"
    bad.write_text('{"traceEvents": []}')
    assert plot_trace.main([str(bad)]) == 2
    assert "is not a trace written by --pipeline-trace" in capsys.readouterr().err
    bad.write_text("{")
    assert plot_trace.main([str(bad)]) == 2
    assert "cannot read a JSON trace" in capsys.readouterr().err
    good = tmp_path / "t.json"
    good.write_text(json.dumps(_trace_of(one_f_one_b(2, 2), simulate(one_f_one_b(2, 2)).timeline)))
    assert plot_trace.main([str(good), "--iteration", "7"]) == 2
    assert "--iteration 7 is not in the trace; it holds 3" in capsys.readouterr().err

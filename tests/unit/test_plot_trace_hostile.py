"""`llamapipe plot-trace` on hostile input (issue 51): every refusal one line naming the file, nothing written
through a link, no blocking on a FIFO, no traceback; its bubble figure is the training log's."""
from __future__ import annotations

import json
import os
import stat

import pytest

from llamapipe.core.pipeline_parallel.builders import one_f_one_b
from llamapipe.core.pipeline_parallel.simulator import Costs, simulate
from llamapipe.core.pipeline_parallel.step_timers import bubble
from llamapipe.tools import plot_trace, trace_file
from tests.unit.test_plot_trace import _trace_of


def _good() -> dict:
    plan = one_f_one_b(2, 4)
    return _trace_of(plan, simulate(plan, Costs(f=0.002, b=0.003, w=0.001)).timeline)


def _refused(tmp_path, capsys, trace, *extra) -> str:
    path = tmp_path / "t.json"
    path.write_text(trace if isinstance(trace, str) else json.dumps(trace))
    assert plot_trace.main([str(path), "--out", str(tmp_path / "t.png"), *extra]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err and str(path) in err, err
    assert not (tmp_path / "t.png").exists()
    return err


def _edit(change) -> dict:
    trace = _good()
    change(trace)
    return trace


def _events(trace) -> list:
    return [e for e in trace["traceEvents"] if e.get("ph") == "X"]


@pytest.mark.parametrize("change, says", [
    (lambda t: t["otherData"]["llamapipe"]["plans"]["p"].update(pp=10 ** 9), "pp 1000000000"),
    (lambda t: _events(t)[0].update(ts=float("nan")), "finite numbers"),
    (lambda t: _events(t)[0]["args"].update(mb="nope"), "integer chunk"),
    (lambda t: _events(t)[0]["args"].update(kind="nope"), "kind of"),
    (lambda t: t["otherData"]["llamapipe"].update(steps=[1, 2]), "must be objects"),
    (lambda t: t["otherData"]["llamapipe"]["steps"]["0"].update(steps="x"), "steps (a list)"),
    (lambda t: t["otherData"]["llamapipe"]["steps"]["0"]["steps"][0].update(iteration="3"), "integer iteration"),
    (lambda t: t.update(traceEvents="not a list"), "traceEvents must be a list"),
    (lambda t: _events(t)[0]["args"].update(chunk=5), "outside its plan"),
])
def test_hostile_fields_are_refused_in_one_line_naming_the_file(tmp_path, capsys, change, says):
    assert says in _refused(tmp_path, capsys, _edit(change))


def test_deep_nesting_and_non_utf8_are_refused(tmp_path, capsys):
    assert "nested too deeply" in _refused(tmp_path, capsys, "[" * 100_000 + "]" * 100_000)
    path = tmp_path / "b.json"
    path.write_bytes(b"\xff\xfe{")
    assert plot_trace.main([str(path), "--out", str(tmp_path / "b.png")]) == 2
    assert str(path) in capsys.readouterr().err


def test_a_file_over_the_size_limit_is_refused_before_it_is_read(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(trace_file, "MAX_TRACE_BYTES", 100)
    assert "over the limit of" in _refused(tmp_path, capsys, _good())


def test_a_fifo_as_the_trace_is_refused_without_blocking(tmp_path, capsys):
    fifo = tmp_path / "t.json"
    os.mkfifo(fifo)
    assert plot_trace.main([str(fifo), "--out", str(tmp_path / "t.png")]) == 2
    assert f"trace {fifo} is a FIFO (named pipe), not a regular file" in capsys.readouterr().err


def _write_good(tmp_path) -> str:
    path = tmp_path / "t.json"
    path.write_text(json.dumps(_good()))
    return str(path)


def test_out_through_a_link_is_refused_and_its_target_untouched(tmp_path, capsys):
    trace = _write_good(tmp_path)
    victim, link, dangling = tmp_path / "victim.png", tmp_path / "link.png", tmp_path / "dangling.png"
    victim.write_text("keep")
    link.symlink_to(victim)
    dangling.symlink_to(tmp_path / "created.png")
    for out in (link, dangling):
        assert plot_trace.main([trace, "--out", str(out)]) == 2
        assert "is a symbolic link" in capsys.readouterr().err
    assert victim.read_text() == "keep" and not (tmp_path / "created.png").exists()


def test_out_in_a_missing_read_only_or_directory_place_is_refused(tmp_path, capsys):
    trace = _write_good(tmp_path)
    (tmp_path / "dir.png").mkdir()
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(stat.S_IRUSR | stat.S_IXUSR)
    try:
        cases = [(tmp_path / "missing" / "t.png", "does not exist"), (tmp_path / "dir.png", "a directory")]
        cases += [(ro / "t.png", "not writable")] if os.geteuid() != 0 else []     # root writes anywhere
        for out, says in cases:
            assert plot_trace.main([trace, "--out", str(out)]) == 2
            err = capsys.readouterr().err
            assert says in err and err.count("\n") == 1, err
    finally:
        ro.chmod(stat.S_IRWXU)


def test_the_bubble_printed_is_the_training_logs_bubble_of_the_same_data(tmp_path, capsys):
    plan, costs = one_f_one_b(2, 4), Costs(f=0.002, b=0.003, w=0.001, head_f=0.004)
    timeline = simulate(plan, costs).timeline
    trace = _trace_of(plan, timeline)
    # rank 1 posts a receive for 1 ms on its communication track (counted as communication by the timers)
    trace["traceEvents"].append({"ph": "X", "pid": 1, "tid": 2, "name": "post recv", "ts": 0.0, "dur": 1000.0,
                                 "args": {}})
    path = tmp_path / "t.json"
    path.write_text(json.dumps(trace))
    assert plot_trace.main([str(path), "--out", str(tmp_path / "t.png")]) == 0
    printed = capsys.readouterr().out
    makespan = max(e for row in timeline for _, e, _ in row)
    # what timers_log logs: per rank step_timers.bubble of its interval, idle = iteration - compute - communication
    communication = [0.0, 0.001]
    logged = [bubble({"iteration": makespan, "idle": makespan - sum(e - s for s, e, _ in row) - comm})
              for row, comm in zip(timeline, communication)]
    worst = max(range(2), key=lambda r: logged[r])
    mean = 100 * sum(logged) / 2
    assert f"bubble {100 * logged[worst]:.1f}% max (pp rank {worst}), {mean:.1f}% mean" in printed, printed
    assert printed.count("%") == 2 and "paper's" not in printed and "idle in picture" not in printed


def test_b_share_of_bw_finds_each_bws_first_send(tmp_path):
    data = {"events": [{"ph": "X", "pid": 0, "ts": 10.0 * i, "dur": 4.0,
                        "args": {"kind": "BW", "iteration": 1, "chunk": 0, "mb": i}} for i in range(1000)],
            "sends": {0: sorted([10.0 * i + 3.0 for i in range(1000)] + [10.0 * i + 3.5 for i in range(1000)])}}
    assert plot_trace.b_share_of_bw(data, 1) == pytest.approx(0.75)

"""Timeline drawing (ASCII, PNG, SVG) and `llamapipe plot-schedule`."""
import json
import os
import subprocess
import sys

import pytest

from llamapipe.core.config import SCHEDULES
from llamapipe.core.pipeline_parallel.builders import one_f_one_b, zbv
from llamapipe.core.pipeline_parallel.schedule_specs import build
from llamapipe.core.pipeline_parallel.simulator import Costs, simulate
from llamapipe.core.pipeline_parallel.visualize import ascii_timeline, bubble_text, plot_timeline, rank_table
from llamapipe.tools import plot_schedule
from tests.harness import ROOT


def test_ascii_timeline_of_1f1b_by_hand():
    """p=2, m=2, unit costs: rank 1 runs F0 [1,2] BW0 [2,4] F1 [4,5] BW1 [5,7]; each BW sends its gradient
    after its B part, so rank 0 runs BW0 [3,5] and BW1 [6,8]."""
    plan = one_f_one_b(2, 2)
    assert ascii_timeline(plan, simulate(plan)).splitlines() == [
        "rank 0: F0  F1  ... BW0 === ... BW1 ===",
        "rank 1: ... F0  BW0 === F1  BW1 === ...",
    ]


def _table_rows(text):
    """rank_table's rows as {rank: [busy, idle in span, span, idle at ends, makespan, (peak mem)]}."""
    return {line.split()[0]: [float(v) for v in line.split()[1:]] for line in text.splitlines()[1:]}


@pytest.mark.parametrize("name,vpp,costs", [("1f1b", 1, Costs()), ("zbv", 2, Costs(0.5, 0.5, 0.5)),
                                            ("auto", 1, Costs(1, 1.5, 0.8, 0.1)), ("zb-h2", 1, Costs())])
def test_rank_table_columns_add_up(name, vpp, costs):
    """busy + idle in span = span and span + idle at ends = makespan on every rank; the 'all' row sums
    the ranks, and its idle columns over ranks x makespan are the picture's idle share."""
    plan = build(name, 4, vpp, 8, costs=costs)
    result = simulate(plan, costs)
    rows = _table_rows(rank_table(plan, result))
    assert len(rows) == 5
    for rank in range(4):
        busy, inside, span, ends, makespan, peak = rows[str(rank)]
        assert busy + inside == pytest.approx(span, abs=0.011)
        assert span + ends == pytest.approx(makespan, abs=0.011)
        assert makespan == pytest.approx(result.makespan, abs=0.005) and peak == pytest.approx(
            result.peak_memory[rank], abs=0.005)
    busy, inside, span, ends, total = rows["all"]
    assert total == pytest.approx(4 * result.makespan, abs=0.005)
    assert (inside + ends) / total == pytest.approx(result.makespan_bubble_rate, abs=1e-3)


def test_bubble_text_names_both_figures():
    """1F1B at p=4, m=8 idles 20% of the picture; ZB-V idles only its ramps (5.9%) while the paper's
    per-stage rate is 0: both numbers appear, each with its name."""
    plan = zbv(4, 8)
    text = bubble_text(simulate(plan, Costs(0.5, 0.5, 0.5)))
    assert text.startswith("idle in picture 5.9% (idle rank-time / (ranks x makespan))")
    assert "paper's bubble rate 0.0% (per stage" in text


@pytest.mark.parametrize("suffix,magic", [(".png", b"\x89PNG"), (".svg", b"<?xml")])
def test_plot_writes_small_picture(tmp_path, suffix, magic):
    plan = zbv(2, 4)
    path = tmp_path / f"t{suffix}"
    plot_timeline(plan, simulate(plan), str(path))
    data = path.read_bytes()
    assert data.startswith(magic) and len(data) < 200_000
    if suffix == ".svg":
        assert b"<svg" in data


def test_script_writes_a_png_for_every_schedule(tmp_path, capsys):
    main = plot_schedule.main
    for name in SCHEDULES:
        out = tmp_path / f"{name}.png"
        assert main(["--schedule", name, "--pp", "2", "--microbatches", "3", "--out", str(out)]) == 0
        assert out.read_bytes().startswith(b"\x89PNG")
        text = capsys.readouterr().out
        assert "rank 1:" in text and "makespan" in text and "bubble rate" in text


def test_script_json_from_repo_root(tmp_path):
    out = subprocess.run([sys.executable, "-m", "llamapipe", "plot-schedule", "--schedule", "1f1b", "--pp", "4",
                          "--microbatches", "8", "--out", str(tmp_path / "t.svg"), "--json"],
                         cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    assert set(data) == {"schedule", "pp", "vpp", "microbatches", "makespan", "bubble_rate",
                         "makespan_bubble_rate", "peak_activation_memory"}
    assert data["makespan"] == 30 and data["bubble_rate"] == pytest.approx(6 / 30)   # 33 and 9/33 fused
    assert data["peak_activation_memory"] == [4, 3, 2, 1]


def test_script_writes_under_runs_by_default(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert plot_schedule.main(["--schedule", "zb-h1", "--pp", "2", "--microbatches", "4"]) == 0
    assert os.listdir(tmp_path) == ["runs"]
    assert (tmp_path / "runs" / "schedule_zb-h1.png").read_bytes().startswith(b"\x89PNG")
    assert "wrote runs/schedule_zb-h1.png" in capsys.readouterr().out


@pytest.mark.parametrize("argv,message", [
    (["--schedule", "zbv", "--pp", "4", "--vpp", "3", "--microbatches", "8"], "exactly 2"),
    (["--schedule", "auto", "--pp", "4", "--microbatches", "8", "--costs", "1,x,1"], "--costs 1,x,1"),
    (["--schedule", "auto", "--pp", "4", "--microbatches", "8", "--mem-limit", "0.5"], "memory-limit 0.5"),
    (["--schedule", "1f1b", "--pp", "4", "--microbatches", "8", "--out", "t.gif"], ".png or .svg"),
    (["--schedule", "nope", "--pp", "4", "--microbatches", "8"], "invalid choice"),
])
def test_script_bad_input_is_one_line_and_exit_2(argv, message, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as exc:
        sys.exit(plot_schedule.main(argv))
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and message in err


@pytest.mark.parametrize("name", ["1f1b", "interleaved", "zb-h1", "zb-h2", "zbv", "auto"])
def test_committed_figures_are_small_pngs(name):
    path = os.path.join(ROOT, "docs", f"schedule_{name}.png")
    with open(path, "rb") as f:
        data = f.read()
    assert data.startswith(b"\x89PNG") and len(data) < 100_000

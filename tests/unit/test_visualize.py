"""Timeline drawing (ASCII, PNG, SVG) and `llamapipe plot-schedule`."""
import json
import os
import subprocess
import sys

import pytest

from llamapipe.core.pipeline_parallel.builders import one_f_one_b, zbv
from llamapipe.core.pipeline_parallel.schedule_specs import SCHEDULES, build
from llamapipe.core.pipeline_parallel.simulator import Costs, simulate
from llamapipe.core.pipeline_parallel.simulator_iterations import simulate_iterations
from llamapipe.core.pipeline_parallel.visualize import (
    ascii_timeline,
    bubble_text,
    rank_table,
    timeline_figure,
)
from llamapipe.tools import plot_schedule
from llamapipe.tools.plot_schedule import plot_timeline
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
    (["--schedule", "nope", "--pp", "4", "--microbatches", "8"], "nope is not a schedule; choose one of"),
])
def test_script_bad_input_is_one_line_and_exit_2(argv, message, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as exc:
        sys.exit(plot_schedule.main(argv))
    assert exc.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    from_argparse = "is not a schedule" in message   # argparse's errors come after the one-line usage
    assert len(lines) == 1 + from_argparse and message in lines[-1], lines
    assert not from_argparse or lines[0].startswith("usage: llamapipe plot-schedule [flags]")


@pytest.mark.parametrize("name", ["1f1b", "interleaved", "zb-h1", "zb-h2", "zbv", "auto"])
def test_committed_figures_are_small_pngs(name):
    path = os.path.join(ROOT, "docs", f"schedule_{name}.png")
    with open(path, "rb") as f:
        data = f.read()
    assert data.startswith(b"\x89PNG") and len(data) < 100_000


def _drawn(fig):
    """Lay the figure out on an Agg canvas (as savefig does) and return its axes and renderer."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    canvas = FigureCanvasAgg(fig)
    canvas.draw()
    return fig.axes[0], canvas.get_renderer()


@pytest.mark.parametrize("m,labelled", [(8, True), (64, False)])
def test_artists_grow_with_looks_not_actions(m, labelled):
    """ZB-H1 at p = 4 has three looks (F, B, W): three collections whatever m is, no per-action patch;
    at m = 8 every box has room for its number, at m = 64 (boxes a few points wide) none has."""
    plan = build("zb-h1", 4, 1, m)
    ax, _ = _drawn(timeline_figure(plan, simulate(plan)))
    assert len(ax.collections) == 3 and not ax.patches
    actions = sum(len(row) for row in plan.actions)
    assert actions == 4 * 3 * m
    assert len(ax.texts) == (actions if labelled else 0)


def test_labels_fit_inside_their_boxes():
    """Unequal costs (W = 0.8 F): every drawn number lies inside its box on the rendered picture, and
    whether a box is labelled depends only on its length (all boxes of one length alike)."""
    costs = Costs(1, 1.5, 0.8, 0.1)
    plan = build("auto", 4, 1, 16, costs=costs)
    result = simulate(plan, costs)
    ax, renderer = _drawn(timeline_figure(plan, result))
    assert ax.texts
    boxes = {(rank, round((s + e) / 2, 6)): (s, e, a) for rank, row in enumerate(result.timeline)
             for s, e, a in row}
    labelled = set()
    for text in ax.texts:
        x, y = text.get_position()
        start, end, action = boxes[(round(y), round(x, 6))]
        assert text.get_text() == str(action.microbatch)
        left, right = (ax.transData.transform((t, 0))[0] for t in (start, end))
        extent = text.get_window_extent(renderer)
        assert left <= extent.x0 and extent.x1 <= right
        labelled.add((round(y), round(x, 6)))
    for length in {round(e - s, 6) for s, e, _ in boxes.values()}:
        same = [key for key, (s, e, _) in boxes.items() if round(e - s, 6) == length]
        assert len({key in labelled for key in same}) == 1, length


def _legend(ax):
    return [t.get_text() for t in ax.get_legend().get_texts()]


@pytest.mark.parametrize("optimizer_step", [0.0, 0.5])
def test_two_iteration_legend_is_what_is_drawn(optimizer_step):
    """Two post-validated ZB-H2 iterations: the legend has an optimizer step only when one is drawn
    (a gold collection), and every legend colour is the face colour of some drawn collection."""
    from matplotlib.colors import to_hex
    costs = Costs(1, 1, 1, 0.1)
    plan = build("zb-h2", 4, 1, 8, costs=costs)
    iters = simulate_iterations(plan, costs, 2, post_validation=True, optimizer_step=optimizer_step)
    ax, _ = _drawn(timeline_figure(plan, iters.result, iterations=iters))
    expected = ["F", "B", "W", "odd iteration"] + (["optimizer step"] if optimizer_step else [])
    assert _legend(ax) == expected
    faces = {to_hex(c) for coll in ax.collections for c in coll.get_facecolor()}
    for handle, label in zip(ax.get_legend().legend_handles, expected):
        if label != "odd iteration":
            assert to_hex(handle.get_facecolor()) in faces, label
    assert ("#fec44f" in faces) == bool(optimizer_step)


def test_hatching_stays_below_the_numbers():
    """Odd iterations are hatched in a strip at the bottom of their boxes: no number's rendered extent
    reaches into any hatched strip of its rank."""
    plan = build("zbv", 2, 2, 4)
    iters = simulate_iterations(plan, Costs(), 3, post_validation=True)
    ax, renderer = _drawn(timeline_figure(plan, iters.result, iterations=iters))
    hatched = [coll for coll in ax.collections if coll.get_hatch()]
    assert hatched and ax.texts
    strips = {}   # rank -> display y-range of its hatched strips
    for coll in hatched:
        for path in coll.get_paths():
            ys = ax.transData.transform(path.vertices)[:, 1]
            strips.setdefault(round(path.vertices[:, 1].mean()), set()).add((ys.min(), ys.max()))
    for text in ax.texts:
        extent = text.get_window_extent(renderer)
        for low, high in strips[round(text.get_position()[1])]:
            assert extent.y1 <= low or extent.y0 >= high


def test_json_alone_draws_nothing(tmp_path, monkeypatch, capsys):
    """--json without --out is for scripts: no figure, no runs/ folder; with --out it draws once."""
    monkeypatch.chdir(tmp_path)
    calls = []
    monkeypatch.setattr(plot_schedule, "plot_timeline", lambda *a, **k: calls.append(a))
    assert plot_schedule.main(["--schedule", "zb-h1", "--pp", "2", "--microbatches", "4", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["makespan"] > 0
    assert calls == [] and os.listdir(tmp_path) == []
    assert plot_schedule.main(["--schedule", "zb-h1", "--pp", "2", "--microbatches", "4", "--json",
                               "--out", "x.png"]) == 0
    assert len(calls) == 1 and calls[0][2] == "x.png"


@pytest.mark.parametrize("name,extra", [("1f1b", []), ("zb-h2", ["--post-validation", "--costs", "1,1,1,0.1"])])
def test_table_covers_every_drawn_iteration(name, extra, tmp_path, capsys):
    """Two iterations at p = 4, m = 8: the table's busy time is two iterations' work, 2 x 8 x (F + B + W)
    = 48 per rank, and its makespan the end of the second one, which the report's last line gives
    (no optimizer cost); for 1F1B with a barrier that is 2 x 30 (its makespan, docs/schedules.md)."""
    argv = ["--schedule", name, "--pp", "4", "--microbatches", "8", "--iterations", "2",
            "--out", str(tmp_path / "t.png")]
    assert plot_schedule.main(argv + extra) == 0
    text = capsys.readouterr().out
    assert "per rank over all 2 iterations drawn above:" in text
    rows = _table_rows(text[text.index(" rank     busy"):text.index("one iteration alone: makespan")].strip("\n"))
    assert [rows[str(r)][0] for r in range(4)] == [48.0] * 4
    second_end = float(text.split("iterations end at ")[1].split()[1])
    assert [rows[str(r)][4] for r in range(4)] == [second_end] * 4
    assert name != "1f1b" or second_end == 60.0


@pytest.mark.parametrize("name", ["group-interleaved:2", "interleaved:8", "1f1b-v"])
def test_script_draws_the_grouped_schedules(name, capsys, tmp_path):
    """plot-schedule takes NAME:N; its numbers are the simulator's for the builder's plan."""
    assert plot_schedule.main(["--schedule", name, "--pp", "4", "--microbatches", "8", "--json",
                               "--out", str(tmp_path / "s.png")]) == 0
    got = json.loads(capsys.readouterr().out)
    plan = build(name, 4, 2, 8)
    result = simulate(plan, Costs())
    assert (got["schedule"], got["vpp"], got["makespan"]) == (name, 2, result.makespan)
    assert got["peak_activation_memory"] == result.peak_memory

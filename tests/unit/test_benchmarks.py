"""benchmarks/bench_schedules.py: the real-mode summary (the ratios the README reports), the pooling of
runs and the synthetic mode end to end; every benchmark's --help, and no benchmark imports from tests/."""
import ast
import glob
import importlib
import json
import os
import sys

import pytest
import torch

from benchmarks.pool_runs import bootstrap_median, pooled, round_ratios
from benchmarks.schedules_real import _simulated_fill, check_same_losses, summary
from llamapipe.core.pipeline_parallel.schedule_specs import build
from llamapipe.core.pipeline_parallel.simulator import Costs
from tests.harness import ROOT


def _row(name, rounds, busy):
    return {"schedule": name, "m": 4, "step_s": sorted(rounds)[len(rounds) // 2], "ideal_s": 1.0,
            "busy_ideal_s": 1.25, "busy_s": busy, "rounds_s": rounds}


def test_summary_ratios_and_paired_torch_comparison():
    rows = [_row("1f1b", [2.0, 2.0, 2.0], [1.5, 1.8]),
            _row("zbv", [1.2, 1.8, 1.5], [1.4, 1.3]),
            _row("torch-zbv", [1.0, 2.0, 1.6], [1.45, 1.3]),
            {"schedule": "torch-1f1b", "m": 4, "step_s": None, "ideal_s": 1.0, "busy_ideal_s": 1.25, "error": "x"}]
    out = {r["schedule"]: r for r in summary(rows)}
    assert set(out) == {"1f1b", "zbv", "torch-zbv"}               # a failed torch schedule is skipped
    zbv = out["zbv"]
    assert zbv["vs_our_1f1b"] == pytest.approx(0.75)
    assert zbv["vs_ideal"] == pytest.approx(1.5) and zbv["vs_busy_ideal"] == pytest.approx(1.2)
    assert zbv["busiest_vs_ideal"] == pytest.approx(1.4)          # rank 0 is the busiest
    assert zbv["step_vs_busiest"] == pytest.approx(1.5 / 1.4)
    # per-round ratios 1.2, 0.9, 0.9375: the median pairs each round with torch's run of the same round
    assert zbv["vs_torch_paired"] == pytest.approx(0.9375)
    assert zbv["vs_our_1f1b_paired"] == pytest.approx(0.75)          # rounds 0.6, 0.9, 0.75
    assert out["torch-zbv"]["vs_our_1f1b_paired"] == pytest.approx(0.8)  # 0.5, 1.0, 0.8
    assert "vs_torch_paired" not in out["1f1b"]                    # torch-1f1b failed


def test_simulated_fill_at_unit_costs():
    # p = 2, m = 4, F = B = W = 1 per stage: 1F1B idles one F and one B+W per rank (14 / 12), ZB-V only
    # the first half-stage forward (12.5 / 12); the fused 1F1B without the early send is longer still.
    costs = Costs(f=1.0, b=1.0, w=1.0)
    assert _simulated_fill(build("1f1b", 2, 1, 4), 1, costs, early_send=True) == pytest.approx(14 / 12)
    assert _simulated_fill(build("zbv", 2, 2, 4), 2, costs, early_send=True) == pytest.approx(12.5 / 12)
    assert _simulated_fill(build("1f1b", 2, 1, 4), 1, costs, early_send=False) > 14 / 12


def test_pooled_rounds_pair_within_each_run():
    run = lambda rounds_zbv, rounds_1f1b: {"real": [_row("zbv", rounds_zbv, [1, 1]),  # noqa: E731
                                                     _row("1f1b", rounds_1f1b, [1, 1])]}
    runs = [run([1.0, 3.0], [2.0, 2.0]), run([4.0], [5.0]), {"real": [_row("zbv", [9.0], [1, 1])]}]
    assert round_ratios(runs, "zbv", "1f1b", 4) == [0.5, 1.5, 0.8]      # the run without 1f1b adds nothing
    row = pooled(runs, pairs=[("zbv", "1f1b"), ("zbv", "torch-zbv")])
    assert len(row) == 1 and row[0]["rounds"] == 3 and row[0]["wins"] == 2
    assert row[0]["median"] == pytest.approx(0.8)
    low, high = row[0]["ci95"]
    assert 0.5 <= low <= 0.8 <= high <= 1.5


def test_bootstrap_interval_narrows_with_more_rounds():
    rounds = [0.8 + 0.4 * ((i * 0.618034) % 1) for i in range(200)]      # spread evenly over [0.8, 1.2)
    (few_low, few_high), (low, high) = bootstrap_median(rounds[:7]), bootstrap_median(rounds)
    assert few_low <= low <= 1.0 <= high <= few_high
    assert high - low < 0.5 * (few_high - few_low)


def test_torch_comparison_requires_the_same_losses():
    """The benchmark compares against torch only when both compute the same per-microbatch losses."""
    ours = [{"loss_sum": torch.tensor(100.0)}, {"loss_sum": torch.tensor(50.0)}]
    assert check_same_losses(ours, [torch.tensor(100.0), torch.tensor(50.0)], "torch-zbv") == 0.0
    assert check_same_losses(ours, [torch.tensor(100.001), torch.tensor(50.0)], "torch-zbv") == \
        pytest.approx(1e-5, rel=1e-2)
    with pytest.raises(AssertionError, match="microbatch 1 loss"):      # e.g. a sum of logits, not the loss
        check_same_losses(ours, [torch.tensor(100.0), torch.tensor(51.0)], "torch-zbv")
    with pytest.raises(AssertionError, match="1 microbatch losses from ours, 2 from torch"):
        check_same_losses(ours[:1], [torch.tensor(100.0), torch.tensor(50.0)], "torch-zbv")
    assert check_same_losses([], [], "torch-1f1b") == 0.0              # a rank without the loss


@pytest.mark.slow
def test_synthetic_mode_times_every_schedule_round_robin():
    """The synthetic mode's sleeping stages run every schedule end to end on 4 gloo ranks; a step can
    never beat the simulated makespan of its sleeps by more than the sleep calibration allows."""
    from benchmarks.bench_schedules import synthetic_worker
    from benchmarks.schedules_real import SCHEDULES
    from tests.harness import run_distributed
    rows = run_distributed(synthetic_worker, 4, 4, 0.01, 3, timeout=300)[0]
    assert [(r["schedule"], r["vpp"]) for r in rows] == list(SCHEDULES)
    for r in rows:
        assert len(r["rounds_s"]) == 3 and r["measured_s"] == sorted(r["rounds_s"])[1]
        assert r["ratio"] > 0.9, r
        assert r["comm_ms"] > 0 and 0 <= r["sleep_overshoot_ms"] <= 0.3
        plan_actions = {"gpipe": 8, "1f1b": 8, "interleaved": 16, "zb-h1": 12, "zbv": 24}
        if r["schedule"] in plan_actions:
            assert r["actions_per_rank"] == plan_actions[r["schedule"]]


BENCHMARKS = sorted(os.path.basename(p)[:-3] for p in glob.glob(os.path.join(ROOT, "benchmarks", "bench_*.py"))) \
    + ["pool_runs"]      # the command that pools bench_schedules runs


def test_benchmarks_import_nothing_from_tests():
    """Benchmarks run from a checkout without the test suite; the launchers they share are benchmarks/launch.py."""
    offenders = []
    for path in glob.glob(os.path.join(ROOT, "benchmarks", "*.py")):
        for node in ast.walk(ast.parse(open(path).read(), path)):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            offenders += [f"{os.path.basename(path)}:{node.lineno}" for n in names if n.split(".")[0] == "tests"]
    assert not offenders


@pytest.mark.parametrize("name", BENCHMARKS)
def test_benchmark_help(name, monkeypatch, capsys):
    """`python -m benchmarks.<name> --help` prints its usage and exits 0 (its imports resolve)."""
    assert len(BENCHMARKS) >= 9
    module = importlib.import_module(f"benchmarks.{name}")
    monkeypatch.setattr(sys, "argv", [f"{name}.py", "--help"])
    with pytest.raises(SystemExit) as info:
        module.main()
    assert info.value.code == 0 and "usage:" in capsys.readouterr().out


def test_results_record_the_machine(tmp_path, capsys):
    from benchmarks.results_io import write_json
    out = tmp_path / "new" / "r.json"
    write_json(str(out), {"rows": [1]})
    saved = json.loads(out.read_text())
    assert saved["rows"] == [1] and saved["machine"]["torch"] == torch.__version__
    assert saved["machine"]["cpus"] == os.cpu_count() and f"wrote {out}" in capsys.readouterr().out

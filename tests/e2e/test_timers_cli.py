"""--timing-log-level through the CLI: the measured bubble in the log line, JSONL and the timer block, with the
single-process losses unchanged (fp32, rel 1e-5)."""
from __future__ import annotations

import math

import pytest

from tests.cli import TINY, read_metrics, torchrun, train

ITERS = ["--train-iters", "4", "--micro-batch-size", "1", "--global-batch-size", "8", "--log-interval", "2"]
ZBV = ["--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage", "2",
       "--pipeline-schedule", "zbv"]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    return [r["lm_loss"] for r in train(1, ITERS, str(tmp_path_factory.mktemp("ref") / "m.jsonl"))]


def _run(tmp_path, flags: list[str]) -> tuple[list[dict], str]:
    jsonl = str(tmp_path / "m.jsonl")
    proc = torchrun(2, TINY + ITERS + flags + ["--metrics-jsonl", jsonl])
    assert proc.returncode == 0, proc.stderr[-3000:]
    return read_metrics(jsonl), proc.stdout + proc.stderr


def _check_losses(records: list[dict], reference: list[float]) -> None:
    assert len(records) == len(reference) == 4
    for it, (got, want) in enumerate(zip((r["lm_loss"] for r in records), reference), 1):
        assert math.isclose(got, want, rel_tol=1e-5), f"iteration {it}: {got} vs {want}"


def test_level_2_zbv_logs_the_bubble_of_every_rank_and_keeps_the_losses(reference, tmp_path):
    records, out = _run(tmp_path, ZBV + ["--timing-log-level", "2", "--timing-log-option", "all"])
    _check_losses(records, reference)
    logged = [r for r in records if "bubble_max" in r]
    assert [r["iteration"] for r in logged] == [2, 4], "timers are reported at the end of each logging interval"
    for r in logged:
        assert 0.0 <= r["bubble_mean"] <= r["bubble_max"] < 1.0 and r["bubble_max_rank"] in (0, 1)
        assert max(r["bubble_pp0"], r["bubble_pp1"]) == r["bubble_max"]
        for rank in ("rank0", "rank1"):
            t = r["timers"][rank]
            assert t["compute"] > 0 and math.isclose(t["compute"] + t["communication"] + t["idle"], t["iteration"],
                                                     rel_tol=1e-6), t
    assert "pipeline bubble (measured):" in out and "times across ranks (ms):" in out
    assert "forward-compute" in out and "backward-weight-compute" in out, "level 2 names the phases"
    assert "measured pipeline bubble: worst rank" in out


def test_level_1_under_post_validation_and_auto(reference, tmp_path):
    records, out = _run(tmp_path, ["--pipeline-model-parallel-size", "2", "--pipeline-schedule", "auto",
                                   "--pipeline-profile-iters", "2", "--enable-optimizer-post-validation",
                                   "--timing-log-level", "1"])
    _check_losses(records, reference)
    assert all("bubble_max" in r for r in records if r["iteration"] % 2 == 0)
    assert "(min, max) time across ranks (ms):" in out and "forward-compute" not in out, "level 1: no phases"


def test_level_0_reports_nothing(reference, tmp_path):
    records, out = _run(tmp_path, ["--pipeline-model-parallel-size", "2"])
    _check_losses(records, reference)
    assert not any("bubble_max" in r for r in records) and "time across ranks" not in out

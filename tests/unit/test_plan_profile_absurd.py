"""`llamapipe plan --profile` on a profile with finite but absurd times (issue 51, item 10): one line naming
the file and exit 2, never a table of nan/inf."""
from __future__ import annotations

import pytest

from llamapipe.tools import plan_parallelism
from llamapipe.training import profile_schema
from tests.unit.test_profile_planner import synthetic_profile


@pytest.fixture(autouse=True)
def _torchrun_threads(monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)


@pytest.mark.parametrize("change, says", [
    (lambda p: p["entries"][0]["layer"].update(f=1e308), "entries[0].layer.f is 1e+308 s, over 3600 s"),
    (lambda p: p["entries"][0]["head"].update(w=1e308), "entries[0].head.w is 1e+308 s"),
    (lambda p: p.update(optimizer_s_per_param=1e308), "its times give a predicted step of"),
])
def test_absurd_profile_times_are_refused_in_one_line(tmp_path, capsys, change, says):
    profile = synthetic_profile(num_layers=4)
    change(profile)
    path = tmp_path / "profile.json"
    profile_schema.write(str(path), profile)
    assert plan_parallelism.main(["--profile", str(path), "--gpus", "2", "--global-batch-size", "8"]) == 2
    captured = capsys.readouterr()
    assert captured.err.count("\n") == 1 and says in captured.err and str(path) in captured.err, captured.err
    assert "nan" not in captured.out and "inf" not in captured.out

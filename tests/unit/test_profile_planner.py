"""`llamapipe profile` and `plan --profile`: the profile's schema, the one path from timings to costs, the
prediction arithmetic against a hand-simulated 1F1B, the layer balance, the ranking, and the CLI on tiny."""
from __future__ import annotations

import copy
import dataclasses
import json
import os
import re
import subprocess
import sys

import pytest
import torch

from llamapipe.core.pipeline_parallel.auto_schedule import measured_costs
from llamapipe.core.pipeline_parallel.layout import stage_layer_ranges
from llamapipe.core.pipeline_parallel.profile_costs import (PassCosts, costs_from_medians, pass_medians,
                                                            stage_costs)
from llamapipe.core.pipeline_parallel.schedule_ir import Action
from llamapipe.model.llama import LlamaConfig
from llamapipe.tools import plan_parallelism, profile_plan
from llamapipe.training import profile_schema
from llamapipe.tools.parallel_estimate import Layout, layer_act_bytes, rank_params
from llamapipe.tools.profile_predict import balanced_counts, layout_string, predict

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MS = 1e-3


@pytest.fixture(autouse=True)
def _torchrun_threads(monkeypatch):
    """The ranks' thread count a profile must match is torchrun's 1 here, whatever this shell exports."""
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)


def synthetic_profile(layer=(1.0, 1.0, 1.0), head=(1.0, 1.0, 1.0), num_layers=2, optimizer=0.0) -> dict:
    """A profile with round times in ms: embedding free, a layer and the head as given, comm negligible."""
    model = LlamaConfig(num_layers=num_layers, hidden_size=64, ffn_hidden_size=128, num_attention_heads=4,
                        num_query_groups=4, vocab_size=256)
    def part(fbw):
        return {"f": fbw[0] * MS, "b": fbw[1] * MS, "w": fbw[2] * MS, "act_bytes": 1000.0, "w_bytes": 500.0}
    entry = {"micro_batch_size": 1, "recompute": "none", "layer": part(layer), "embedding": part((0, 0, 0)),
             "head": part(head)}
    comm = {"world_size": 2, "p2p_latency_s": 0.0, "p2p_bandwidth_Bps": 1e18, "allreduce_latency_s": 0.0,
            "allreduce_bus_bandwidth_Bps": 1e18}
    return profile_schema.make_profile(model=dataclasses.asdict(model), seq_length=32, dtype="fp32", device="cpu",
                                       threads=1, entries=[entry], optimizer_s_per_param=optimizer, comm=comm)


def one_f_one_b(pp: int = 2, **kw) -> Layout:
    return Layout(1, pp, 1, 1, "1f1b", 1, "none", False, precision="fp32", **kw)


def test_schema_accepts_what_profile_writes_and_names_the_first_bad_field():
    good = synthetic_profile()
    assert profile_schema.validate(good) is good
    cases = [({"schema": "other/1"}, "schema is 'other/1'"),
             ({"entries": []}, "entries is empty"),
             ({"optimizer_s_per_param": -1.0}, "optimizer_s_per_param is -1.0"),
             ({"model": {"num_layers": 2, "bogus": 1}}, "model:")]
    for change, words in cases:
        bad = {**copy.deepcopy(good), **change}
        with pytest.raises(profile_schema.ProfileError, match=words):
            profile_schema.validate(bad)
    bad = copy.deepcopy(good)
    bad["entries"][0]["head"]["b"] = "fast"
    with pytest.raises(profile_schema.ProfileError, match=r"entries\[0\]\.head\.b is 'fast'"):
        profile_schema.validate(bad)
    bad = copy.deepcopy(good)
    bad["comm"]["p2p_bandwidth_Bps"] = 0
    with pytest.raises(profile_schema.ProfileError, match="comm.p2p_bandwidth_Bps is 0; expected a positive"):
        profile_schema.validate(bad)


def test_load_is_one_line_for_missing_and_broken_files(tmp_path):
    with pytest.raises(profile_schema.ProfileError, match="cannot read it"):
        profile_schema.load(str(tmp_path / "none.json"))
    broken = tmp_path / "broken.json"
    broken.write_text("{not json")
    with pytest.raises(profile_schema.ProfileError, match="not JSON") as err:
        profile_schema.load(str(broken))
    assert "\n" not in str(err.value)


def test_timings_become_costs_through_one_path_shared_with_auto():
    records = [(Action("F", 0, i), t) for i, t in enumerate((3.0, 1.0, 2.0))]
    records += [(Action("B", 0, i), t) for i, t in enumerate((4.0, 6.0))]
    records += [(Action("BW", 0, 0), 100.0)]           # a fused BW is neither B nor W
    medians = pass_medians(records)
    assert medians == {"F": 2.0, "B": 5.0, "W": 0.0}
    costs = costs_from_medians(medians, comm=0.5)
    assert (costs.f, costs.b, costs.w, costs.comm) == (2.0, 5.0, 1e-9, 0.5)
    auto = measured_costs(records)                      # auto's in-run path, no process group here
    assert (auto.f, auto.b, auto.w) == (costs.f, costs.b, costs.w)


def test_stage_costs_sum_their_parts_and_leave_the_vocabulary_layers_out_under_vocab_parallelism():
    layer, emb, head = PassCosts(1, 2, 3, 10, 5), PassCosts(0.5, 0.5, 0, 0, 0), PassCosts(4, 5, 6, 40, 20)
    costs = stage_costs(layer, emb, head, [3, 1])
    assert costs.stages[0] == PassCosts(3.5, 6.5, 9, 30, 15)
    assert costs.stages[1] == PassCosts(5, 7, 9, 50, 25)
    vocab = stage_costs(layer, emb, head, [3, 1], vocab_parallel=True)
    assert vocab.stages == (PassCosts(3, 6, 9, 30, 15), PassCosts(1, 2, 3, 10, 5))
    assert (vocab.head_f, vocab.head_b, vocab.head_mem) == (4, 11, 40)


def test_prediction_is_the_hand_simulated_1f1b_plus_the_optimizer():
    """pp 2, m 2, stage 0 F=B=W=1 ms, stage 1 (layer + head) F=B=W=2 ms, early input-gradient send:
    r0 F0 0-1, F1 1-2; r1 F0 1-3, BW0 3-7 (gradient sent at 5); r0 BW0 5-7; r1 F1 7-9, BW1 9-13
    (gradient at 11); r0 BW1 11-13: makespan 13 ms, busy 6 and 12 ms."""
    profile = synthetic_profile()
    pred = predict(profile, one_f_one_b(), 2, cores=2)
    assert pred.pipeline_s == pytest.approx(13 * MS, rel=1e-9)
    assert pred.busy_s == pytest.approx((6 * MS, 12 * MS), rel=1e-9)
    assert pred.bubble == pytest.approx(1 - 18 / 26, rel=1e-9)
    assert pred.step_s == pytest.approx(13 * MS, rel=1e-9)
    with_opt = predict(synthetic_profile(optimizer=1e-9), one_f_one_b(), 2, cores=2)
    params = rank_params(profile_schema.model_of(profile), one_f_one_b())
    assert with_opt.step_s == pytest.approx(13 * MS + max(params) * 1e-9, rel=1e-9)
    # two single-thread ranks on one core: where both compute (1-2, 5-7 and 11-13 ms) at half speed, where one
    # waits the other has the core: 13 + 5 ms (`contended`)
    assert predict(profile, one_f_one_b(), 2, cores=1).pipeline_s == pytest.approx(18 * MS, rel=1e-9)


def test_balance_moves_layers_off_the_stage_with_the_head():
    """8 layers of 1 ms passes, the head two layers' worth: the even 4/4 split loads rank 1 with 6 layers'
    worth, 5/3 gives 5 and 5."""
    profile = synthetic_profile(num_layers=8, head=(2.0, 2.0, 2.0))
    counts = balanced_counts(profile, one_f_one_b())
    assert counts == [5, 3]
    text = layout_string(counts)
    assert text == "Et*5|t*3L"
    assert stage_layer_ranges(8, 2, 1, layout=text) == [(0, 5), (5, 8)]
    even = predict(profile, one_f_one_b(), 8, cores=2)
    balanced = predict(profile, one_f_one_b(), 8, counts=counts, cores=2)
    assert balanced.step_s < even.step_s
    assert max(balanced.busy_s) == pytest.approx(8 * 15 * MS, rel=1e-9)


def _plan_rows(path, capsys) -> tuple[str, list[list[str]]]:
    assert plan_parallelism.main(["--profile", str(path), "--gpus", "2", "--global-batch-size", "8",
                                  "--top", "50"]) == 0
    out = capsys.readouterr().out
    return out, [line.split() for line in out.splitlines() if re.match(r"\s*\d+(\s+\d+){4} ", line)]


def test_plan_with_profile_ranks_by_predicted_step_and_prints_the_chosen_split(tmp_path, capsys, monkeypatch):
    path = tmp_path / "profile.json"
    profile_schema.write(str(path), synthetic_profile(num_layers=8, head=(2.0, 2.0, 2.0)))
    monkeypatch.setattr(profile_plan, "trainer_has_vocab_parallel", lambda: False)
    out, rows = _plan_rows(path, capsys)
    assert out.startswith("time model: measured profile")
    steps = [float(r[-1]) for r in rows]
    assert len(rows) >= 4 and steps == sorted(steps)
    pp2 = [r for r in rows if r[2] == "2" and r[5] == "1f1b"]
    assert pp2 and pp2[0][10] == "5/3" and pp2[0][9] == "no"
    assert "Top row:" in out
    close = sum(1 for step in steps if step <= steps[0] * 1.02)
    assert (f"note: rows 1-{close} are predicted within 2% of each other" in out) == (close > 1)
    monkeypatch.setattr(profile_plan, "trainer_has_vocab_parallel", lambda: True)
    out, rows = _plan_rows(path, capsys)
    assert any(r[9] == "yes" for r in rows), "the output layer split over the pipeline is offered"
    plan_parallelism.main(["--model", "tiny", "--gpus", "2", "--global-batch-size", "8", "--seq-length", "64"])
    assert "time model: FLOPs at 60%" in capsys.readouterr().out


def test_plan_with_a_missing_profile_is_one_line(tmp_path, capsys):
    assert plan_parallelism.main(["--profile", str(tmp_path / "no.json"), "--gpus", "2",
                                  "--global-batch-size", "8"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "cannot read it" in err


def test_profile_cli_on_tiny_measures_times_and_the_activation_bytes_the_memory_model_predicts(tmp_path):
    out = tmp_path / "tiny.json"
    proc = subprocess.run([sys.executable, "-m", "llamapipe", "profile", "--model", "tiny", "--seq-length", "32",
                           "--micro-batch-size", "1", "2", "--recompute", "none", "full", "--repeats", "1",
                           "--threads", "1", "--out", str(out)], cwd=ROOT, capture_output=True, text=True,
                          timeout=300, env=dict(os.environ, PYTHONPATH=ROOT))
    assert proc.returncode == 0, proc.stderr[-3000:]
    profile = profile_schema.load(str(out))
    assert profile_schema.settings(profile) == [(1, "none"), (1, "full"), (2, "none"), (2, "full")]
    assert profile["comm"] is None and profile["threads"] == 1
    assert set(profile["overhead"]) == set(profile_schema.OVERHEAD_FIELDS), "no pipeline figure without torchrun"
    m = profile_schema.model_of(profile)
    for mbs, recompute in profile_schema.settings(profile):
        parts = profile_schema.entry(profile, mbs, recompute)
        assert min(parts["layer"].f, parts["layer"].b, parts["layer"].w, parts["head"].f) > 0
        expected, _ = layer_act_bytes(m, 32, mbs, recompute, "fp32")
        torch.testing.assert_close(parts["layer"].act_bytes, float(expected), rtol=0.05, atol=0.0,
                                   msg=f"layer activations, mbs {mbs} recompute {recompute}")
    assert "layer F/B/W" in proc.stdout
    json.loads(out.read_text())


def test_vocab_parallel_prediction_adds_the_embedding_shards_outside_the_plan():
    """With --enable-vocab-parallel every rank runs 1/pp of the embedding before and after the plan: at zero
    communication cost the step grows by m x (F + B) / pp of the embedding, whatever the plan."""
    lay = Layout(1, 2, 1, 1, "1f1b", 1, "none", False, precision="fp32", vocab_parallel=True)
    base = synthetic_profile(num_layers=8)
    heavier = copy.deepcopy(base)
    heavier["entries"][0]["embedding"].update(f=2 * MS, b=4 * MS)
    grown = predict(heavier, lay, 8, cores=2).step_s - predict(base, lay, 8, cores=2).step_s
    assert grown == pytest.approx(8 * (2 + 4) / 2 * MS, rel=1e-9)
    assert predict(base, lay, 8, cores=2).busy_s[0] == pytest.approx(predict(base, lay, 8, cores=2).busy_s[1])


def test_profile_cli_refuses_an_incomplete_shape_in_one_line():
    proc = subprocess.run([sys.executable, "-m", "llamapipe", "profile", "--num-layers", "2", "--out", "unused.json"],
                          cwd=ROOT, capture_output=True, text=True, timeout=120, env=dict(os.environ, PYTHONPATH=ROOT))
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
    assert proc.stderr.startswith("llamapipe profile: --hidden-size")


@pytest.mark.parametrize("value", [float("nan"), float("inf")], ids=["nan", "inf"])
def test_plan_refuses_a_profile_with_a_time_that_is_not_finite(tmp_path, capsys, value):
    """Issue 40: NaN gave a table whose step was `nan`, inf a lopsided split. JSON's NaN/Infinity parse, so the
    schema says no."""
    profile = synthetic_profile(num_layers=8)
    profile["entries"][0]["layer"]["b"] = value
    path = tmp_path / "profile.json"
    path.write_text(json.dumps(profile))     # json writes NaN and Infinity, as a damaged profile would hold them
    assert plan_parallelism.main(["--profile", str(path), "--gpus", "2", "--global-batch-size", "8"]) == 2
    err = capsys.readouterr().err
    assert err == f"llamapipe plan: --profile {path}: entries[0].layer.b is {value!r}; expected a finite " \
                  "non-negative number\n"


def test_plan_refuses_a_profile_of_another_model_and_plans_the_layers_asked_for(tmp_path, capsys):
    """Issue 40: `plan --profile` planned the profile's model whatever --model said (50x the real step, no note);
    the trainer's check now refuses it, and shape flags that agree plan their own number of layers."""
    path = tmp_path / "profile.json"
    profile_schema.write(str(path), synthetic_profile(num_layers=8))
    assert plan_parallelism.main(["--profile", str(path), "--model", "llama2-7b", "--gpus", "2",
                                  "--global-batch-size", "8"]) == 2
    assert capsys.readouterr().err == (f"llamapipe plan: --profile {path} was made for a model with hidden_size 64, "
                                       "but --model and the shape flags give 4096; profile this model with "
                                       "`llamapipe profile`\n")
    shape = ["--num-layers", "12", "--hidden-size", "64", "--ffn-hidden-size", "128", "--num-attention-heads", "4",
             "--vocab-size", "256"]
    assert plan_parallelism.main(["--profile", str(path), *shape, "--gpus", "2", "--global-batch-size", "8",
                                  "--top", "50"]) == 0
    rows = [line.split() for line in capsys.readouterr().out.splitlines() if re.match(r"\s*\d+(\s+\d+){4} ", line)]
    assert rows and all(sum(map(int, r[10].split("/"))) == 12 for r in rows)

"""The runtime overhead in `llamapipe profile` and `plan --profile` (issue 29): its schema fields round-trip,
the prediction adds it where the runtime pays it (checked against a hand-simulated 1F1B), a profile written
before it still loads with a one-line notice, and the measurement on a tiny model gives sane figures."""
from __future__ import annotations

import copy

import pytest
import torch

from llamapipe.model.llama import LlamaConfig
from llamapipe.tools import plan_parallelism, profile_model, profile_overhead
from llamapipe.training import profile_schema
from llamapipe.tools.parallel_estimate import Layout, rank_params
from llamapipe.tools.profile_predict import predict
from tests.unit.test_profile_planner import MS, one_f_one_b, synthetic_profile

OVERHEAD = {"action_s": 0.25 * MS, "iteration_s": 2 * MS, "param_s": 1e-9, "pipeline_action_s": 0.5 * MS}


def with_overhead(profile: dict, **figures: float) -> dict:
    out = copy.deepcopy(profile)
    out["overhead"] = {**OVERHEAD, **figures}
    return out


def test_overhead_fields_round_trip_and_a_bad_one_is_named(tmp_path):
    path = tmp_path / "p.json"
    profile_schema.write(str(path), with_overhead(synthetic_profile()))
    loaded = profile_schema.load(str(path))
    assert loaded["overhead"] == OVERHEAD
    assert profile_schema.overhead(loaded) == OVERHEAD
    assert profile_schema.notice(loaded) is None
    assert "0.250 ms per action" in profile_schema.summary(loaded)
    bad = with_overhead(synthetic_profile(), action_s=-1.0)
    with pytest.raises(profile_schema.ProfileError, match="overhead.action_s is -1.0"):
        profile_schema.validate(bad)


def test_a_profile_without_overhead_loads_with_a_one_line_notice_and_predicts_without_it(tmp_path, capsys):
    old = synthetic_profile()
    del old["overhead"]                      # as written before the overhead was measured
    path = tmp_path / "old.json"
    profile_schema.write(str(path), old)
    loaded = profile_schema.load(str(path))
    assert profile_schema.overhead(loaded) == {"action_s": 0.0, "iteration_s": 0.0, "param_s": 0.0,
                                               "pipeline_action_s": 0.0}
    note = profile_schema.notice(loaded, "old.json")
    assert note is not None and "\n" not in note and "old.json has no overhead" in note
    assert predict(loaded, one_f_one_b(), 2, cores=2).step_s == pytest.approx(13 * MS, rel=1e-9)
    assert plan_parallelism.main(["--profile", str(path), "--gpus", "2", "--global-batch-size", "8"]) == 0
    notes = [line for line in capsys.readouterr().out.splitlines() if line.startswith("note:")]
    # one line about the missing figures (another note may say the top rows are too close to separate)
    assert len([n for n in notes if "no overhead figures" in n]) == 1


def test_prediction_adds_the_action_cost_along_the_critical_path_and_the_step_cost_once():
    """pp 2, m 2 as in test_profile_planner's hand simulation, each action 0.5 ms longer (its first part):
    r0 F0 0-1.5, F1 1.5-3; r1 F0 1.5-4, BW0 4-8.5 (gradient sent at 6.5); r0 BW0 6.5-9; r1 F1 8.5-11,
    BW1 11-15.5 (gradient at 13.5); r0 BW1 13.5-16: makespan 16 ms, 6 actions on the critical path. The
    step adds 2 ms and 1 ns per parameter of the most loaded rank."""
    profile = with_overhead(synthetic_profile())
    pred = predict(profile, one_f_one_b(), 2, cores=2)
    assert pred.pipeline_s == pytest.approx(16 * MS, rel=1e-9)
    assert pred.busy_s == pytest.approx((8 * MS, 14 * MS), rel=1e-9)
    params = max(rank_params(profile_schema.model_of(profile), one_f_one_b()))
    assert pred.overhead_s == pytest.approx(2 * MS + params * 1e-9, rel=1e-9)
    assert pred.step_s == pytest.approx(16 * MS + 2 * MS + params * 1e-9, rel=1e-9)


def test_one_stage_uses_the_single_rank_action_cost():
    """pp 1, m 2: one stage of 2 layers and the head, F = B = W = 3 ms; F and BW per microbatch is 18 ms,
    plus 4 actions of 0.25 ms (not the pipelined 0.5 ms)."""
    single = Layout(1, 1, 1, 1, "1f1b", 1, "none", False, precision="fp32")
    base = predict(synthetic_profile(), single, 2, cores=2)
    pred = predict(with_overhead(synthetic_profile()), single, 2, cores=2)
    assert base.pipeline_s == pytest.approx(18 * MS, rel=1e-9)
    assert pred.pipeline_s == pytest.approx(19 * MS, rel=1e-9)


def test_measure_on_a_tiny_model_gives_sane_figures():
    """Per action well under the passes of a real layer, per iteration under 50 ms, per parameter under 50 ns:
    bounds a broken fit (a compute term left in, a sign error) would cross on this machine."""
    m = LlamaConfig(num_layers=2, hidden_size=64, ffn_hidden_size=128, num_attention_heads=4, num_query_groups=4,
                    vocab_size=512, max_position_embeddings=64)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        figures = profile_overhead.measure(m, 32, 1, torch.float32, torch.device("cpu"), 3,
                                           profile_model.measure_chunk)
    finally:
        torch.set_num_threads(threads)
    assert set(figures) == set(profile_schema.OVERHEAD_FIELDS)
    assert 0 <= figures["action_s"] < 5 * MS
    assert 0 <= figures["iteration_s"] < 50 * MS
    assert 0 <= figures["param_s"] < 50e-9
    assert profile_overhead.measure_pipeline(m, 32, 1, torch.float32, torch.device("cpu"), 1, None,
                                             profile_model.measure_chunk) is None


def test_messages_are_counted_per_remote_hop_not_per_action():
    """ZB-V on 2 ranks: the V's turn (stages 1 -> 2 on rank 1) and W are local, so every F and B has one remote
    message and W none; 1F1B on 4 ranks: a middle stage's F receives and sends, two messages."""
    from llamapipe.core.pipeline_parallel.profile_costs import remote_messages
    from llamapipe.core.pipeline_parallel.schedule_specs import build
    zbv = build("zbv", 2, 2, 4)
    for rank in range(2):
        counts = {(a.kind, remote_messages(zbv, rank, a)) for a in zbv.actions[rank]}
        assert counts == {("F", 1), ("B", 1), ("W", 0)}, counts
    pp4 = build("1f1b", 4, 1, 4)
    assert {remote_messages(pp4, 1, a) for a in pp4.actions[1]} == {2}
    assert {remote_messages(pp4, 0, a) for a in pp4.actions[0]} == {1}

"""training/straggler.py: who is slowest and fastest, and who is named, from per-rank interval sums (no
processes: the end-to-end runs are in tests/e2e/test_e2e_straggler.py)."""
from __future__ import annotations

import random

import pytest

from llamapipe.core.pipeline_parallel.step_timers import StepTimers, robust_sum
from llamapipe.core.pipeline_parallel.schedule_ir import Action
from llamapipe.training.straggler import CONSECUTIVE, StragglerDetector, line_part

# pp 2 x dp 2, Megatron's order: ranks 0 and 1 replicate stage 0, ranks 2 and 3 stage 1
REPLICAS = [(("pp", 0),), (("pp", 0),), (("pp", 1),), (("pp", 1),)]


def _interval(actions_ms: list[float], expected: list[float]) -> list[dict]:
    return [{"actions": a / 1e3, "iterations": 1.0, "expected": e} for a, e in zip(actions_ms, expected)]


def test_a_rank_slowed_20_percent_is_named_after_consecutive_intervals_and_stages_compare_by_expected_cost():
    """Stage 1 costs twice stage 0 by the plan: at equal speed per expected cost nobody is slower; rank 3 at
    1.2x its replica is the slowest, named in the CONSECUTIVE-th interval in a row."""
    detector = StragglerDetector(REPLICAS, minmax_count=2, threshold=1.1)
    first = detector.fields(_interval([10.0, 10.0, 20.0, 24.0], [1.0, 1.0, 2.0, 2.0]))
    assert first["straggler_slowest_rank"] == 3 and first["straggler_ratio"] == pytest.approx(1.2)
    assert first["straggler_replica_ratio"] == pytest.approx(1.2)
    for _ in range(CONSECUTIVE - 2):
        assert detector.fields(_interval([10.0, 10.0, 20.0, 24.0], [1.0, 1.0, 2.0, 2.0]))["straggler_rank"] == -1
    assert first["straggler_rank"] == -1, "one interval names nobody"
    second = detector.fields(_interval([10.0, 10.0, 20.0, 24.0], [1.0, 1.0, 2.0, 2.0]))
    assert second["straggler_rank"] == 3 and second["straggler_named_ratio"] == pytest.approx(1.2)
    assert second["straggler_named_against"] == "replicas"
    assert [r for r, _ in second["straggler_slowest"]] == [3, 2] and len(second["straggler_fastest"]) == 2
    assert second["straggler_compute_ms"] == pytest.approx([10.0, 10.0, 20.0, 24.0])
    assert "STRAGGLER rank 3 (1.20x the compute of the fastest rank doing its work" in line_part(second)
    assert "slowest rank 3 1.20x fastest rank" in line_part(first) and "STRAGGLER" not in line_part(first)


def test_noise_under_the_threshold_and_a_different_rank_each_interval_name_nobody():
    rng = random.Random(0)
    detector = StragglerDetector(REPLICAS, threshold=1.1)
    for _ in range(30):
        ms = [10.0 * rng.uniform(0.96, 1.04) for _ in range(2)] + [20.0 * rng.uniform(0.96, 1.04) for _ in range(2)]
        assert detector.fields(_interval(ms, [1.0, 1.0, 2.0, 2.0]))["straggler_rank"] == -1
    # over the threshold, but never the same rank CONSECUTIVE times in a row
    for slow in (0, 2, 2, 1, 3, 3, 0, 2):
        ms = [10.0, 10.0, 20.0, 20.0]
        ms[slow] *= 1.3
        assert detector.fields(_interval(ms, [1.0, 1.0, 2.0, 2.0]))["straggler_rank"] == -1


def test_at_data_parallel_size_1_a_stage_is_named_only_well_past_its_expected_cost():
    stages = [(("pp", p),) for p in range(4)]
    detector = StragglerDetector(stages, threshold=1.1)
    for _ in range(CONSECUTIVE):      # 1.3x per expected cost: a model error, not a straggler
        fields = detector.fields(_interval([10.0, 10.0, 13.0, 10.0], [1.0, 1.0, 1.0, 1.0]))
    assert fields["straggler_rank"] == -1 and fields["straggler_slowest_rank"] == 2
    for _ in range(CONSECUTIVE):
        fields = detector.fields(_interval([10.0, 10.0, 20.0, 10.0], [1.0, 1.0, 1.0, 1.0]))
    assert fields["straggler_rank"] == 2 and fields["straggler_named_against"] == "stages"
    assert "STRAGGLER rank 2 (2.00x the fastest stage's compute per unit of the plan's expected cost" \
        in line_part(fields)


def test_the_timers_count_the_median_action_so_one_preempted_action_does_not_count():
    timers = StepTimers(1)
    timers.step_begin(plan=None, pp_rank=0, forward_only=False)
    for i, seconds in enumerate([0.010, 0.011, 0.009, 0.500]):      # one action descheduled for 0.5 s
        timers.action_done(Action("F", 0, i), 0.0, seconds, 0.0)
    timers.step_end((0, None))
    timers.mark()
    out = timers.interval()
    assert out["actions"] == pytest.approx(4 * 0.0105) and out["compute"] == pytest.approx(0.530)
    assert robust_sum({"F": [1.0, 3.0], "B": [2.0]}) == pytest.approx(2 * 2.0 + 2.0)


@pytest.mark.parametrize("flags, said", [
    (["--straggler-threshold", "1.0"], "--straggler-threshold 1.0 must be a ratio above 1"),
    (["--straggler-threshold", "nan"], "--straggler-threshold nan"),
    (["--straggler-minmax-count", "0"], "--straggler-minmax-count 0 must be at least 1"),
])
def test_bad_straggler_flags_are_one_line(flags, said):
    from llamapipe.training.arguments.parser import ArgumentError, build_parser, config_from_args
    from tests.unit.test_megatron_flags import BASE
    with pytest.raises(ArgumentError) as info:
        config_from_args(build_parser().parse_args(BASE + ["--log-straggler"] + flags), 1)
    assert said in str(info.value) and "\n" not in str(info.value)


def test_log_straggler_reaches_the_config_and_megatrons_controller_flags_are_notices():
    from llamapipe.training.arguments.megatron_compat import check_compat
    from llamapipe.training.arguments.parser import build_parser, config_from_args
    from tests.unit.test_megatron_flags import BASE
    args = build_parser().parse_args(BASE + ["--log-straggler", "--straggler-minmax-count", "3",
                                             "--disable-straggler-on-startup", "--straggler-ctrlr-port", "65535"])
    logging = config_from_args(args, 1).logging
    assert logging.log_straggler and logging.straggler_minmax_count == 3 and logging.straggler_threshold == 1.1
    notices = check_compat(args)
    assert any("--disable-straggler-on-startup has no effect" in n for n in notices)
    assert any("--straggler-ctrlr-port 65535 has no effect" in n for n in notices)


def test_straggler_options_without_log_straggler_are_notices(llamapipe_log):
    from llamapipe.training.arguments.parser import build_parser, config_from_args
    from tests.unit.test_megatron_flags import BASE
    config_from_args(build_parser().parse_args(BASE + ["--straggler-minmax-count", "3", "--straggler-threshold",
                                                       "1.2"]), 1)
    assert "notice: --straggler-minmax-count 3 has no effect without --log-straggler: no rank is compared" \
        in llamapipe_log
    assert "notice: --straggler-threshold 1.2 has no effect without --log-straggler: no rank is compared" \
        in llamapipe_log
    llamapipe_log.clear()
    config_from_args(build_parser().parse_args(BASE + ["--log-straggler", "--straggler-minmax-count", "3"]), 1)
    assert not [line for line in llamapipe_log if "straggler" in line]

"""What `plan --profile` charges beyond the passes (tools/profile_predict.py): on a CPU every tensor-parallel
collective pays the measured wait-and-wake-up of a blocking synchronisation, and ranks that oversubscribe the
cores share them only where they compute at the same time. Both against hand counts."""
from __future__ import annotations

import pytest

from llamapipe.core.pipeline_parallel.schedule_ir import Action
from llamapipe.core.pipeline_parallel.simulator import Result
from llamapipe.tools.parallel_estimate import Layout
from llamapipe.tools.profile_predict import contended, predict
from llamapipe.training.profile_schema import collective_sync_s
from tests.unit.test_profile_overhead import with_overhead
from tests.unit.test_profile_planner import MS, synthetic_profile


def timeline_result(rows: list[list[tuple[float, float]]]) -> Result:
    timeline = [[(s, e, Action("F", 0, i)) for i, (s, e) in enumerate(row)] for row in rows]
    return Result(makespan=max(e for row in rows for _, e in row), busy=[], span=[], bubble_rate=0.0,
                  makespan_bubble_rate=0.0, peak_memory=[], timeline=timeline)


def test_contention_stretches_only_the_intervals_where_ranks_compute_together():
    overlapping = timeline_result([[(0.0, 2.0)], [(1.0, 3.0)]])
    assert contended(overlapping, 1, 1.0) == pytest.approx(1 + 2 + 1)      # 1-2 ms: two ranks on one core
    assert contended(overlapping, 1, 2.0) == pytest.approx(3.0)            # enough cores: as simulated
    assert contended(overlapping, 2, 2.0) == pytest.approx(1 + 2 + 1)      # two replicas of each rank (tp or dp)
    in_turn = timeline_result([[(0.0, 1.0), (2.0, 3.0)], [(1.0, 2.0)]])
    assert contended(in_turn, 1, 1.0) == pytest.approx(3.0)                # a waiting rank does not compete


def test_pp4_on_two_cores_is_between_the_uncontended_and_the_fully_stretched_step():
    profile = synthetic_profile(num_layers=4)
    lay = Layout(1, 4, 1, 1, "1f1b", 1, "none", False, precision="fp32")
    alone = predict(profile, lay, 8, cores=4)
    shared = predict(profile, lay, 8, cores=2)
    assert alone.pipeline_s < shared.pipeline_s < 2 * alone.pipeline_s
    assert shared.slowdown == pytest.approx(shared.pipeline_s / alone.pipeline_s, rel=1e-9)


def test_every_tensor_parallel_collective_pays_the_measured_synchronisation_on_a_cpu():
    """tp 2 with --sequence-parallel on gloo, 2 layers, 4 microbatches: per microbatch each layer issues 4
    collectives in F and 6 in B, the embedding 1 + 1, the head 1 + 2 small in F and 2 in B: 27 in all, each
    0.25 ms (pipelined action 0.5 ms less a single-rank one 0.25 ms) more than without the wake-up."""
    lay = Layout(2, 1, 1, 1, "1f1b", 1, "none", False, precision="fp32")
    profile = with_overhead(synthetic_profile(num_layers=2))
    assert collective_sync_s(profile) == pytest.approx(0.25 * MS)
    lockstep = with_overhead(synthetic_profile(num_layers=2), pipeline_action_s=0.25 * MS)
    extra = predict(profile, lay, 4, cores=2).step_s - predict(lockstep, lay, 4, cores=2).step_s
    assert extra == pytest.approx(4 * 27 * 0.25 * MS, rel=1e-9)
    assert collective_sync_s({**profile, "device": "cuda"}) == 0.0

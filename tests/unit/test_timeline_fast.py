"""The simulator's fast timeline (`timeline_fast`, a table built once per plan) gives every action the same start
and end as the action-by-action reference loop, on every schedule, with offload, output-layer costs, slow
messages, late sends and staggered release times; and a deadlock is named the same way."""
import pytest

from llamapipe.core.pipeline_parallel.builders_seq import seq_1f1b, seq_zbv
from llamapipe.core.pipeline_parallel.offload_plan import with_offload
from llamapipe.core.pipeline_parallel.schedule_ir import Action, Plan, splits_backward
from llamapipe.core.pipeline_parallel.schedule_specs import SPECS, build
from llamapipe.core.pipeline_parallel.simulator import Costs, PlanError, reference_timeline, run_timeline

COSTS = [Costs(), Costs(f=1.0, b=2.1, w=0.7, comm=0.3, head_f=0.9, head_b=1.7),
         Costs(f=0.4, b=0.5, w=0.45, comm=1.3, offload=0.2)]


def _plans():
    for name, spec in SPECS.items():
        for pp in (2, 4):
            vpp = next(v for v in (1, 2, 3) if spec.accepts(v))
            yield f"{name}-p{pp}", build(name, pp, vpp, 2 * pp)
    zbv = build("zbv", 4, 2, 8)
    yield "zbv-offload-held", with_offload(zbv, 1, held=splits_backward(zbv))
    yield "interleaved-offload", with_offload(build("interleaved", 2, 2, 4), 2)
    yield "seq1f1b-k4", seq_1f1b(4, 4, 4)
    yield "seq-zbv-k2", seq_zbv(2, 4, 2)


@pytest.mark.parametrize("name,plan", list(_plans()), ids=lambda x: x if isinstance(x, str) else "")
def test_fast_timeline_equals_the_reference_loop(name, plan):
    for costs in COSTS:
        for early in (True, False):
            for release in (None, [0.5 * r for r in range(plan.pp)]):
                assert run_timeline(plan, costs, early, release) == reference_timeline(plan, costs, early, release)


def test_per_stage_costs_of_a_profile_time_each_action_by_its_stage():
    """profile_costs.StageCosts times each action by its virtual stage and its messages (the profile's
    prediction): the table asks it per rank, chunk and kind, as the reference loop does per action."""
    from llamapipe.core.pipeline_parallel.profile_costs import PassCosts, StageCosts
    plan = build("interleaved", 2, 2, 4)
    stages = tuple(PassCosts(1.0 + s, 1.5 + 0.3 * s, 0.7 + 0.1 * s, 1.0, 0.5) for s in range(4))
    costs = StageCosts(f=4.0, b=2.4, w=1.0, comm=0.2, stages=stages, action_s=0.01, message_s=0.05)
    assert run_timeline(plan, costs) == reference_timeline(plan, costs)
    assert run_timeline(plan, costs) != run_timeline(plan, Costs(f=4.0, b=2.4, w=1.0, comm=0.2))


def test_a_deadlock_is_named_by_both_paths():
    plan = Plan("x", 2, 1, 1, "interleaved", ((Action("B", 0, 0), Action("F", 0, 0)),
                                               (Action("F", 0, 0), Action("B", 0, 0))))
    with pytest.raises(PlanError) as fast:
        run_timeline(plan, Costs())
    with pytest.raises(PlanError) as slow:
        reference_timeline(plan, Costs())
    assert str(fast.value) == str(slow.value) and str(fast.value).startswith("deadlock: rank 0 action #0 B0")

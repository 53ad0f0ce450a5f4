"""Vocabulary parallelism as plan actions (arXiv 2411.05288): the S/T kinds, the simulator's checks of their
cross-rank dependencies and collective order, and the transform that inserts them into every schedule.

The reference for balance is arithmetic on the costs: without the split the last stage's rank carries the
whole output layer (m x (head_f + head_b)) on top of its share; with it every rank carries 1/pp of it."""
import dataclasses

import pytest

from llamapipe.core.pipeline_parallel.schedule_ir import Action, Plan, vocab_needs
from llamapipe.core.pipeline_parallel.schedule_specs import SPECS, build
from llamapipe.core.pipeline_parallel.simulator import Costs, PlanError, simulate, verify
from llamapipe.core.pipeline_parallel.simulator_iterations import simulate_iterations
from llamapipe.core.pipeline_parallel.visualize import ascii_timeline
from llamapipe.core.pipeline_parallel.vocab_parallel import with_vocab_parallel

COSTS = Costs(f=1.0, b=1.0, w=1.0, head_f=1.0, head_b=2.0, head_mem=1.0)


def _imbalance(result) -> float:
    return max(result.busy) / (sum(result.busy) / len(result.busy))


def test_vocab_needs_follow_the_paper_passes():
    n = 4
    assert vocab_needs("S", 1, n) == ("hidden", "F", 3)        # the last stage's hidden state, to every rank
    assert vocab_needs("T", 0, n).part == "S" and vocab_needs("T", 0, n).stage < 0   # every rank's S
    assert vocab_needs("B", 3, n).payload == "vgrad" and vocab_needs("BW", 3, n).part == "T"
    assert vocab_needs("B", 2, n) is None and vocab_needs("F", 3, n) is None and vocab_needs("W", 3, n) is None


@pytest.mark.parametrize("schedule", sorted(SPECS))
@pytest.mark.parametrize("pp,m", [(2, 4), (4, 8), (4, 6)])
def test_every_schedule_gets_balanced_deadlock_free_vocab_plan(schedule, pp, m):
    spec = SPECS[schedule]
    vpp = spec.default_chunks
    costs = dataclasses.replace(COSTS, head_f=COSTS.head_f * vpp, head_b=COSTS.head_b * vpp)
    base = build(schedule, pp, vpp, m)
    plan = build(schedule, pp, vpp, m, vocab_parallel=True)
    assert plan.vocab and not base.vocab
    for rank in range(pp):   # the schedule's own actions keep their order; S and T once per microbatch
        assert [a for a in plan.actions[rank] if a.kind not in "ST"] == list(base.actions[rank])
        for kind in "ST":
            assert [a.microbatch for a in plan.actions[rank] if a.kind == kind] == list(range(m))
    with_vp, without = simulate(plan, costs), simulate(base, costs)   # simulate verifies and finds deadlocks
    expected_mean = (sum(without.busy)) / pp
    assert sum(with_vp.busy) == pytest.approx(sum(without.busy))      # the same work, only moved
    assert max(with_vp.busy) == pytest.approx(expected_mean)          # every rank the mean: balanced
    assert _imbalance(without) > 1.3
    assert with_vp.makespan < without.makespan


def test_unit_cost_plans_keep_their_makespan_bound_and_the_memory_of_logits_split():
    plan = build("zb-h1", 4, 1, 16, vocab_parallel=True)
    result = simulate(plan, COSTS)
    assert result.makespan <= 1.1 * sum(result.busy) / 4 + 3 * 4    # near the balanced bound plus a ramp
    # a rank holds at most a few microbatches' logits shards (1/pp of one microbatch's logits each)
    logits_on_last = simulate(build("zb-h1", 4, 1, 16), COSTS).peak_memory[3]
    assert max(result.peak_memory) < logits_on_last + 1


def test_verify_rejects_collectives_in_different_orders():
    plan = build("1f1b", 2, 1, 2, vocab_parallel=True)
    own = [a for a in plan.actions[0] if a.kind not in "ST"]
    swapped = own + [Action("S", 0, 1), Action("S", 0, 0), Action("T", 0, 0), Action("T", 0, 1)]
    bad = dataclasses.replace(plan, actions=(tuple(swapped), plan.actions[1]))
    with pytest.raises(PlanError, match="collectives must run in one order"):
        verify(bad)


def test_verify_rejects_vocab_actions_out_of_place():
    plan = build("1f1b", 2, 1, 2, vocab_parallel=True)
    with pytest.raises(PlanError, match="needs a vocabulary-parallel plan"):
        verify(dataclasses.replace(plan, vocab=False))
    last = list(plan.actions[1])                       # rank 1 holds the last stage: its S before its own F
    s0 = last.index(Action("S", 0, 0))
    last.insert(0, last.pop(s0))
    with pytest.raises(PlanError, match="before its F of microbatch 0 on the same rank"):
        verify(dataclasses.replace(plan, actions=(plan.actions[0], tuple(last))))
    missing = tuple(a for a in plan.actions[0] if a != Action("T", 0, 1))
    with pytest.raises(PlanError, match="missing T for microbatch 1"):
        verify(dataclasses.replace(plan, actions=(missing, plan.actions[1])))


def test_simulator_finds_a_deadlock_on_the_collective():
    # rank 0 waits in BW0 for the gradient of rank 1's BW0, which needs every rank's T0 and so S0: rank 0's come
    # after its BW0, so each order is fine alone and the pair can never finish
    plan = build("1f1b", 2, 1, 1, vocab_parallel=True)
    r0 = [Action("F", 0, 0), Action("BW", 0, 0), Action("S", 0, 0), Action("T", 0, 0)]
    r1 = [Action("F", 0, 0), Action("S", 0, 0), Action("T", 0, 0), Action("BW", 0, 0)]
    verify(dataclasses.replace(plan, actions=(tuple(r0), tuple(r1))))
    with pytest.raises(PlanError, match="deadlock: rank 0 action #1 BW0 waits for B .*rank 1 action #2 T0 waits for S of microbatch 0 on every rank"):
        simulate(dataclasses.replace(plan, actions=(tuple(r0), tuple(r1))), COSTS)


def test_collective_waits_for_the_slowest_rank_and_comm():
    plan = build("1f1b", 2, 1, 1, vocab_parallel=True)
    costs = dataclasses.replace(COSTS, comm=0.5)
    timeline = simulate(plan, costs).timeline
    ends = {(rank, a.kind): (s, e) for rank, row in enumerate(timeline) for s, e, a in row}
    assert ends[(0, "S")][0] == pytest.approx(ends[(1, "F")][1] + 0.5)      # hidden state: one hop
    both_s = max(ends[(0, "S")][1], ends[(1, "S")][1])
    assert ends[(0, "T")][0] == pytest.approx(both_s + 0.5)                 # stats: after every rank's S
    both_t = max(ends[(0, "T")][1], ends[(1, "T")][1])
    assert ends[(1, "BW")][0] == pytest.approx(both_t + 0.5)                # summed input gradient


def test_plan_json_round_trip_and_iterations_and_picture():
    plan = build("zbv", 2, 2, 4, vocab_parallel=True)
    assert Plan.from_json(plan.to_json()) == plan
    iters = simulate_iterations(plan, COSTS, 2, post_validation=True)
    assert iters.time_per_iteration < simulate_iterations(build("zbv", 2, 2, 4), COSTS, 2,
                                                          post_validation=True).time_per_iteration
    text = ascii_timeline(plan, simulate(plan, COSTS))
    assert "S0" in text and "T3" in text


def test_plot_schedule_draws_the_vocab_actions(capsys, tmp_path):
    import json

    from llamapipe.tools.plot_schedule import main
    runs = {}
    for flags in (["--vocab-parallel"], []):
        assert main(["--schedule", "zbv", "--pp", "2", "--microbatches", "4", "--head-costs", "2,4", "--json"]
                    + flags) == 0
        runs[bool(flags)] = json.loads(capsys.readouterr().out)
    # the same work (head 2+4 per microbatch) split over two ranks instead of on rank 0: 37 against 48 units
    # (balanced bound: (4 x 2 chunks x 3 + 4 x 6) / 2 = 36)
    assert runs[True]["makespan"] == pytest.approx(37.0) and runs[False]["makespan"] == pytest.approx(48.0)
    assert main(["--schedule", "1f1b", "--pp", "2", "--microbatches", "2", "--vocab-parallel",
                 "--out", str(tmp_path / "p.png")]) == 0
    assert "S1" in capsys.readouterr().out and (tmp_path / "p.png").stat().st_size > 0
    assert main(["--schedule", "1f1b", "--pp", "2", "--microbatches", "2", "--head-costs", "x"]) != 0
    assert "--head-costs x must be two comma-separated numbers" in capsys.readouterr().err

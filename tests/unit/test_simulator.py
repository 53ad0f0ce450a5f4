"""The simulator: exact times on hand-computed plans, and a clear PlanError for each kind of bad plan."""
import pytest

from llamapipe.core.pipeline_parallel.schedule_ir import Action, Plan
from llamapipe.core.pipeline_parallel.simulator import Costs, PlanError, simulate

F, B, W, BW = (lambda c, mb, k=k: Action(k, c, mb) for k in ("F", "B", "W", "BW"))


def _plan(*ranks, vpp=1, m=1, placement="interleaved") -> Plan:
    return Plan("test", len(ranks), vpp, m, placement, tuple(tuple(r) for r in ranks))


def test_times_of_a_two_rank_plan_by_hand():
    """F 1, B 2, W 3, comm 0.5, BW fused: rank 0 F [0,1]; rank 1 F [1.5,2.5], BW [2.5,7.5]; rank 0 BW [8,13]."""
    costs = Costs(f=1, b=2, w=3, comm=0.5)
    result = simulate(_plan([F(0, 0), BW(0, 0)], [F(0, 0), BW(0, 0)]), costs, early_send=False)
    assert [(s, e) for s, e, _ in result.timeline[0]] == [(0, 1), (8, 13)]
    assert [(s, e) for s, e, _ in result.timeline[1]] == [(1.5, 2.5), (2.5, 7.5)]
    assert result.makespan == 13
    assert result.busy == [6, 6] and result.span == [13, 6]
    assert result.bubble_rate == pytest.approx((13 - 6) / 13)
    assert result.makespan_bubble_rate == pytest.approx(1 - 12 / 26)
    assert result.peak_memory == [1, 1]


def test_bw_sends_its_gradient_after_its_b_part():
    """As the executor runs it: rank 1's BW [2.5,7.5] sends at 4.5, so rank 0's BW runs [5,10]."""
    costs = Costs(f=1, b=2, w=3, comm=0.5)
    result = simulate(_plan([F(0, 0), BW(0, 0)], [F(0, 0), BW(0, 0)]), costs)
    assert [(s, e) for s, e, _ in result.timeline[0]] == [(0, 1), (5, 10)]
    assert [(s, e) for s, e, _ in result.timeline[1]] == [(1.5, 2.5), (2.5, 7.5)]
    assert result.makespan == 10


def test_memory_model_b_frees_m_b_minus_m_w_and_w_the_rest():
    """Two F's (+1 each), a B (-(1-0.25)), the other F's B, then both W's (-0.25 each): peak 2, end 0."""
    costs = Costs(w_mem=0.25)
    plan = _plan([F(0, 0), F(0, 1), B(0, 0), B(0, 1), W(0, 0), W(0, 1)], m=2)
    result = simulate(plan, costs)
    assert result.peak_memory == [2]
    assert sum(costs.mem_delta(a.kind) for a in plan.actions[0]) == 0


def test_v_placement_hands_off_locally_without_comm():
    """pp=1, two V chunks: stage 0 -> stage 1 on the same rank costs no comm."""
    plan = _plan([F(0, 0), F(1, 0), B(1, 0), B(0, 0), W(1, 0), W(0, 0)], vpp=2, placement="v")
    assert simulate(plan, Costs(comm=10)).makespan == 6


@pytest.mark.parametrize("ranks,kw,message", [
    ([[F(0, 0), B(0, 0)]], {}, r"rank 0: missing W for chunk 0 microbatch 0"),
    ([[F(0, 0), F(0, 0), BW(0, 0)]], {}, r"rank 0 action #1 F0: duplicated F"),
    ([[BW(0, 0), F(0, 0)]], {}, r"rank 0 action #0 BW0: B before its F"),
    ([[F(0, 0), W(0, 0), B(0, 0)]], {}, r"rank 0 action #1 W0: W before its B"),
    ([[F(0, 0), B(0, 0), W(0, 0), BW(0, 0)]], {}, r"rank 0 action #3 BW0: duplicated B"),
    ([[F(0, 0), BW(0, 0)], [F(0, 0), BW(0, 0), F(0, 1)]], {}, r"rank 1 action #2 F1: .*out of range"),
    ([[F(0, 0), F(0, 1), BW(0, 0), BW(0, 1)], [F(0, 1), F(0, 0), BW(0, 1), BW(0, 0)]], {"m": 2},
     r"rank 1 action #0 F1: receives microbatch 1 but rank 0 sends microbatch 0 first"),
    ([[F(0, 0), F(1, 0), B(0, 0), B(1, 0), W(0, 0), W(1, 0)]], {"vpp": 2, "placement": "v"},
     r"rank 0 action #2 B0: B before the next stage's B on the same rank"),
    ([[F(1, 0), F(0, 0), BW(1, 0), BW(0, 0)]], {"vpp": 2, "placement": "v"},
     r"rank 0 action #0 F0c1: F before the previous stage's F"),
])
def test_invalid_plans_name_rank_and_action(ranks, kw, message):
    with pytest.raises(PlanError, match=message):
        simulate(_plan(*ranks, **kw))


def test_cross_rank_deadlock_names_every_stuck_rank():
    """Rank 0 waits for rank 1's gradient of microbatch 0 before sending microbatch 1's activation,
    while rank 1 waits for that activation before computing the gradient."""
    plan = _plan([F(0, 0), BW(0, 0), F(0, 1), BW(0, 1)], [F(0, 0), F(0, 1), BW(0, 0), BW(0, 1)], m=2)
    with pytest.raises(PlanError, match=r"deadlock: rank 0 action #1 BW0 waits for B of stage 1 microbatch 0 "
                                        r"from rank 1; rank 1 action #1 F1 waits for F of stage 0"):
        simulate(plan)


def test_two_ranks_each_receiving_first_deadlock():
    """pp=2, vpp=2 interleaved: each rank starts with a chunk that needs the other rank's output."""
    plan = _plan([F(1, 0), F(0, 0), BW(1, 0), BW(0, 0)], [F(1, 0), F(0, 0), BW(1, 0), BW(0, 0)], vpp=2)
    with pytest.raises(PlanError, match=r"deadlock: rank 0 action #0 F0c1 .*; rank 1 action #0 F0c1"):
        simulate(plan)


@pytest.mark.parametrize("kw", [{"f": 0}, {"b": -1}, {"w": -0.1}, {"comm": -1}, {"w_mem": 2}])
def test_bad_costs_are_rejected(kw):
    with pytest.raises(ValueError):
        Costs(**kw)

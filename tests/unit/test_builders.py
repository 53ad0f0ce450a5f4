"""Every schedule builder, checked through the simulator against the papers' closed-form numbers.

References: 1F1B and interleaved bubble time from Narayanan et al. (arXiv 2104.04473, section 2.2);
ZB-H1/H2 bubble and peak memory from Qi et al. (arXiv 2401.10241, section 3 and Table 2).
Unit costs F=B=W=1, comm 0, M_B=1, M_W=0.5 unless stated.
"""
import random

import pytest

from llamapipe.core.pipeline_parallel.auto_plan import plan_auto as auto, zb_h2_fitted
from llamapipe.core.pipeline_parallel.builders import gpipe, interleaved, one_f_one_b, zb_h1, zb_h2, zbv
from llamapipe.core.pipeline_parallel.schedule_specs import build
from llamapipe.core.pipeline_parallel.schedule_ir import Action, Plan
from llamapipe.core.pipeline_parallel.simulator import Costs, simulate
from llamapipe.training.flag_names import worded_as_flags

UNIT = Costs()


def _microbatch_counts(pp: int) -> list[int]:
    # every m from pp to 4*pp for small pp; for larger pp the boundary and non-divisible cases
    if pp <= 4:
        return list(range(pp, 4 * pp + 1))
    return sorted({pp, pp + 1, 2 * pp - 1, 2 * pp, 3 * pp + 1, 4 * pp})


def _cases(pp: int) -> list[tuple[str, int]]:
    return ([("1f1b", 1), ("gpipe", 1), ("zb-h1", 1), ("zb-h2", 1), ("zbv", 2), ("auto", 1), ("auto", 2)]
            + [("interleaved", v) for v in (2, 3, 4)])


@pytest.mark.parametrize("pp", range(1, 9))
def test_every_builder_verifies(pp):
    """simulate() verifies: F/B/W once each and in order, stream order, no deadlock."""
    for m in _microbatch_counts(pp):
        for name, vpp in _cases(pp):
            plan = build(name, pp, vpp, m)
            assert (plan.name, plan.pp, plan.vpp, plan.num_microbatches) == (name, pp, vpp, m)
            result = simulate(plan, UNIT)
            work = m * vpp * 3   # every rank does F, B and W of every (chunk, microbatch) once
            assert result.busy == pytest.approx([work] * pp)


@pytest.mark.parametrize("pp,m", [(2, 2), (4, 8), (4, 16), (8, 8), (8, 24), (3, 7)])
def test_1f1b_bubble_rate_is_the_megatron_formula(pp, m):
    """With BW fused as in Megatron (early_send=False): the paper's formula."""
    result = simulate(one_f_one_b(pp, m), UNIT, early_send=False)
    assert result.bubble_rate == pytest.approx((pp - 1) * 3 / (m * 3 + (pp - 1) * 3), abs=1e-12)
    assert result.makespan == pytest.approx(3 * (m + pp - 1))


@pytest.mark.parametrize("pp,m", [(2, 2), (2, 4), (4, 8), (8, 8), (3, 7)])
def test_early_gradient_send_saves_one_w_per_hop_in_1f1b(pp, m):
    """Our executor sends a BW's input gradient before its W part: 1F1B's makespan drops by (p-1)*W."""
    rng = random.Random(pp * 100 + m)
    for _ in range(5):
        costs = Costs(f=rng.uniform(0.5, 2), b=rng.uniform(0.5, 2), w=rng.uniform(0.1, 2))
        fused = simulate(one_f_one_b(pp, m), costs, early_send=False)
        early = simulate(one_f_one_b(pp, m), costs)
        assert early.makespan == pytest.approx(fused.makespan - (pp - 1) * costs.w)
        assert early.busy == pytest.approx(fused.busy) and early.peak_memory == fused.peak_memory


@pytest.mark.parametrize("pp,vpp,m", [(2, 2, 4), (4, 2, 8), (4, 3, 16), (4, 4, 8), (8, 2, 16), (3, 4, 9)])
def test_interleaved_bubble_time_is_one_over_vpp_of_1f1b(pp, vpp, m):
    """Megatron: bubble time (p-1)(t_f+t_b)/v for m % p == 0, where 1F1B runs a whole rank's layers
    (chunk costs x vpp) and interleaved runs chunks of cost 1."""
    whole_rank = Costs(f=vpp, b=vpp, w=vpp)
    base = simulate(one_f_one_b(pp, m), whole_rank, early_send=False)
    inter = simulate(interleaved(pp, vpp, m), UNIT, early_send=False)
    base_bubble = base.makespan - 3 * vpp * m
    assert base_bubble == pytest.approx((pp - 1) * 3 * vpp)
    assert inter.makespan - 3 * vpp * m == pytest.approx(base_bubble / vpp)


@pytest.mark.parametrize("pp,vpp", [(4, 2), (3, 3), (8, 4), (5, 2)])
def test_interleaved_without_divisible_microbatches_beats_1f1b(pp, vpp):
    """Megatron cannot run m % pp != 0; ours stays valid and still has less bubble than 1F1B."""
    for m in range(pp + 1, 4 * pp):
        if m % pp:
            inter = simulate(interleaved(pp, vpp, m), UNIT)
            base = simulate(one_f_one_b(pp, m), Costs(f=vpp, b=vpp, w=vpp))
            assert inter.makespan < base.makespan


@pytest.mark.parametrize("pp,m", [(2, 4), (4, 8), (4, 16), (6, 12), (8, 16)])
def test_zb_h1_bubble_is_a_third_of_1f1b(pp, m):
    """ZB paper: ZB-H1 bubble (p-1)(T_F+T_B-T_W) vs 1F1B's (p-1)(T_F+T_B+T_W)."""
    h1 = simulate(zb_h1(pp, m), UNIT)
    base = simulate(one_f_one_b(pp, m), UNIT, early_send=False)
    h1_bubble = max(h1.span) - max(h1.busy)
    assert h1_bubble == pytest.approx((pp - 1) * (1 + 1 - 1))
    assert h1_bubble == pytest.approx((max(base.span) - max(base.busy)) / 3)


def test_zb_h1_order_matches_the_papers_figure():
    """Figure 3 of the ZB paper, last stage of p=4: F B alternating, W of microbatch 0 after B3."""
    last = zb_h1(4, 8).actions[3]
    assert [str(a) for a in last[:12]] == ["F0", "B0", "F1", "B1", "F2", "B2", "F3", "B3", "W0", "F4", "B4", "W1"]
    assert [str(a) for a in zb_h1(4, 8).actions[0][:7]] == ["F0", "F1", "F2", "F3", "B0", "W0", "F4"]


@pytest.mark.parametrize("name,vpp,limit", [("zb-h2", 1, None), ("zbv", 2, None), ("auto", 1, 8), ("auto", 2, 8)])
def test_zero_bubble_schedules_reach_under_one_percent(name, vpp, limit):
    result = simulate(build(name, 4, vpp, 16, mem_limit=limit), UNIT)
    assert result.bubble_rate <= 0.01


@pytest.mark.parametrize("pp,m", [(2, 4), (4, 8), (4, 16), (8, 16)])
def test_peak_memory_matches_the_papers_table(pp, m):
    """Activation units per rank (M_B=1, M_W=0.5): 1F1B rank r holds p-r microbatches; ZB-H1 rank r
    holds (p-r) M_B + r M_W, so p on rank 0 as 1F1B; ZB-H2 (2p-1) M_B; GPipe m; ZB-V 2p chunk units
    (p whole-rank microbatches, as 1F1B)."""
    assert simulate(one_f_one_b(pp, m), UNIT).peak_memory == [pp - r for r in range(pp)]
    assert simulate(zb_h1(pp, m), UNIT).peak_memory == [(pp - r) + 0.5 * r for r in range(pp)]
    assert max(simulate(zb_h2(pp, m), UNIT).peak_memory) == 2 * pp - 1
    assert simulate(gpipe(pp, m), UNIT).peak_memory == [m] * pp
    assert max(simulate(zbv(pp, m), UNIT).peak_memory) == 2 * pp


@pytest.mark.parametrize("pp,vpp,m", [(4, 2, 8), (4, 3, 8), (2, 4, 4), (8, 2, 16)])
def test_interleaved_peak_memory_is_megatron_warmup_plus_one(pp, vpp, m):
    """Rank r holds its 2(p-r-1) + (v-1)p warmup forwards plus one (capped at all m*v)."""
    peaks = simulate(interleaved(pp, vpp, m), UNIT).peak_memory
    assert peaks == [min(2 * (pp - r - 1) + (vpp - 1) * pp + 1, m * vpp) for r in range(pp)]


def test_auto_respects_memory_limit_and_never_loses_to_1f1b():
    rng = random.Random(1234)
    for _ in range(40):
        pp, vpp = rng.randint(2, 6), rng.choice([1, 2])
        m = rng.randint(pp, 3 * pp)
        costs = Costs(f=rng.uniform(0.5, 2), b=rng.uniform(0.5, 2), w=rng.uniform(0.2, 2),
                      comm=rng.uniform(0, 0.3), w_mem=rng.uniform(0, 1))
        limit = max(vpp, rng.choice([1, pp / 2, pp, 1.5 * pp, 2 * pp, 3 * pp]))
        result = simulate(auto(pp, vpp, m, costs, limit), costs)
        assert max(result.peak_memory) <= limit + 1e-9
        if vpp == 1 and limit >= pp:   # 1F1B fits in the limit, so auto must be at least as fast
            assert result.makespan <= simulate(one_f_one_b(pp, m), costs).makespan + 1e-9


def test_auto_plan_survives_json_round_trip():
    costs = Costs(f=1.0, b=2.0, w=1.5, comm=0.2)
    plan = auto(4, 1, 12, costs)
    again = Plan.from_json(plan.to_json())
    assert again == plan
    assert simulate(again, costs).makespan == simulate(plan, costs).makespan


def test_single_rank_plans_run_in_microbatch_order():
    assert one_f_one_b(1, 2).actions == ((Action("F", 0, 0), Action("BW", 0, 0), Action("F", 0, 1),
                                          Action("BW", 0, 1)),)
    for name, vpp in _cases(1):
        assert simulate(build(name, 1, vpp, 3), UNIT).bubble_rate == 0


@pytest.mark.parametrize("call,match", [
    (lambda: build("pipedream", 4, 1, 8), "unknown"),
    (lambda: build("1f1b", 4, 2, 8), "one model chunk"),
    (lambda: build("zbv", 4, 3, 8), "exactly 2"),
    (lambda: build("auto", 4, 3, 8), "1 or 2"),
    (lambda: auto(4, 2, 8, mem_limit=1.5), "memory-limit 1.5 is below the 2"),
    (lambda: gpipe(4, 0), "at least 1"),
])
def test_bad_requests_raise_one_sentence(call, match):
    with pytest.raises(ValueError, match=match), worded_as_flags():
        call()


@pytest.mark.parametrize("f,b,w", [(1, 1.3, 0.7), (1, 2, 1), (1, 1, 0.5), (59, 76, 39)])
def test_zbv_beats_zb_h1_when_costs_are_not_equal(f, b, w):
    """ZB-V's fixed order keeps the V full for any F:B:W ratio (a list schedule made at unit costs does
    not): for m >= 2p it is faster than ZB-H1 and 1F1B under the same per-rank work and memory."""
    for pp in (2, 3, 4, 8):
        for m in (2 * pp, 4 * pp):
            whole_rank, chunk = Costs(f=f, b=b, w=w), Costs(f=f / 2, b=b / 2, w=w / 2, act_mem=0.5, w_mem=0.25)
            v = simulate(zbv(pp, m), chunk)
            assert max(v.peak_memory) == pytest.approx(pp)
            assert v.makespan < simulate(zb_h1(pp, m), whole_rank).makespan
            assert v.makespan < simulate(one_f_one_b(pp, m), whole_rank).makespan


def test_zb_h2_fitted_stays_in_its_cap_and_never_loses_to_the_fixed_plans():
    """zb-h2 fitted to measured costs holds at most 2p-1 microbatches and is never slower than the
    unit-cost ZB-H2 (when it fits: with M_W near M_B its W tail can hold more), ZB-H1 or 1F1B."""
    rng = random.Random(4321)
    for _ in range(40):
        pp = rng.randint(2, 6)
        m = rng.randint(pp, 3 * pp)
        costs = Costs(f=rng.uniform(0.5, 2), b=rng.uniform(0.5, 2.5), w=rng.uniform(0.2, 2),
                      comm=rng.uniform(0, 0.3), w_mem=rng.uniform(0, 1))
        result = simulate(zb_h2_fitted(pp, m, costs), costs)
        assert max(result.peak_memory) <= 2 * pp - 1 + 1e-9
        for fixed in (simulate(p, costs) for p in (zb_h2(pp, m), zb_h1(pp, m), one_f_one_b(pp, m))):
            if max(fixed.peak_memory) <= 2 * pp - 1 + 1e-9:
                assert result.makespan <= fixed.makespan + 1e-9


def test_zb_h2_fitted_keeps_its_edge_when_b_is_twice_w():
    """With this repository's LLaMA ratio (F:B:W about 1:1.5:0.6) the unit-cost ZB-H2 is slower than
    1F1B at p=2, m=8; the plan fitted to those costs is faster; at unit costs both are the paper's plan."""
    costs = Costs(f=1.0, b=1.5, w=0.6)
    base = simulate(one_f_one_b(2, 8), costs).makespan
    assert simulate(zb_h2(2, 8), costs).makespan > 1.03 * base
    fitted = build("zb-h2", 2, 1, 8, costs=costs)
    assert fitted.name == "zb-h2" and simulate(fitted, costs).makespan < 0.96 * base
    assert simulate(build("zb-h2", 4, 1, 16, costs=UNIT), UNIT).bubble_rate <= 0.01


@pytest.mark.parametrize("m", [4, 6, 8, 16])
def test_zbv_meets_the_pipeline_fill_lower_bound_at_pp2(m):
    # Rank 1 cannot start before the first chunk's F, and then has m (F + B + W) of work: no plan beats
    # m (F + B + W) + F / vpp. With F = B = W and no comm, ZB-V reaches it once m >= 2p, so at m = 4 no
    # plan with at most two chunks per rank comes within 1/24 of the ideal m (F + B + W).
    bound = m * 3 + 0.5
    costs = Costs(f=0.5, b=0.5, w=0.5, act_mem=0.5, w_mem=0.25)
    assert simulate(zbv(2, m), costs).makespan == pytest.approx(bound)
    for name, vpp in [("1f1b", 1), ("interleaved", 2), ("zb-h1", 1), ("zb-h2", 1)]:
        c = Costs(f=1 / vpp, b=1 / vpp, w=1 / vpp, act_mem=1 / vpp, w_mem=0.5 / vpp)
        assert simulate(build(name, 2, vpp, m), c).makespan >= bound - 1e-9, name

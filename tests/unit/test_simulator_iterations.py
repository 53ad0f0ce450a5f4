"""K chained iterations (simulator_iterations.py) against independent references: a synchronous step
costs one iteration's makespan plus the optimizer step; post-validation is never slower, never below a
rank's busy time, and lets the next iteration start on a rank before the last rank has finished.
Also `llamapipe plot-schedule --iterations`. Unit costs F=B=W=1, comm 0 unless stated."""
import json
import random

import pytest

from llamapipe.core.pipeline_parallel.builders import one_f_one_b, zb_h1, zb_h2, zbv
from llamapipe.core.pipeline_parallel.schedule_ir import Action, Plan
from llamapipe.core.pipeline_parallel.simulator import Costs, simulate
from llamapipe.core.pipeline_parallel.simulator_iterations import simulate_iterations
from llamapipe.tools import plot_schedule

F, B, W = (lambda mb, k=k: Action(k, 0, mb) for k in "FBW")


def test_two_rank_plan_by_hand():
    """pp=2, one microbatch, F 1, B 2, W 3, comm 0.5, optimizer step 1. Iteration 1: rank 0 F [0,1], rank 1
    F [1.5,2.5] B [2.5,4.5] W [4.5,7.5], rank 0 B [5,7] W [7,10]. Synchronous: all step at 10, iteration 2
    starts at 11 and ends at 21 + 1. Post-validation: rank 0 steps at 10, starts at 11; rank 1 steps at
    7.5 but waits for F until 12.5: the same dependency chain, so both end as before."""
    plan = Plan("t", 2, 1, 1, "interleaved", ((F(0), B(0), W(0)), (F(0), B(0), W(0))))
    costs = Costs(f=1, b=2, w=3, comm=0.5)
    sync = simulate_iterations(plan, costs, 2, optimizer_step=1)
    assert [(s, e) for s, e, _ in sync.result.timeline[0]] == [(0, 1), (5, 7), (7, 10), (11, 12), (16, 18),
                                                                 (18, 21)]
    assert sync.iteration_end == [11, 22] and sync.time_per_iteration == 11
    assert sync.optimizer[1] == [(10, 11, 0), (21, 22, 1)]
    pv = simulate_iterations(plan, costs, 2, post_validation=True, optimizer_step=1)
    assert pv.optimizer[1] == [(7.5, 8.5, 0), (18.5, 19.5, 1)]
    assert [(s, e) for s, e, _ in pv.result.timeline[1][3:]] == [(12.5, 13.5), (13.5, 15.5), (15.5, 18.5)]
    assert pv.iteration_end == [11, 22]


@pytest.mark.parametrize("plan", [one_f_one_b(4, 8), zb_h1(4, 8), zb_h2(4, 12), zbv(2, 4), zbv(4, 8)],
                         ids=lambda p: p.name)
@pytest.mark.parametrize("opt", [0.0, 0.7])
def test_synchronous_step_costs_makespan_plus_optimizer(plan, opt):
    costs = Costs(f=1.0, b=1.3, w=0.6, comm=0.1)
    one = simulate(plan, costs)
    iters = simulate_iterations(plan, costs, 4, optimizer_step=opt)
    assert iters.time_per_iteration == pytest.approx(one.makespan + opt, abs=1e-9)
    assert iters.iteration_end == pytest.approx([(k + 1) * (one.makespan + opt) for k in range(4)], abs=1e-9)
    assert iters.result.busy == pytest.approx([4 * b for b in one.busy])


@pytest.mark.parametrize("m", [4, 8])
def test_zbv_with_post_validation_has_no_bubble_at_unit_costs(m):
    """ZB-V p=2 at unit chunk costs: a synchronous step pays the fill ramp (makespan = busy + 1 F), with
    post-validation the steady state is the busy time 2 chunks x m x 3, the lower bound."""
    busy = 2 * m * 3
    assert simulate_iterations(zbv(2, m), Costs(), 4).time_per_iteration == pytest.approx(busy + 1)
    assert simulate_iterations(zbv(2, m), Costs(), 4, post_validation=True).time_per_iteration == \
        pytest.approx(busy)


def test_post_validation_interleaves_iterations():
    """ZB-H2 p=4 m=16: rank 0 starts iteration 2 before rank 3 has finished iteration 1."""
    iters = simulate_iterations(zb_h2(4, 16), Costs(), 2, post_validation=True)
    first_of_2 = min(s for (s, _, _), k in zip(iters.result.timeline[0], iters.iteration_of[0]) if k == 1)
    last_of_1 = max(e for (_, e, _), k in zip(iters.result.timeline[3], iters.iteration_of[3]) if k == 0)
    assert first_of_2 < last_of_1
    assert iters.time_per_iteration == pytest.approx(48)      # 16 x 3: no bubble in the steady state


def test_post_validation_is_never_slower_and_never_below_busy():
    rng = random.Random(99)
    for _ in range(30):
        pp = rng.randint(2, 5)
        m = rng.randint(pp, 3 * pp)
        costs = Costs(f=rng.uniform(0.5, 2), b=rng.uniform(0.5, 2), w=rng.uniform(0.1, 2), comm=rng.uniform(0, 0.3))
        opt = [rng.uniform(0, 1) for _ in range(pp)]
        plan = rng.choice([one_f_one_b(pp, m), zb_h1(pp, m), zb_h2(pp, m), zbv(pp, m)])
        sync = simulate_iterations(plan, costs, 3, optimizer_step=opt)
        pv = simulate_iterations(plan, costs, 3, post_validation=True, optimizer_step=opt)
        busy = max(simulate(plan, costs).busy)
        assert busy - 1e-9 <= pv.time_per_iteration <= sync.time_per_iteration + 1e-9
        for rank, steps in enumerate(pv.optimizer):     # a rank starts iteration k+1 only after its step
            starts = [min(s for (s, _, _), k in zip(pv.result.timeline[rank], pv.iteration_of[rank]) if k == it)
                      for it in (1, 2)]
            assert all(start >= end - 1e-9 for start, (_, end, _) in zip(starts, steps))


@pytest.mark.parametrize("call,match", [
    (lambda: simulate_iterations(zbv(2, 4), iterations=0), "at least 1"),
    (lambda: simulate_iterations(zbv(2, 4), optimizer_step=[1.0]), "one per pipeline rank"),
])
def test_bad_arguments_raise_one_sentence(call, match):
    with pytest.raises(ValueError, match=match):
        call()


def test_plot_schedule_draws_interleaved_iterations(tmp_path, capsys):
    out = tmp_path / "zbv.png"
    args = ["--schedule", "zbv", "--pp", "2", "--microbatches", "4", "--iterations", "3", "--out", str(out)]
    assert plot_schedule.main(args + ["--post-validation"]) == 0
    text = capsys.readouterr().out
    assert out.read_bytes().startswith(b"\x89PNG")
    assert "f0c1" in text and "F0c1" in text               # odd iterations in lower case
    assert "post-validation (each rank steps and goes on alone): time per iteration 24.00" in text
    assert plot_schedule.main(args + ["--json", "--optimizer-step", "1"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["iterations"] == 3 and not data["post_validation"]
    assert data["time_per_iteration"] == pytest.approx(data["makespan"] + 1)

"""DualPipeV (builders_dualpipe.py) against torch.distributed.pipelining's ScheduleDualPipeV, the simulator, and
the bubble and memory figures docs/schedules.md gives on the zero-bubble paper's cost settings."""
import dataclasses
from types import SimpleNamespace

import pytest
from torch.distributed.pipelining import schedules as torch_schedules

from llamapipe.core.pipeline_parallel.builders_dualpipe import dualpipev
from llamapipe.core.pipeline_parallel.schedule_specs import SPECS, build
from llamapipe.core.pipeline_parallel.simulator import Costs, peak_memory, simulate
from tests.unit.test_auto_schedule_paper import ROWS, _costs

_KIND = {torch_schedules.FORWARD: "F", torch_schedules.BACKWARD_INPUT: "B", torch_schedules.BACKWARD_WEIGHT: "W",
         torch_schedules.FULL_BACKWARD: "BW"}


def torch_order(pp: int, m: int, rank: int) -> list[tuple[str, int, int]]:
    """torch's own order for `rank` as (kind, local chunk, microbatch); an overlapped F&B is its F then its
    backward, as torch's runtime runs it without a custom overlap function."""
    schedule = SimpleNamespace(pp_group_size=pp, _n_microbatches=m)
    out = []
    for action in torch_schedules.ScheduleDualPipeV._calculate_single_rank_operations(schedule, rank):
        parts = action.sub_actions if action.computation_type == torch_schedules.OVERLAP_F_B else (action,)
        out += [(_KIND[a.computation_type], 0 if a.stage_index == rank else 1, a.microbatch_index) for a in parts]
    return out


@pytest.mark.parametrize("pp", [1, 2, 3, 4, 5, 8])
def test_order_is_torchs_schedule_dualpipev(pp):
    for m in (2 * pp, 2 * pp + 1, 3 * pp + 2):
        plan = dualpipev(pp, m)
        assert [[tuple(a) for a in acts] for acts in plan.actions] == [torch_order(pp, m, r) for r in range(pp)]


@pytest.mark.parametrize("pp", [1, 2, 3, 4, 6, 8])
def test_plans_verify_for_many_sizes(pp):
    """Every F, B, W once and in order, streams in order, no deadlock, below torch's m >= 2p too (padded)."""
    for m in sorted({1, 2, pp, 2 * pp - 1, 2 * pp, 3 * pp + 1}):
        plan = dualpipev(pp, m)
        assert (plan.vpp, plan.placement, plan.name, plan.num_microbatches) == (2, "v", "dualpipev", m)
        simulate(plan, Costs(f=1.0, b=1.7, w=0.6, comm=0.2))
    assert SPECS["dualpipev"].placement(2) == "v" and build("dualpipev", pp, 2, 2 * pp) == dualpipev(pp, 2 * pp)


@pytest.mark.parametrize("pp", [2, 4, 8, 16])
def test_peak_memory_is_one_microbatch_chunk_above_zbv(pp):
    """Under the paper's memory model (M_W = M_B) DualPipeV holds 2p+1 chunk units on its busiest rank, one more
    than ZB-V's 2p (DualPipe's 'PP+1' activations)."""
    m = 3 * pp
    paper = Costs(w_mem=1.0)
    assert max(peak_memory(dualpipev(pp, m), paper)) == 2 * pp + 1
    assert max(peak_memory(build("zbv", pp, 2, m), paper)) == 2 * pp


# docs/schedules.md, "DualPipeV": simulated bubble rate on the zero-bubble paper's settings (Table 9 costs, a V
# chunk half a stage): ZB-V, V-Half, DualPipeV
DOCS = {("1.5B", 24): (0.0728, 0.2011, 0.0879), ("6.2B", 64): (0.0183, 0.0780, 0.0289),
        ("14.6B", 48): (0.0518, 0.1902, 0.0806), ("28.3B", 256): (0.0224, 0.0834, 0.0350)}


@pytest.mark.parametrize("row", [r for r in ROWS if (r[0], r[2]) in DOCS], ids=lambda r: f"{r[0]}-m{r[2]}")
def test_bubble_on_the_papers_settings_is_between_zbv_and_v_half(row):
    model, p, m, f, b, w, comm = row[:7]
    chunk = dataclasses.replace(_costs(model, f, b, w, comm), f=f / 2, b=b / 2, w=w / 2)
    rates = tuple(simulate(build(name, p, 2, m), chunk).bubble_rate for name in ("zbv", "v-half", "dualpipev"))
    assert rates == pytest.approx(DOCS[(model, m)], abs=5e-5)
    assert rates[0] < rates[2] < rates[1]


def test_plot_schedule_draws_it(tmp_path, capsys):
    import json
    from llamapipe.tools.plot_schedule import main
    assert main(["--schedule", "dualpipev", "--pp", "4", "--microbatches", "8", "--costs", "0.5,0.5,0.5", "--json",
                 "--out", str(tmp_path / "dualpipev.svg")]) == 0
    data = json.loads(capsys.readouterr().out)
    assert (tmp_path / "dualpipev.svg").stat().st_size > 0 and data["vpp"] == 2
    assert data["bubble_rate"] == pytest.approx(simulate(dualpipev(4, 8), Costs(0.5, 0.5, 0.5)).bubble_rate)

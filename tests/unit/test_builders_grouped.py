"""Grouped interleaved 1F1B (Megatron's microbatch groups, the zero-bubble fork's group-interleaved) and 1F1B-V
(builders_grouped.py) against the simulator and independent closed forms.

References: Megatron-LM's get_schedule_table and warmup count (megatron/core/pipeline_parallel/schedules.py), the
interleaved builder as it was before groups (copied below), and the building-block memory rule of Qi et al.
(arXiv 2405.15362): a repeated block's peak is its live intervals at the busiest slot; numbers of the fork's own
orders (its scheduler code run once outside the tests: our orders equal its orders for p = 2..8, v = 2..4, every
group, m = p..4p). Memory is counted in
whole-stage microbatches (a chunk unit is 1/vpp of a stage) with M_W = 0, as a fused BW frees everything.
"""
import pytest

from llamapipe.core.config import ConfigError
from llamapipe.core.pipeline_parallel import builders
from llamapipe.core.pipeline_parallel.builders_grouped import (fork_min_group, group_interleaved, one_f_one_b_v,
                                                               v1f1b_pattern)
from llamapipe.core.pipeline_parallel.schedule_ir import Action
from llamapipe.core.pipeline_parallel.schedule_specs import SPECS, build
from llamapipe.core.pipeline_parallel.simulator import Costs, peak_memory, simulate

FUSED = Costs(w_mem=0.0)


def _stage_costs(vpp: int) -> Costs:
    """A chunk holds 1/vpp of a stage: its F, B and memory are that share (fused BW: W ~ 0)."""
    return Costs(f=1.0 / vpp, b=2.0 / vpp, w=1e-9, w_mem=0.0)


def _old_interleaved(pp: int, vpp: int, m: int) -> tuple:
    """The interleaved builder before microbatch groups (commit 8fa3fb7), the reference for group = pp."""
    padded = -(-m // pp) * pp
    table = [(first + i, chunk) for first in range(0, padded, pp) for chunk in range(vpp) for i in range(pp)]
    fwd = [Action("F", chunk, mb) for mb, chunk in table]
    bwd = [Action("BW", vpp - 1 - chunk, mb) for mb, chunk in table]
    out = []
    for rank in range(pp):
        warmup = min(2 * (pp - rank - 1) + (vpp - 1) * pp, len(table))
        acts = fwd[:warmup]
        for k in range(len(table) - warmup):
            acts += [fwd[warmup + k], bwd[k]]
        acts += bwd[len(table) - warmup:]
        out.append(tuple(a for a in acts if a.microbatch < m))
    return tuple(out)


@pytest.mark.parametrize("pp", [2, 3, 4, 8])
@pytest.mark.parametrize("vpp", [2, 3, 4])
def test_megatron_group_of_pp_is_todays_interleaved(pp, vpp):
    for m in (pp, 2 * pp, 3 * pp + 1, 4 * pp):
        assert builders.interleaved(pp, vpp, m, pp).actions == _old_interleaved(pp, vpp, m)
        assert build("interleaved", pp, vpp, m).actions == _old_interleaved(pp, vpp, m)


def _megatron_table(m: int, vpp: int, group: int) -> list:
    """Megatron's get_schedule_table: (microbatch, chunk) of each forward, groups of `group` per virtual stage."""
    table = []
    for low in range(0, m, group):
        high = min(low + group, m)
        table += [(mb, chunk) for chunk in range(vpp) for mb in range(low, high)]
    return table


@pytest.mark.parametrize("pp", [2, 3, 4])
@pytest.mark.parametrize("group_over_pp", [1, 2])
def test_megatron_groups_verify_follow_its_table_and_warmup(pp, group_over_pp):
    """Every (chunk, mb) F, then BW once, no deadlock; forwards in Megatron's table order; peak memory on rank 0 is
    Megatron's warmup 2(p-1) + (v-1)N forwards plus the first steady one, in chunk units."""
    group = pp * group_over_pp
    for vpp in (2, 3):
        for m in (group, 2 * group, 2 * group + 1):
            plan = build(f"interleaved:{group}", pp, vpp, m)
            simulate(plan, Costs(f=1.0, b=1.7, w=0.6, comm=0.2))
            forwards = [(a.microbatch, a.chunk) for a in plan.actions[0] if a.kind == "F"]
            assert forwards == _megatron_table(m, vpp, group)
            if m % group == 0 and m * vpp > 2 * (pp - 1) + (vpp - 1) * group:
                assert max(peak_memory(plan, FUSED)) == 2 * (pp - 1) + (vpp - 1) * group + 1


@pytest.mark.parametrize("pp", [1, 2, 3, 4, 5, 8])
@pytest.mark.parametrize("vpp", [2, 3, 4])
def test_fork_group_interleaved_verifies_for_many_sizes(pp, vpp):
    for group in range(1, pp + 2):
        for m in sorted({1, 2, pp, 2 * pp + 1, 4 * pp}):
            plan = group_interleaved(pp, vpp, m, group)
            assert (plan.vpp, plan.placement) == (vpp, "interleaved")
            simulate(plan, Costs(f=1.0, b=1.7, w=0.6, comm=0.2))
            assert sorted(a for acts in plan.actions for a in acts) == sorted(
                Action(kind, c, mb) for _ in range(pp) for c in range(vpp) for mb in range(m) for kind in ("F", "BW"))


@pytest.mark.parametrize("pp", [2, 4, 6, 8])
@pytest.mark.parametrize("vpp", [2, 4])
def test_fork_group_interleaved_memory_and_bubble(pp, vpp):
    """With groups of N >= ceil(p/2) the fork starts a rank's first BW after N(v-1) + p - r forwards: peak
    (N(v-1) + p)/v stages on rank 0, 1F1B's p at N = p (Megatron's interleaved: (2(p-1) + (v-1)p + 1)/v), and at
    N = p the same makespan as Megatron's interleaved order."""
    m = 4 * pp
    for group in range(fork_min_group(pp), pp + 1):
        plan = group_interleaved(pp, vpp, m, group)
        assert peak_memory(plan, FUSED) == [group * (vpp - 1) + pp - r for r in range(pp)]
    fork, megatron = group_interleaved(pp, vpp, m, pp), builders.interleaved(pp, vpp, m)
    assert max(peak_memory(fork, FUSED)) / vpp == pp
    assert max(peak_memory(megatron, FUSED)) == 2 * (pp - 1) + (vpp - 1) * pp + 1
    costs = _stage_costs(vpp)
    assert simulate(fork, costs).makespan == pytest.approx(simulate(megatron, costs).makespan, rel=1e-9)


@pytest.mark.parametrize("pp", [2, 4, 8])
def test_fork_group_order_at_full_group_is_megatrons_table(pp):
    """At N = p both order forwards by Megatron's table; the fork's group-interleaved row defaults to N = p."""
    for vpp in (2, 3):
        plan = build("group-interleaved", pp, vpp, 4 * pp)
        assert plan.actions == group_interleaved(pp, vpp, 4 * pp, pp).actions
        for acts in plan.actions:
            assert [(a.microbatch, a.chunk) for a in acts if a.kind == "F"] == _megatron_table(4 * pp, vpp, pp)


# (makespan, peak in chunk units) of the fork's own order (GroupBuildingBlockScheduler of
# sail-sg/zero-bubble-pipeline-parallelism at its unit-cost minimum group, W dropped into BW; run once outside the
# tests, simulated here) at a whole rank's F = B = W = 1: key (p, v, m, N)
FORK_GROUPED = {(4, 2, 16, 1): (52.5, 7.0), (4, 2, 16, 2): (52.0, 6.0), (4, 2, 16, 4): (51.0, 8.0),
                (4, 4, 16, 2): (51.0, 10.0), (8, 2, 32, 4): (105.0, 12.0), (8, 2, 32, 8): (103.0, 16.0)}


@pytest.mark.parametrize("pp, vpp, m, group", list(FORK_GROUPED))
def test_fork_group_interleaved_numbers_are_the_forks(pp, vpp, m, group):
    result = simulate(group_interleaved(pp, vpp, m, group), Costs(f=1 / vpp, b=1 / vpp, w=1 / vpp, w_mem=0.0))
    assert (result.makespan, max(result.peak_memory)) == pytest.approx(FORK_GROUPED[pp, vpp, m, group], abs=1e-9)


@pytest.mark.parametrize("pp", [1, 2, 3, 4, 5, 6, 8, 9])
def test_one_f_one_b_v_verifies_for_many_sizes(pp):
    for m in sorted({1, 2, pp, 2 * pp - 1, 2 * pp, 3 * pp + 1}):
        plan = one_f_one_b_v(pp, m)
        assert (plan.vpp, plan.placement, plan.name) == (2, "v", "1f1b-v")
        assert {a.kind for acts in plan.actions for a in acts} <= {"F", "BW"}
        simulate(plan, Costs(f=1.0, b=1.7, w=0.6, comm=0.2))


def _block_peak(slots: list, m: int) -> int:
    """Chunk units alive at the busiest slot when microbatch mb runs the block 6*mb slots later."""
    lives = [(slots[0], slots[3]), (slots[1], slots[2])]        # chunk 0: F0 .. BW0, chunk 1: F1 .. BW1
    return max(sum(f + 6 * mb <= t <= b + 6 * mb for f, b in lives for mb in range(m))
               for t in range(slots[3] + 6 * m))


@pytest.mark.parametrize("pp", [2, 3, 4, 5, 6, 8, 12, 16])
def test_one_f_one_b_v_memory_is_the_blocks_and_it_beats_1f1b(pp):
    """Peak = the most microbatch-chunks alive (F slot <= t <= BW slot) at any slot of the fork's 6-slot block, over
    all ranks (the warmup squeeze moves forwards earlier only below it): about 2p/3 stages against 1F1B's p; and
    at F = B = W the makespan is below 1F1B's (with the early gradient send)."""
    m = 4 * pp
    plan = one_f_one_b_v(pp, m)
    assert max(peak_memory(plan, FUSED)) == max(_block_peak(slots, m) for slots in v1f1b_pattern(pp))
    assert max(peak_memory(plan, FUSED)) / 2 <= (2 * pp + 2) // 3 + (1 if pp % 3 == 0 else 0)
    half = Costs(f=0.5, b=0.5, w=0.5, w_mem=0.0)
    assert simulate(plan, half).makespan < simulate(builders.one_f_one_b(pp, m), Costs(w_mem=0.0)).makespan


# makespans of the fork's own order (v1f1b.schedule_by_pattern of sail-sg/zero-bubble-pipeline-parallelism, run
# once outside the tests and simulated here) at F = B = W = 0.5 per chunk
FORK_MAKESPAN = {(2, 4): 13.0, (2, 8): 25.0, (3, 6): 20.0, (3, 12): 38.0, (4, 8): 28.5, (4, 16): 52.5, (5, 10): 36.0,
                 (5, 20): 66.0, (8, 16): 58.5, (8, 32): 106.5}


@pytest.mark.parametrize("pp, m", list(FORK_MAKESPAN))
def test_one_f_one_b_v_makespan_is_the_forks(pp, m):
    result = simulate(one_f_one_b_v(pp, m), Costs(f=0.5, b=0.5, w=0.5, w_mem=0.0))
    assert result.makespan == pytest.approx(FORK_MAKESPAN[pp, m], abs=1e-9)


def test_bad_group_sizes_are_one_line():
    with pytest.raises(ConfigError, match=r"^pipeline_schedule group-interleaved needs microbatch groups of at least "
                                          r"1, got 0$"):
        group_interleaved(4, 2, 8, 0)
    with pytest.raises(ConfigError, match=r"^pipeline_schedule interleaved needs microbatch groups of at least the "
                                          r"pipeline size 4, got 2$"):
        build("interleaved:2", 4, 2, 8)


def test_table_rows():
    assert SPECS["1f1b-v"].placement(2) == "v" and not SPECS["1f1b-v"].zero_bubble
    assert SPECS["group-interleaved:3"].build(4, 2, 12).actions == group_interleaved(4, 2, 12, 3).actions
    assert "interleaved:8" not in list(SPECS)

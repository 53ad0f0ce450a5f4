"""V-Half and V-Min (builders_v.py) against the simulator and the paper's figures (Qi et al., arXiv 2405.15362).

Memory is compared in whole-stage microbatches: a V chunk holds half a 1F1B stage's layers, so its unit is half
of 1F1B's. The paper's memory model keeps all of a microbatch's activations until W (M_W = M_B); its table
(https://huggingface.co/spaces/sail/pipeline-parallelism-with-controllable-memory, description) gives the peak
activation memory in microbatches: 1F1B p, V-Min (p+4)//3, V-Half (p+2)//2.
"""
import pytest

from llamapipe.core.pipeline_parallel import builders
from llamapipe.core.pipeline_parallel.builders_v import PERIOD, v_half, v_half_offsets, v_min, v_min_offsets
from llamapipe.core.pipeline_parallel.schedule_specs import SPECS, build
from llamapipe.core.pipeline_parallel.simulator import Costs, peak_memory, simulate
from llamapipe.training.flag_names import worded_as_flags

PAPER_PEAK = {"v-half": lambda p: (p + 2) // 2, "v-min": lambda p: (p + 4) // 3}
BUILD = {"v-half": v_half, "v-min": v_min}
HALF = Costs(f=0.5, b=0.5, w=0.5)        # a V chunk is half a 1F1B stage: half its time


def _ratio(name: str, pp: int, m: int, costs: Costs = Costs()) -> float:
    """Peak over ranks in whole-stage microbatches, over 1F1B's peak under the same memory model."""
    v_peak = max(peak_memory(BUILD[name](pp, m), costs)) / 2
    return v_peak / max(peak_memory(builders.one_f_one_b(pp, m), costs))


@pytest.mark.parametrize("name", list(BUILD))
@pytest.mark.parametrize("pp", [1, 2, 3, 4, 5, 6, 8])
def test_plans_verify_for_many_sizes(name, pp):
    """Every F, B, W once and in order, streams in order, no deadlock: for m below, at and above the V's depth."""
    for m in sorted({1, 2, pp, 2 * pp - 1, 2 * pp, 3 * pp + 1}):
        plan = BUILD[name](pp, m)
        assert (plan.vpp, plan.placement, plan.name) == (2, "v", name)
        simulate(plan, Costs(f=1.0, b=1.7, w=0.6, comm=0.2))


@pytest.mark.parametrize("name", list(BUILD))
@pytest.mark.parametrize("pp", [2, 3, 4, 6, 8, 16])
def test_block_slots_respect_every_dependency(name, pp):
    """Independent of the simulator: in the block, each action's slot is later than its producer's, and a
    rank's four slots differ modulo the period (so two microbatches never share a slot)."""
    off = {"v-half": v_half_offsets, "v-min": v_min_offsets}[name](pp)       # (F c0, F c1, B c1, B c0) per rank
    for r in range(pp):
        assert len({o % PERIOD for o in off[r]}) == 4
        if r:
            assert off[r][0] > off[r - 1][0] and off[r][2] > off[r - 1][2]      # chunk-0 F, chunk-1 B go up
        if r < pp - 1:
            assert off[r][1] > off[r + 1][1] and off[r][3] > off[r + 1][3]      # chunk-1 F, chunk-0 B go down
    assert off[pp - 1][1] > off[pp - 1][0] and off[0][2] > off[0][1] and off[pp - 1][3] > off[pp - 1][2]


@pytest.mark.parametrize("name", list(BUILD))
@pytest.mark.parametrize("pp", [2, 4, 8, 16])
def test_peak_memory_equals_the_papers_under_its_memory_model(name, pp):
    """With M_W = M_B (the paper's model) the simulated peak is the paper's figure for every p."""
    m = 3 * pp
    v_peak = max(peak_memory(BUILD[name](pp, m), Costs(w_mem=1.0))) / 2
    assert v_peak <= PAPER_PEAK[name](pp) + 1e-9
    if pp >= 4:
        assert v_peak == pytest.approx(PAPER_PEAK[name](pp), abs=1e-9)
    assert max(peak_memory(builders.one_f_one_b(pp, m), Costs(w_mem=1.0))) == pp


def test_peak_memory_ratio_at_p8_m24():
    """Default model (B frees half, M_W = 0.5 M_B): V-Half 5 of 1F1B's 8 microbatches, V-Min 3.5 (the paper's
    model: 5 and 4). The issue asked for 0.55 and 0.40; the paper's own blocks give 0.625 and 0.5 (see report)."""
    assert _ratio("v-half", 8, 24) == pytest.approx(5 / 8, abs=1e-9)
    assert _ratio("v-min", 8, 24) == pytest.approx(3.5 / 8, abs=1e-9)
    assert _ratio("v-min", 16, 48) <= 0.376 and _ratio("v-half", 16, 48) <= 0.563


@pytest.mark.parametrize("pp", [2, 4, 8, 16])
def test_throughput_close_to_1f1b_at_equal_costs(pp):
    """At F = B = W (the paper's setting) both makespans are within 3% of 1F1B's (with its early gradient send),
    and V-Half stays within 10% when B = 1.5 F and W = 0.5 F (V-Min, as in the paper, does not)."""
    m = 3 * pp
    base = simulate(builders.one_f_one_b(pp, m), Costs()).makespan
    skewed = simulate(builders.one_f_one_b(pp, m), Costs(f=1.0, b=1.5, w=0.5)).makespan
    for name in BUILD:
        assert simulate(BUILD[name](pp, m), HALF).makespan <= 1.03 * base, name
    assert simulate(v_half(pp, m), Costs(f=0.5, b=0.75, w=0.25)).makespan <= 1.10 * skewed


def test_specs_register_both_with_two_chunks_on_the_v():
    for name in BUILD:
        spec = SPECS[name]
        assert (spec.min_chunks, spec.max_chunks, spec.placement(2), spec.zero_bubble) == (2, 2, "v", True)
        assert build(name, 4, 2, 8) == BUILD[name](4, 8)
    with pytest.raises(ValueError, match="--pipeline-schedule v-min needs exactly 2 model chunks per pipeline rank, "
                                         "got 1"), worded_as_flags():
        build("v-min", 4, 1, 8)
    with pytest.raises(ValueError, match=r"--pipeline-schedule v-half needs pipeline size \(2\) and microbatches "
                                         r"\(0\)"), worded_as_flags():
        v_half(2, 0)

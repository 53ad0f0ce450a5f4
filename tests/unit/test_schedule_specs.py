"""The one table of schedule specs (core/pipeline_parallel/schedule_specs.py) against what reads it: every
builder's plan agrees with its spec's chunks and placement, the runtime picks the profiler exactly for the
profiled specs, and argument checks, plot-schedule and the benchmarks take their answers from the table."""
import argparse

import pytest

from llamapipe.core.parallel_state import ParallelState
from llamapipe.core.pipeline_parallel.auto_schedule import AutoSchedule
from llamapipe.core.pipeline_parallel.runtime import RuntimeOptions
from llamapipe.core.pipeline_parallel.schedule_ir import KINDS
from llamapipe.core.pipeline_parallel.schedule_specs import SCHEDULES, SPECS, build, schedule_spec
from llamapipe.core.pipeline_parallel.schedules import forward_backward_zero_bubble, get_forward_backward_func
from llamapipe.core.pipeline_parallel.simulator import Costs, simulate
from llamapipe.training.flag_names import worded_as_flags

PP, M = 4, 8


def _chunk_counts(spec) -> list[int]:
    return list(range(spec.min_chunks, (spec.max_chunks or spec.min_chunks + 2) + 1))


def test_the_flag_choices_are_the_table():
    assert SCHEDULES == tuple(SPECS) == ("1f1b", "interleaved", "gpipe", "zb-h1", "zb-h2", "zbv", "v-half", "v-min", "dualpipev",
                                             "group-interleaved", "1f1b-v", "auto")
    assert all(name == spec.name for name, spec in SPECS.items())


@pytest.mark.parametrize("name", list(SPECS))
def test_every_plan_agrees_with_its_spec(name):
    """For every chunk count the spec accepts, the plan has that many chunks, the spec's placement, and B/W
    split exactly when the spec says zero-bubble (ZB-H1 always splits; auto may fall back to 1F1B's BW)."""
    spec = SPECS[name]
    assert spec.accepts(spec.default_chunks)
    for vpp in _chunk_counts(spec):
        plan = build(name, PP, vpp, M)
        assert (plan.name, plan.vpp) == (name, vpp)
        assert plan.placement == spec.placement(vpp), f"{name} vpp={vpp}"
        kinds = {a.kind for rank in plan.actions for a in rank}
        assert kinds <= set(KINDS)
        if not spec.zero_bubble:
            assert "W" not in kinds and "B" not in kinds, f"{name} splits B/W but its spec says it does not"
        elif name in ("zb-h1", "zbv", "v-half", "v-min", "dualpipev"):
            assert {"B", "W"} <= kinds
        simulate(plan, Costs())                     # verifies the plan


@pytest.mark.parametrize("name,vpp,words", [("1f1b", 2, "uses one model chunk per pipeline rank, got 2"),
                                            ("zbv", 3, "needs exactly 2 model chunks per pipeline rank, got 3"),
                                            ("auto", 3, "supports 1 or 2 model chunks per pipeline rank, got 3"),
                                            ("interleaved", 1, "needs 2 or more model chunks per pipeline rank")])
def test_chunk_counts_outside_the_spec_are_refused_in_one_sentence(name, vpp, words):
    assert not SPECS[name].accepts(vpp)
    with pytest.raises(ValueError, match=f"--pipeline-schedule {name} {words}"), worded_as_flags():
        build(name, PP, vpp, M)


def test_unknown_name_lists_the_table():
    with pytest.raises(ValueError, match="--pipeline-schedule pipedream is unknown; choose one of 1f1b, "
                                         "interleaved"), worded_as_flags():
        schedule_spec("pipedream")


def test_only_profiled_specs_use_costs():
    """Measured costs change the plan of a profiled schedule only (a fixed order ignores them)."""
    skewed = Costs(f=1.0, b=1.5, w=0.6)
    for name, spec in SPECS.items():
        vpp = spec.default_chunks
        fitted, unit = build(name, 2, vpp, 8, costs=skewed), build(name, 2, vpp, 8)
        if not spec.profiled:
            assert fitted == unit, name
    assert build("zb-h2", 2, 1, 8, costs=skewed) != build("zb-h2", 2, 1, 8)


def test_the_runtime_profiles_exactly_the_profiled_specs():
    ps = ParallelState(pp_size=2)
    for name, spec in SPECS.items():
        fb = get_forward_backward_func(ps, name, options=RuntimeOptions(profile_iters=2))
        assert isinstance(fb, AutoSchedule) == spec.profiled, name
        if spec.profiled:
            assert fb.spec is spec and fb.options.profile_iters == 2
    assert not isinstance(get_forward_backward_func(ParallelState(), "auto"), AutoSchedule)   # one stage
    with pytest.raises(ValueError, match="fits zb-h2 or auto to measured costs, not zbv"):
        AutoSchedule(ps, "zbv")
    with pytest.raises(ValueError, match="choose one of zb-h1, zb-h2, zbv, v-half, v-min, dualpipev, auto"):
        forward_backward_zero_bubble(forward_step_func=None, data_iterator=None, model=[None], num_microbatches=1,
                                     parallel_state=ps, variant="1f1b")


def test_plot_schedule_takes_its_default_chunks_from_the_spec(tmp_path, capsys):
    from llamapipe.tools.plot_schedule import main
    for name in ("interleaved", "zbv", "auto"):
        assert main(["--schedule", name, "--pp", "2", "--microbatches", "4", "--json",
                     "--out", str(tmp_path / f"{name}.svg")]) == 0
        assert f'"vpp": {SPECS[name].default_chunks}' in capsys.readouterr().out


def test_benchmarks_run_every_spec_at_its_default_chunks():
    from benchmarks.schedules_real import SCHEDULES as BENCHMARKED, placement
    assert BENCHMARKED == [(name, spec.default_chunks) for name, spec in SPECS.items()]
    assert placement("torch-zbv", 2) == SPECS["zbv"].placement(2) == "v"
    assert placement("1f1b-fused", 1) == "interleaved"


def _args(**flags) -> argparse.Namespace:
    base = dict(num_layers_per_virtual_pipeline_stage=None, num_virtual_stages_per_pipeline_rank=None,
                micro_batch_size=1)
    return argparse.Namespace(**{**base, **flags})


@pytest.mark.parametrize("name", list(SPECS))
def test_argument_checks_accept_exactly_what_the_spec_accepts(name):
    from llamapipe.core.config import ArgumentError, ParallelConfig
    from llamapipe.training.arguments.pipeline import check_schedule
    spec = SPECS[name]
    for vpp in range(1, 5):
        par = ParallelConfig(pp_size=2, vpp_size=vpp, pipeline_schedule=name)
        args = _args(num_virtual_stages_per_pipeline_rank=vpp if vpp > 1 else None)
        if spec.accepts(vpp):
            check_schedule(args, par, m=4, num_layers=8)
        else:
            with pytest.raises(ArgumentError, match=spec.chunks_text()):
                check_schedule(args, par, m=4, num_layers=8)

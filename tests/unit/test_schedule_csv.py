"""Schedules as files (core/pipeline_parallel/schedule_csv.py, read by training/schedule_file.py):
torch.distributed.pipelining's CSV format both ways.

Our plans survive plan -> CSV -> plan; torch's own ScheduleZBVZeroBubble and ScheduleDualPipeV, written by torch's
`_dump_csv` (compute-only, and lowered with torch's send/recv actions), read back as exactly our zbv and dualpipev;
our plans written here pass torch's own schedule validation, its lowering to send/recv actions (which refuses a
deadlock) and its dry run; a bad file is one line naming the rank and the action as written; plot-schedule exports
and draws."""
import json
from types import SimpleNamespace

import pytest
from torch.distributed.pipelining import schedules as torch_schedules

from llamapipe.core.pipeline_parallel.schedule_csv import from_csv, to_csv
from llamapipe.core.pipeline_parallel.schedule_specs import SPECS, build
from llamapipe.core.pipeline_parallel.simulator import PlanError
from llamapipe.training.schedule_file import read_schedule_file


@pytest.mark.parametrize("name", list(SPECS))
def test_every_schedule_survives_the_round_trip(name):
    spec = SPECS[name]
    for pp, m in ((2, 8), (4, 8), (3, 7)):
        for vpp in range(spec.min_chunks, (spec.max_chunks or 3) + 1):
            if name == "interleaved" or spec.accepts(vpp):
                plan = build(name, pp, vpp, m)
                assert from_csv(to_csv(plan), name=name) == plan, (pp, vpp, m)


def _torch_order(cls, pp: int, m: int) -> dict:
    """torch's compute-only order for every rank of a two-stages-per-rank schedule class."""
    fake = SimpleNamespace(pp_group_size=pp, _n_microbatches=m, num_stages=2 * pp, _num_stages=2 * pp,
                           n_local_stages=2)
    return {rank: cls._calculate_single_rank_operations(fake, rank) for rank in range(pp)}


@pytest.mark.parametrize("cls, ours", [(torch_schedules.ScheduleZBVZeroBubble, "zbv"),
                                       (torch_schedules.ScheduleDualPipeV, "dualpipev")])
@pytest.mark.parametrize("pp", [2, 3, 4])
def test_torchs_own_schedules_written_by_torch_are_ours(tmp_path, cls, ours, pp):
    m = 2 * pp + 2
    order = _torch_order(cls, pp, m)
    path = str(tmp_path / "compute.csv")
    torch_schedules.PipelineScheduleMulti._dump_csv(SimpleNamespace(pipeline_order=order), path)
    assert read_schedule_file(path).actions == build(ours, pp, 2, m).actions
    # the same schedule with torch's communication lowered into it: those cells are left out
    stage_rank = {a.stage_index: rank for rank, acts in order.items() for a in acts if a is not None}
    compute = {rank: [a for a in acts if a is not None] for rank, acts in order.items()}
    lowered = torch_schedules._add_send_recv(compute, stage_to_rank=stage_rank.__getitem__, num_stages=2 * pp)
    assert any("SEND_F" in str(a) for acts in lowered.values() for a in acts)
    comms = str(tmp_path / "comms.csv")
    torch_schedules.PipelineScheduleMulti._dump_csv(SimpleNamespace(pipeline_order=lowered), comms)
    assert read_schedule_file(comms).actions == build(ours, pp, 2, m).actions


@pytest.mark.parametrize("name, vpp", [("v-half", 2), ("v-min", 2), ("dualpipev", 2), ("interleaved", 2),
                                       ("zb-h1", 1), ("zb-h2", 1), ("1f1b", 1), ("interleaved:8", 2),
                                       ("group-interleaved", 2), ("group-interleaved:2", 3), ("1f1b-v", 2)])
def test_our_plans_pass_torchs_validation_and_dry_run(name, vpp):
    pp, m = 4, 8
    plan = build(name, pp, vpp, m)
    order = {rank: [torch_schedules._Action.from_str(cell) for cell in line.split(",")]
             for rank, line in enumerate(to_csv(plan).splitlines())}
    stage_rank = {a.stage_index: rank for rank, acts in order.items() for a in acts}
    assert stage_rank == {plan.stage_of(r, c): r for r in range(pp) for c in range(vpp)}
    torch_schedules._validate_schedule(order, pp, pp * vpp, m)
    lowered = torch_schedules._add_send_recv(order, stage_to_rank=stage_rank.__getitem__, num_stages=pp * vpp)
    torch_schedules._simulate_comms_compute(lowered, stage_rank.__getitem__, pp * vpp)


# rank 0 sends microbatch 1 only after microbatch 0's backward, which rank 1 runs only after microbatch 1's forward
DEADLOCK = "0F0,0B0,0F1,0B1\n1F0,1F1,1B0,1B1\n"


def test_torchs_lowering_catches_a_deadlock_so_the_check_above_can_fail():
    order = {0: [torch_schedules._Action.from_str(c) for c in DEADLOCK.splitlines()[0].split(",")],
             1: [torch_schedules._Action.from_str(c) for c in DEADLOCK.splitlines()[1].split(",")]}
    with pytest.raises(AssertionError, match="Malformed compute schedule"):     # torch's lowering finds it
        torch_schedules._add_send_recv(order, stage_to_rank=lambda s: s, num_stages=2)


@pytest.mark.parametrize("text, message", [
    (DEADLOCK, "deadlock: rank 0 action 2 '0B0' waits for B of stage 1 microbatch 0 from rank 1; rank 1 action 2 "
               "'1F1' waits for F of stage 0 microbatch 1 from rank 0"),
    ("0F0,0I0\n1F0,1B0\n", "rank 0: missing W for chunk 0 microbatch 0"),
    ("0F0,0B0,0B0\n1F0,1B0\n", "rank 0 action 3 '0B0' duplicated B for chunk 0 microbatch 0"),
    ("0F0,0B0\n1F0,1X0\n", "rank 1 action 2 '1X0' is not an action"),
    ("0F0,1F0,1B0,0B0\n1F1\n", "rank 1 action 1 '1F1' runs stage 1, which rank 0 runs too"),
    ("0F0,1F0,1B0,0B0\n2F0,3F0,3B0,2B0\n", "rank 0 runs stage 1, which fits neither"),
    ("\n\n", "no actions"),
])
def test_a_bad_file_is_one_line_naming_the_rank_and_the_action(tmp_path, text, message):
    path = tmp_path / "bad.csv"
    path.write_text(text)
    with pytest.raises(PlanError) as err:
        read_schedule_file(str(path))
    assert str(err.value).startswith(f"schedule file {path}: ") and message in str(err.value)
    assert "\n" not in str(err.value)


def test_overlapped_f_and_b_cells_are_their_two_actions():
    """DualPipe's F&B pairs written as torch's OVERLAP_F_B cells read back as F then BW."""
    plan = build("dualpipev", 2, 2, 4)
    rows = [line.split(",") for line in to_csv(plan).splitlines()]
    merged = 0
    for rank, acts in enumerate(plan.actions):
        pairs = [i for i in range(len(acts) - 1) if (acts[i].kind, acts[i + 1].kind) == ("F", "BW")]
        for i in reversed(pairs):
            rows[rank][i:i + 2] = [f"({rows[rank][i]};{rows[rank][i + 1]})OVERLAP_F_B"]
        merged += len(pairs)
    assert merged >= 4
    assert from_csv("\n".join(",".join(row) for row in rows), name="dualpipev") == plan


def test_plot_schedule_exports_and_draws_a_file(tmp_path, capsys):
    from llamapipe.tools.plot_schedule import main
    csv_path, svg = str(tmp_path / "v_half.csv"), str(tmp_path / "v.svg")
    assert main(["--schedule", "v-half", "--pp", "4", "--microbatches", "8", "--json", "--export-csv", csv_path]) == 0
    named = json.loads(capsys.readouterr().out)
    assert read_schedule_file(csv_path).actions == build("v-half", 4, 2, 8).actions
    assert main(["--schedule-file", csv_path, "--json", "--out", svg]) == 0
    loaded = json.loads(capsys.readouterr().out)
    assert (loaded["pp"], loaded["vpp"], loaded["microbatches"]) == (4, 2, 8)
    assert loaded["makespan"] == named["makespan"] and loaded["bubble_rate"] == named["bubble_rate"]
    assert main(["--schedule-file", str(tmp_path / "missing.csv"), "--json"]) == 2

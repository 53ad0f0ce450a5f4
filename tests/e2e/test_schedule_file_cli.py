"""--pipeline-schedule-file through the CLI (pp 2, fp32, CPU): our V-Half exported by plot-schedule and torch's own
ScheduleDualPipeV written by torch's `_dump_csv` both train to the single-process losses (rel 1e-5), the 'run:'
block names the file, and a bad file stops every rank with one line naming the rank and the action."""
import math
import subprocess
import sys
from types import SimpleNamespace

import pytest
from torch.distributed.pipelining import schedules as torch_schedules

from llamapipe.tools.plot_schedule import main as plot_schedule
from tests.cli import ROOT, TINY, read_metrics, torchrun, train

ITERS = ["--train-iters", "3", "--micro-batch-size", "1", "--global-batch-size", "8"]
PP2 = ["--pipeline-model-parallel-size", "2"]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("ref")
    return [r["lm_loss"] for r in train(1, ITERS, str(tmp / "m.jsonl"))]


def _train_file(path: str, jsonl: str) -> tuple[list[float], str]:
    proc = torchrun(2, TINY + ITERS + PP2 + ["--pipeline-schedule-file", path, "--metrics-jsonl", jsonl])
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stderr[-4000:]}"
    return [r["lm_loss"] for r in read_metrics(jsonl)], proc.stdout + proc.stderr


def _same(losses: list[float], reference: list[float], what: str) -> None:
    assert len(losses) == len(reference) == 3
    for it, (got, want) in enumerate(zip(losses, reference), 1):
        assert math.isclose(got, want, rel_tol=1e-5), f"{what} iteration {it}: {got} vs single-process {want}"


@pytest.mark.slow
def test_our_v_half_exported_to_a_file_trains_to_the_single_process_losses(reference, tmp_path, capsys):
    path = str(tmp_path / "v_half.csv")
    assert plot_schedule(["--schedule", "v-half", "--pp", "2", "--microbatches", "8", "--json", "--export-csv",
                          path]) == 0
    losses, output = _train_file(path, str(tmp_path / "m.jsonl"))
    _same(losses, reference, "v-half from a file")
    assert f"run: schedule file:{path}, 8 microbatches" in output
    assert output.count(f"--pipeline-schedule-file {path}: verified, pp 2, 2 model chunks per rank (v placement), "
                        "8 microbatches, B/W split") == 1
    assert "2 model chunks per pipeline rank" in output


@pytest.mark.slow
def test_torchs_dualpipev_written_by_torch_trains_to_the_single_process_losses(reference, tmp_path):
    pp, m = 2, 8
    fake = SimpleNamespace(pp_group_size=pp, _n_microbatches=m)
    order = {rank: torch_schedules.ScheduleDualPipeV._calculate_single_rank_operations(fake, rank)
             for rank in range(pp)}
    path = str(tmp_path / "dualpipev.csv")
    torch_schedules.PipelineScheduleMulti._dump_csv(SimpleNamespace(pipeline_order=order), path)
    losses, output = _train_file(path, str(tmp_path / "m.jsonl"))
    _same(losses, reference, "torch's DualPipeV from a file")


@pytest.mark.slow
def test_a_bad_file_is_one_line_before_anything_starts(reference, tmp_path):
    path = tmp_path / "bad.csv"
    path.write_text("0F0,0B0,0F1,0B1\n1F0,1F1,1B0,1B1\n")
    proc = subprocess.run([sys.executable, "pretrain_llama.py", *TINY, *ITERS, *PP2, "--pipeline-schedule-file",
                           str(path)], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    errors = [line for line in proc.stderr.splitlines() if "error:" in line]
    assert len(errors) == 1 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert f"--pipeline-schedule-file: schedule file {path}: deadlock: rank 0 action 2 '0B0' waits for B" in errors[0]

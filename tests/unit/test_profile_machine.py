"""`llamapipe profile` measures what a training rank sees (issue 39, item 1): a torchrun rank's thread count by
default, recorded in the profile; a loaded machine refused, naming the load, when the passes would be timed in
wall time; an existing profile kept; and `plan --profile` refuses a profile timed with another thread count."""
from __future__ import annotations

import json

import pytest
import torch

from llamapipe.tools import plan_parallelism, profile_machine, profile_model
from llamapipe.training import profile_schema
from tests.unit.test_profile_planner import synthetic_profile

SMALL = ["--num-layers", "1", "--hidden-size", "32", "--ffn-hidden-size", "64", "--num-attention-heads", "2",
         "--vocab-size", "64", "--seq-length", "16", "--max-position-embeddings", "16", "--repeats", "1"]


@pytest.mark.parametrize("env, threads", [(None, 1), ("4", 4), ("", 1), ("x", 1)])
def test_run_threads_is_torchruns(monkeypatch, env, threads):
    if env is None:
        monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    else:
        monkeypatch.setenv("OMP_NUM_THREADS", env)
    assert profile_schema.run_threads() == threads


def test_busy_cores_from_proc_stat(monkeypatch):
    """Busy jiffies over total jiffies between two readings, times the cores."""
    readings = iter([(100.0, 400.0), (250.0, 600.0)])        # 150 busy of 200: three quarters of every core
    monkeypatch.setattr(profile_machine, "_cpu_times", lambda: next(readings))
    monkeypatch.setattr(profile_machine.os, "cpu_count", lambda: 4)
    assert profile_machine.busy_cores(0.0) == pytest.approx(3.0, rel=1e-12)
    monkeypatch.setattr(profile_machine, "_cpu_times", lambda: None)
    assert profile_machine.busy_cores(0.0) is None


@pytest.mark.parametrize("threads, busy, refused", [(1, 2.0, False), (2, 2.0, True), (2, 0.1, False),
                                                    (2, None, False), (3, 0.5, True)])
def test_load_refusal_names_the_load(threads, busy, refused):
    said = profile_machine.load_refusal(threads, busy, cores=2)
    assert (said is not None) == refused
    if refused:
        assert f"keep {busy:.1f} of this machine's 2 cores busy" in said and f"--threads {threads}" in said


def test_profile_defaults_to_one_thread_and_records_it(tmp_path, monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    before = torch.get_num_threads()
    try:
        assert profile_model.main(SMALL + ["--out", str(tmp_path / "p.json")]) == 0
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)
    assert json.loads((tmp_path / "p.json").read_text())["threads"] == 1


def test_profile_refuses_a_loaded_machine_with_two_threads(tmp_path, monkeypatch):
    monkeypatch.setattr(profile_machine, "busy_cores", lambda seconds=0.5: float(profile_machine.os.cpu_count()))
    before = torch.get_num_threads()
    try:
        with pytest.raises(SystemExit, match=r"other processes keep \d\.\d of this machine's \d+ cores busy"):
            profile_model.main(SMALL + ["--threads", "2", "--out", str(tmp_path / "p.json")])
    finally:
        torch.set_num_threads(before)
    assert not (tmp_path / "p.json").exists()


def test_profile_keeps_an_existing_out(tmp_path):
    out = tmp_path / "prof.json"
    out.write_text("{}")
    with pytest.raises(SystemExit, match=f"--out {out} exists; give another path, or --force to replace it"):
        profile_model.main(SMALL + ["--out", str(out)])
    assert out.read_text() == "{}"


def test_plan_refuses_a_profile_with_another_thread_count(tmp_path, monkeypatch, capsys):
    profile = synthetic_profile()
    profile["threads"] = 2
    path = tmp_path / "prof.json"
    path.write_text(json.dumps(profile))
    argv = ["--profile", str(path), "--gpus", "2", "--global-batch-size", "8"]
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    assert plan_parallelism.main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "measured with 2 thread(s) per process" in err
    assert "(torchrun's OMP_NUM_THREADS=1) computes with 1" in err
    monkeypatch.setenv("OMP_NUM_THREADS", "2")          # the run's ranks compute with 2 as well
    assert plan_parallelism.main(argv) == 0
    assert profile_schema.threads_mismatch(dict(profile, device="cuda"), 1, "p", "r") is None


def test_profile_takes_the_tokenizers_vocabulary(tmp_path):
    """As training does (item 3's kind): the profiled embedding and output layer have the tokenizer's 96 ids,
    not --vocab-size's placeholder, so --pipeline-profile matches the run that trains with that tokenizer."""
    from tokenizers import Tokenizer, models
    Tokenizer(models.WordLevel({f"w{i}": i for i in range(96)}, unk_token="w0")).save(str(tmp_path / "tokenizer.json"))
    at = SMALL.index("--vocab-size")
    shape = SMALL[:at] + SMALL[at + 2:]
    before = torch.get_num_threads()
    try:
        assert profile_model.main(shape + ["--threads", "1", "--tokenizer-model", str(tmp_path),
                                           "--out", str(tmp_path / "p.json")]) == 0
    finally:
        torch.set_num_threads(before)
    assert json.loads((tmp_path / "p.json").read_text())["model"]["vocab_size"] == 96


def test_the_trainers_pipeline_profile_must_match_its_ranks_threads(tmp_path, monkeypatch):
    """--pipeline-model-parallel-layout auto reads the profile's costs: one timed with 2 threads per process
    does not describe ranks that compute with torchrun's 1."""
    from llamapipe.core.config import ArgumentError
    from llamapipe.training.arguments.parser import build_parser, config_from_args
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    profile = synthetic_profile(num_layers=8)
    profile["threads"] = 2
    path = tmp_path / "prof.json"
    path.write_text(json.dumps(profile))
    shape = ["--num-layers", "8", "--hidden-size", "64", "--ffn-hidden-size", "128", "--num-attention-heads", "4",
             "--vocab-size", "256", "--seq-length", "32", "--max-position-embeddings", "64", "--mock-data",
             "--pipeline-model-parallel-size", "2", "--global-batch-size", "8",
             "--pipeline-model-parallel-layout", "auto", "--pipeline-profile", str(path)]
    with pytest.raises(ArgumentError, match=r"measured with 2 thread\(s\) per process, but each rank torchrun "
                                            r"starts \(OMP_NUM_THREADS, else 1\) computes with 1"):
        config_from_args(build_parser().parse_args(shape), 2)
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    assert config_from_args(build_parser().parse_args(shape), 2).parallel.pipeline_layout is not None

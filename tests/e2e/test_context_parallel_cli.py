"""--context-parallel-size through the CLI (issue 30): the sequence split over CP ranks trains the single-process
per-iteration losses (fp32, rel 1e-5) with ring (p2p) and all-gather attention at cp 2 and 4, and composed with
tp 2 + sequence parallelism, pp 2 under ZB-V (the B/W split), dp 2 under ZeRO-3, full recompute and vocabulary
parallelism, and evaluates the same validation loss (also under post-validation); a checkpoint saved at cp 2 (ZeRO-1: the optimizer state gathered over dp x cp) resumes at cp 1 and
cp 4 with the uninterrupted run's losses, one written before CP existed (no "cp" in its layout, order tp-dp-pp)
still resumes exactly, random states included, and convert-hf exports the same weights from a cp 2 checkpoint
as from the single-process one. Megatron's H200 LLaMA 3 script trains with --context-parallel-size 2."""
import json
import math
import os
import shutil
import subprocess
import sys

import pytest
import torch

from llamapipe.training.checkpointing import catalog
from tests.cli import ROOT, TINY, read_metrics, torchrun, train

pytestmark = pytest.mark.slow

ITERS = ["--train-iters", "4", "--micro-batch-size", "1", "--global-batch-size", "4"]
CP2, CP4 = ["--context-parallel-size", "2"], ["--context-parallel-size", "4"]
ALLGATHER = ["--cp-comm-type", "allgather"]
A2A = ["--cp-comm-type", "a2a"]
A2A_P2P = ["--cp-comm-type", "a2a+p2p", "--hierarchical-context-parallel-sizes", "2", "2"]


def losses(records: list[dict]) -> list[float]:
    return [r["lm_loss"] for r in records]


def assert_same(got: list[float], want: list[float], what: str) -> None:
    assert len(got) == len(want) and got, f"{what}: {len(got)} losses, expected {len(want)}"
    for it, (g, w) in enumerate(zip(got, want), 1):
        assert math.isclose(g, w, rel_tol=1e-5), f"{what}, value {it}: loss {g}, one process {w}"


def run(nproc: int, args: list[str], tmp_path) -> tuple[list[dict], str]:
    """Train to completion (asserting success); the records and everything the job printed."""
    jsonl = str(tmp_path / f"m{len(os.listdir(tmp_path))}.jsonl")
    proc = torchrun(nproc, TINY + ITERS + args + ["--metrics-jsonl", jsonl])
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    return read_metrics(jsonl), proc.stdout + proc.stderr


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """One process, saving at iterations 2 and 4."""
    root = tmp_path_factory.mktemp("one")
    records = train(1, ITERS + ["--save", str(root / "ckpt"), "--save-interval", "2"], str(root / "m.jsonl"))
    return losses(records), root / "ckpt"


CASES = {
    "cp2-p2p-compile": (2, CP2 + ["--compile"]),    # the ring under torch.compile (a graph break around it)
    "cp2-allgather": (2, CP2 + ALLGATHER),
    "cp4-p2p": (4, CP4),
    "cp4-allgather": (4, CP4 + ALLGATHER),
    "cp2-tp2-sp": (4, CP2 + ["--tensor-model-parallel-size", "2", "--sequence-parallel"]),
    "cp2-pp2-zbv": (4, CP2 + ["--pipeline-model-parallel-size", "2", "--pipeline-schedule", "zbv",
                              "--num-virtual-stages-per-pipeline-rank", "2"]),
    "cp2-dp2-zero3": (4, CP2 + ["--data-parallel-sharding-strategy", "optim_grads_params"]),
    "cp2-full-recompute": (2, CP2 + ALLGATHER + ["--recompute-granularity", "full", "--recompute-method", "uniform"]),
    "cp2-pp2-vocab-parallel": (4, CP2 + ["--pipeline-model-parallel-size", "2", "--enable-vocab-parallel"]),
    "cp2-a2a": (2, CP2 + A2A),                     # Ulysses: heads across the CP ranks around attention
    "cp4-a2a+p2p": (4, CP4 + A2A_P2P),             # a2a over CP ranks (0 1), (2 3), the ring over (0 2), (1 3)
    "cp2-a2a-pp2-zbv": (4, CP2 + A2A + ["--pipeline-model-parallel-size", "2", "--pipeline-schedule", "zbv",
                                        "--num-virtual-stages-per-pipeline-rank", "2"]),
}


@pytest.mark.parametrize("name", list(CASES))
def test_context_parallel_trains_like_one_process(reference, tmp_path, name):
    nproc, flags = CASES[name]
    records = train(nproc, ITERS + flags, str(tmp_path / "m.jsonl"))
    assert_same(losses(records), reference[0], name)


def validation_losses(jsonl: str) -> list[float]:
    with open(jsonl) as f:
        return [r["valid_lm_loss"] for r in map(json.loads, f) if "valid_lm_loss" in r]


def test_context_parallel_evaluates_and_post_validates_like_one_process(tmp_path):
    """Evaluation (forward only) and the post-validated step's token count over dp x cp."""
    evaluate = ["--eval-iters", "1", "--eval-interval", "2", "--split", "90,10,0"]
    one = train(1, ITERS + evaluate, str(tmp_path / "one.jsonl"))
    cp2 = train(2, ITERS + evaluate + CP2 + ["--enable-optimizer-post-validation"], str(tmp_path / "cp2.jsonl"))
    assert_same(losses(cp2), losses(one), "cp 2 with post-validation")
    assert_same(validation_losses(str(tmp_path / "cp2.jsonl")), validation_losses(str(tmp_path / "one.jsonl")),
                "cp 2 validation")


@pytest.fixture(scope="module")
def saved_cp2(tmp_path_factory):
    """Two iterations at cp 2 with the distributed optimizer (its shards span dp x cp), then exit."""
    root = tmp_path_factory.mktemp("cp2")
    records = train(2, ITERS + CP2 + ["--use-distributed-optimizer", "--exit-interval", "2",
                                      "--save", str(root / "ckpt")], str(root / "m.jsonl"))
    return losses(records), root / "ckpt"


@pytest.mark.parametrize("nproc,flags", [(1, []), (4, CP4 + ["--use-distributed-optimizer"])], ids=["cp1", "cp4"])
def test_a_cp2_checkpoint_resumes_at_another_cp_size(reference, saved_cp2, tmp_path, nproc, flags):
    assert_same(saved_cp2[0], reference[0][:2], "cp 2 before saving")
    with open(os.path.join(saved_cp2[1], "iter_0000002", "metadata.json")) as f:
        assert json.load(f)["layout"] == {"world_size": 2, "tp": 1, "cp": 2, "dp": 1, "pp": 1, "vpp": 1,
                                          "order": "tp-cp-dp-pp"}
    records = train(nproc, ITERS + flags + ["--load", str(saved_cp2[1])], str(tmp_path / "m.jsonl"))
    assert_same(losses(records), reference[0][2:], f"saved at cp 2, resumed at {'cp 4' if flags else 'cp 1'}")


@pytest.fixture(scope="module")
def pre_cp_checkpoint(reference, tmp_path_factory):
    """The one-process checkpoint of iteration 2 as a run before context parallelism recorded it: no "cp" in
    its layout and the order tp-dp-pp (metadata re-sealed)."""
    path = tmp_path_factory.mktemp("old") / "ckpt"
    shutil.copytree(reference[1] / "iter_0000002", path / "iter_0000002")
    (path / "latest_checkpointed_iteration.txt").write_text("2")
    meta_path = path / "iter_0000002" / "metadata.json"
    meta = json.loads(meta_path.read_text())
    layout = {k: v for k, v in meta["layout"].items() if k != "cp"}
    meta_path.write_text(json.dumps(catalog.seal({**meta, "layout": {**layout, "order": "tp-dp-pp"}})))
    return path


def test_a_checkpoint_from_before_cp_resumes_exactly(reference, pre_cp_checkpoint, tmp_path):
    records, output = run(1, ["--load", str(pre_cp_checkpoint)], tmp_path)
    assert_same(losses(records), reference[0][2:], "pre-CP checkpoint resumed")
    assert "random states are per rank" not in output      # the same layout: its random states are restored


def test_convert_hf_exports_the_same_weights_from_a_cp2_checkpoint(saved_cp2, pre_cp_checkpoint, tmp_path):
    from safetensors.torch import load_file
    exported = []
    for name, ckpt in (("cp2", saved_cp2[1]), ("one", pre_cp_checkpoint)):
        proc = subprocess.run([sys.executable, "-m", "llamapipe", "convert-hf", "export", "--load", str(ckpt),
                               "--hf-dir", str(tmp_path / name)], capture_output=True, text=True, timeout=300, cwd=ROOT)
        assert proc.returncode == 0, proc.stderr[-3000:]
        exported.append(load_file(os.path.join(tmp_path / name, "model.safetensors")))
    assert sorted(exported[0]) == sorted(exported[1]) and "lm_head.weight" in exported[0]
    for key, value in exported[1].items():
        torch.testing.assert_close(exported[0][key], value, rtol=1e-5, atol=1e-6, msg=key)


def test_megatron_h200_script_trains_with_context_parallel_size_2(tmp_path):
    from tests.e2e.test_megatron_scripts import _run, _without, h200_bf16
    args = h200_bf16(str(tmp_path / "ckpt"), str(tmp_path / "tb"), str(tmp_path / "cache"))
    args = _without(args, ("--context-parallel-size",)) + CP2 + ALLGATHER
    rows, output = _run(2, args, tmp_path)
    assert [r["iteration"] for r in rows] == [1, 2, 3] and all(math.isfinite(r["lm_loss"]) for r in rows)
    assert "run: 2 ranks = tp 1 x cp 2 (context parallel, allgather attention: each rank holds 16 of every 32 " \
           "tokens) x pp 1 x dp 1" in output


def test_megatron_h200_script_trains_with_cp_comm_type_a2a(tmp_path):
    """The script with --context-parallel-size 2 --cp-comm-type a2a (Megatron's Ulysses), otherwise unchanged."""
    from tests.e2e.test_megatron_scripts import _run, _without, h200_bf16
    args = h200_bf16(str(tmp_path / "ckpt"), str(tmp_path / "tb"), str(tmp_path / "cache"))
    args = _without(args, ("--context-parallel-size",)) + CP2 + A2A
    rows, output = _run(2, args, tmp_path)
    assert [r["iteration"] for r in rows] == [1, 2, 3] and all(math.isfinite(r["lm_loss"]) for r in rows)
    assert "(context parallel, a2a attention: each rank holds 16 of every 32 tokens)" in output

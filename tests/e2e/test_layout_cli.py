"""--pipeline-model-parallel-layout through the CLI: uneven splits, with one and with two model chunks per rank,
train the same per-iteration losses as the single-process run (fp32, rel 1e-5) and log the layers per stage the
string asked for; a layout that contradicts --decoder-first-pipeline-num-layers stops in one line."""
import math
import os
import subprocess
import sys

import pytest

from tests.cli import ROOT, TINY, read_metrics, torchrun, train

ITERS = ["--train-iters", "4", "--micro-batch-size", "1", "--global-batch-size", "8"]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    return [r["lm_loss"] for r in train(1, ITERS, str(tmp_path_factory.mktemp("ref") / "m.jsonl"))]


@pytest.mark.parametrize("flags,split", [
    (["--pipeline-model-parallel-layout", "Ettt|tttttL"], "3, 5"),
    (["--pipeline-model-parallel-layout", "Et|t*3|tt|ttL", "--pipeline-schedule", "v-half"], "1, 3, 2, 2"),
], ids=["pp2-3-5-1f1b", "pp2-vpp2-1-3-2-2-v-half"])
def test_layout_string_trains_like_one_process(reference, tmp_path, flags, split):
    jsonl = str(tmp_path / "m.jsonl")
    proc = torchrun(2, TINY + ITERS + ["--pipeline-model-parallel-size", "2", *flags, "--metrics-jsonl", jsonl])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"layers per pipeline stage: {split}\n" in proc.stdout + proc.stderr, (proc.stdout + proc.stderr)[-3000:]
    losses = [r["lm_loss"] for r in read_metrics(jsonl)]
    assert len(losses) == len(reference) == 4
    for it, (got, want) in enumerate(zip(losses, reference), 1):
        assert math.isclose(got, want, rel_tol=1e-5), f"{split}, iteration {it}: loss {got}, one process {want}"


def test_layout_contradicting_first_stage_layers_is_one_line():
    """Flags are checked before any process group, so one process with WORLD_SIZE 2 sees the error."""
    cmd = [sys.executable, "pretrain_llama.py", *TINY, *ITERS, "--pipeline-model-parallel-size", "2",
           "--pipeline-model-parallel-layout", "Ettt|tttttL", "--decoder-first-pipeline-num-layers", "4"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120,
                          env=dict(os.environ, WORLD_SIZE="2", RANK="0", PYTHONPATH=ROOT))
    assert proc.returncode == 2, proc.stderr[-3000:]
    lines = proc.stderr.strip().splitlines()
    assert lines == ["pretrain_llama.py: error: --decoder-first-pipeline-num-layers 4 contradicts "
                     "--pipeline-model-parallel-layout 'Ettt|tttttL', which gives the first stage 3 layers"], lines

"""examples/continued_pretraining/continued_pretraining.sh run as its header says (the shrunk random-weight Llama
3.2 1B shape, offline): it imports the HF checkpoint, packs the corpus, trains at tp 2 x pp 2 under ZB-V with
packed documents, exports, and transformers generates from the export. The export has the checkpoint's
tensor names and shapes, training changed its weights and its loss falls, and transformers warns of nothing in the
RoPE scaling (issue 50: its original_max_position_embeddings was once over the shrunk position limit)."""
import json
import math
import os
import re
import shlex
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from tests.cli import ROOT, free_port

pytestmark = pytest.mark.slow

SCRIPT = os.path.join(ROOT, "examples", "continued_pretraining", "continued_pretraining.sh")
COMMAND = "bash examples/continued_pretraining/continued_pretraining.sh"


def header_environment() -> dict:
    """The VAR=VALUE settings of the header's shrunk command (the comment lines that end in the script's path)."""
    lines, command = open(SCRIPT).read().splitlines(), []
    for i, line in enumerate(lines):
        if line.startswith("#") and line.rstrip().endswith(COMMAND):
            start = i
            while lines[start - 1].rstrip().endswith("\\"):
                start -= 1
            command = [part.strip("# \\") for part in lines[start:i + 1]]
    words = shlex.split(" ".join(command))
    env = dict(word.split("=", 1) for word in words if re.match(r"^[A-Z_]+=", word))
    assert "NUM_LAYERS" in env and "HF_CHECKPOINT" not in env, words
    return env


def test_recipe_runs_offline_as_its_header_says(tmp_path):
    run = tmp_path / "run"
    env = dict(os.environ, **header_environment(), RUN_DIR=str(run), PYTHON=sys.executable,
               MASTER_PORT=str(free_port()), PYTHONPATH=ROOT,
               PATH=os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", ""))
    proc = subprocess.run(["bash", SCRIPT], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"exit {proc.returncode}\n{output[-6000:]}"
    assert "continued_pretraining: the export keeps the checkpoint's shape; transformers generates: 'The" in output
    assert "run: packed documents: attention within each document, positions restart at each document" in output
    assert "run: 4 ranks = tp 2 x pp 2 x dp 1" in output and "run: schedule zbv" in output
    theirs = [line for line in output.splitlines() if "--use-checkpoint-args:" not in line]   # ours says the band
    assert not [line for line in theirs if "original_max_position_embeddings" in line], \
        "transformers' RoPE scaling warning (issue 50)"
    records = [json.loads(line) for line in open(run / "metrics.jsonl")]
    losses = [r["lm_loss"] for r in records if "lm_loss" in r]
    assert len(losses) == int(env["TRAIN_ITERS"]) and all(math.isfinite(x) for x in losses)
    assert losses[-1] < losses[0] - 0.3, f"the shrunk run's loss does not fall visibly: {losses}"
    assert output.rstrip().count(": the loss is falling") == 1
    assert any("valid_lm_loss" in r for r in records)
    base = load_file(str(run / "random-llama-3.2-1b" / "model.safetensors"))
    exported = load_file(str(run / "hf" / "model.safetensors"))
    assert {k: v.shape for k, v in exported.items()} == {k: v.shape for k, v in base.items()}
    name = "model.layers.0.mlp.down_proj.weight"
    assert not torch.equal(exported[name], base[name]), "training changed the weights"

"""Checkpoints through the CLI: a tp=2 pp=2 run resumes in other layouts with the uninterrupted losses, and
an HF model imported, fine-tuned with pretrain_llama.py and exported loads in transformers with our loss."""
from __future__ import annotations

import math
import shutil
import subprocess
import sys

import pytest
import torch

from llamapipe.training.checkpointing.io import read_model_state_dict
from llamapipe.model.llama.hf import from_hf
from llamapipe.model.llama import LlamaModel
from tests.cli import ROOT, TINY, train

FLAGS = ["--micro-batch-size", "1", "--global-batch-size", "8", "--lr-decay-style", "constant"]
TP2_PP2 = ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2"]


@pytest.fixture(scope="module")
def tp2_pp2_run(tmp_path_factory):
    """4 iterations at tp=2 pp=2, with the iteration-2 checkpoint kept on its own."""
    root = tmp_path_factory.mktemp("reshard")
    rows = train(4, FLAGS + TP2_PP2 + ["--train-iters", "4", "--save", str(root / "run"), "--save-interval", "2"],
                 str(root / "full.jsonl"))
    only2 = root / "at2"
    only2.mkdir()
    shutil.copytree(root / "run" / "iter_0000002", only2 / "iter_0000002")
    (only2 / "latest_checkpointed_iteration.txt").write_text("2\n")
    return root, rows


@pytest.mark.parametrize("nproc,layout", [
    (4, ["--pipeline-model-parallel-size", "4", "--num-layers-per-virtual-pipeline-stage", "1"]),
    (1, []),
    (2, ["--pipeline-model-parallel-size", "2", "--decoder-first-pipeline-num-layers", "5"]),
], ids=["tp1-pp4-vpp2", "tp1-pp1", "tp1-pp2-uneven"])
def test_resume_in_another_layout_continues_the_losses(tp2_pp2_run, tmp_path, nproc, layout):
    root, full = tp2_pp2_run
    resumed = train(nproc, FLAGS + layout + ["--train-iters", "4", "--load", str(root / "at2")],
                    str(tmp_path / "resumed.jsonl"))
    assert [r["iteration"] for r in resumed] == [3, 4]
    for got, want in zip(resumed, full[2:]):
        assert math.isclose(got["lm_loss"], want["lm_loss"], rel_tol=1e-5), (got["iteration"], got, want)


def test_checkpoint_saved_with_an_uneven_split_resumes_in_another(tmp_path):
    uneven = ["--pipeline-model-parallel-size", "2", "--decoder-first-pipeline-num-layers", "6"]
    full = train(2, FLAGS + uneven + ["--train-iters", "4", "--save", str(tmp_path / "run"), "--save-interval", "2"],
                 str(tmp_path / "full.jsonl"))
    at2 = tmp_path / "at2"
    shutil.copytree(tmp_path / "run" / "iter_0000002", at2 / "iter_0000002")
    (at2 / "latest_checkpointed_iteration.txt").write_text("2\n")
    resumed = train(2, FLAGS + ["--pipeline-model-parallel-size", "2", "--train-iters", "4", "--load", str(at2)],
                    str(tmp_path / "resumed.jsonl"))
    assert [r["iteration"] for r in resumed] == [3, 4]
    for got, want in zip(resumed, full[2:]):
        assert math.isclose(got["lm_loss"], want["lm_loss"], rel_tol=1e-5), (got["iteration"], got, want)


def test_hf_import_finetune_export_matches_our_loss(tmp_path):
    transformers = pytest.importorskip("transformers")
    hf_cfg = transformers.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=8,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                      rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=False)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(hf_cfg).save_pretrained(tmp_path / "hf", safe_serialization=True)
    convert = [sys.executable, "-m", "llamapipe", "convert-hf"]
    subprocess.run(convert + ["import", "--hf-dir", str(tmp_path / "hf"), "--save", str(tmp_path / "ckpt"),
                              "--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2"],
                   cwd=ROOT, check=True, capture_output=True)
    rows = train(4, FLAGS + TP2_PP2 + ["--train-iters", "3", "--load", str(tmp_path / "ckpt"), "--finetune",
                                       "--save", str(tmp_path / "tuned")], str(tmp_path / "m.jsonl"))
    assert [r["iteration"] for r in rows] == [1, 2, 3]
    subprocess.run(convert + ["export", "--load", str(tmp_path / "tuned"), "--hf-dir", str(tmp_path / "out")],
                   cwd=ROOT, check=True, capture_output=True)

    exported = transformers.LlamaForCausalLM.from_pretrained(str(tmp_path / "out")).eval()
    ours = LlamaModel(from_hf(exported.state_dict(), exported.config)[0]).eval()
    ours.load_logical_state_dict(read_model_state_dict(str(tmp_path / "tuned" / "iter_0000003")))
    tokens = torch.randint(0, 256, (2, 33), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        hf_loss = exported(tokens, labels=tokens).loss
        our_loss = ours(tokens[:, :-1], labels=tokens[:, 1:]).mean()
    torch.testing.assert_close(our_loss, hf_loss, rtol=1e-5, atol=1e-6)
    original = transformers.LlamaForCausalLM.from_pretrained(str(tmp_path / "hf"))
    assert not torch.equal(original.model.layers[0].mlp.up_proj.weight, exported.model.layers[0].mlp.up_proj.weight)


def test_loading_into_a_different_model_is_one_error_line(tmp_path):
    train(1, FLAGS + ["--train-iters", "1", "--save", str(tmp_path / "ckpt")], str(tmp_path / "m.jsonl"))
    args = [a if a != "8" else "4" for a in TINY]   # --num-layers 8 -> 4
    proc = subprocess.run([sys.executable, "pretrain_llama.py", *args, *FLAGS, "--train-iters", "2",
                           "--load", str(tmp_path / "ckpt")], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("pretrain_llama.py: error: checkpoint ")
    assert "num_layers 8 but this run has 4; set --num-layers 8" in lines[0]

"""The qwen3 model family through the command lines: `pretrain_llama.py --model qwen3-tiny` trains (loss finite
and falling) and tp 2 with sequence parallelism, pp 2 under ZB-V, and tp 2 x dp 2 under ZeRO-3 and with the
overlapped gradient reduction give the single-rank losses (fp32; the per-head q/k norms replicated over TP,
their gradients summed over it on each reduction path; a head dim of 32 with 4 heads of a 64-wide model);
`convert-hf` imports a random HF Qwen3ForCausalLM into tp 2 and exports it back with identical tensors and
logits."""
from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from tests.cli import ROOT, train

transformers = pytest.importorskip("transformers")

# a vocabulary of 64 (the preset's is 512): the mock data's pattern then shows in six iterations
QWEN = ["--mock-data", "--model", "qwen3-tiny", "--vocab-size", "64", "--seq-length", "32", "--seed", "1234",
        "--lr", "1e-2", "--lr-warmup-iters", "1", "--clip-grad", "1.0", "--log-interval", "1", "--eval-iters", "0",
        "--num-workers", "0", "--train-iters", "6", "--micro-batch-size", "1", "--global-batch-size", "4"]
TP2 = ["--tensor-model-parallel-size", "2"]
LAYOUTS = {   # name: (processes, flags); the dp 2 ones sum the per-head norms' gradients over TP on the other paths
    "tp2-sp": (2, TP2 + ["--sequence-parallel"]),
    "pp2-zbv": (2, ["--pipeline-model-parallel-size", "2", "--num-virtual-stages-per-pipeline-rank", "2",
                    "--pipeline-schedule", "zbv"]),
    "tp2-dp2-zero3": (4, TP2 + ["--data-parallel-sharding-strategy", "optim_grads_params"]),
    "tp2-dp2-overlap": (4, TP2 + ["--overlap-grad-reduce"]),
}


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("ref") / "m.jsonl")
    return [r["lm_loss"] for r in train(1, [], path, tiny=QWEN)]


def test_qwen3_tiny_trains(reference):
    assert len(reference) == 6 and all(math.isfinite(x) for x in reference)
    assert reference[-1] < reference[0] - 0.05, reference


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_qwen3_layout_matches_single_rank(name, reference, tmp_path):
    nproc, flags = LAYOUTS[name]
    losses = [r["lm_loss"] for r in train(nproc, flags, str(tmp_path / "m.jsonl"), tiny=QWEN)]
    assert losses == pytest.approx(reference, rel=1e-5), (losses, reference)


@pytest.mark.parametrize("tie", [False, True])
def test_convert_hf_qwen3_round_trip(tmp_path, tie):
    cfg = transformers.Qwen3Config(vocab_size=301, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                   max_position_embeddings=64, rope_theta=1e6, tie_word_embeddings=tie)
    torch.manual_seed(0)
    model = transformers.Qwen3ForCausalLM(cfg).eval()
    with torch.no_grad():   # HF starts norms at one: make a mix-up of the q/k norms show
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    model.save_pretrained(tmp_path / "hf", safe_serialization=True)

    def convert(*args: str) -> None:
        proc = subprocess.run([sys.executable, "-m", "llamapipe", "convert-hf", *args], capture_output=True,
                              text=True, timeout=300, cwd=ROOT)
        assert proc.returncode == 0, proc.stderr

    convert("import", "--hf-dir", str(tmp_path / "hf"), "--save", str(tmp_path / "ckpt"),
            "--tensor-model-parallel-size", "2")
    meta = json.loads((tmp_path / "ckpt" / "iter_0000000" / "metadata.json").read_text())
    assert meta["model_config"]["family"] == "qwen3" and meta["model_config"]["kv_channels"] == 16
    norm = meta["tensors"]["model:layers.1.attention.k_norm.weight"]   # replicated over tp: one per head dim
    assert norm["partition_dim"] == -1 and norm["shape"] == [16]
    convert("export", "--load", str(tmp_path / "ckpt"), "--hf-dir", str(tmp_path / "out"))
    assert json.loads((tmp_path / "out" / "config.json").read_text())["model_type"] == "qwen3"
    # the file transformers wrote (tied: without lm_head.weight) against the one export wrote
    exported = load_file(str(tmp_path / "out" / "model.safetensors"))
    original = load_file(str(tmp_path / "hf" / "model.safetensors"))
    assert set(exported) == set(original) and ("lm_head.weight" in original) == (not tie)
    for name, tensor in original.items():
        assert torch.equal(exported[name], tensor), name
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "out")).eval()
    assert type(reloaded).__name__ == "Qwen3ForCausalLM" and reloaded.config.tie_word_embeddings == tie
    ids = torch.randint(0, 301, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.equal(reloaded(ids).logits, model(ids).logits)

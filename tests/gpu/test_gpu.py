"""GPU tier (needs CUDA; skipped on CPU-only machines): bf16 numerics, NCCL training through the CLI.

Run on a GPU machine with `python -m pytest -q -m gpu tests/gpu/test_gpu.py`.
"""
import math

import pytest
import torch

from llamapipe.model.llama import LlamaConfig, LlamaModel
from tests.cli import train

pytestmark = pytest.mark.gpu

SMALL = LlamaConfig(num_layers=2, hidden_size=256, ffn_hidden_size=688, num_attention_heads=8, num_query_groups=4,
                    vocab_size=1000, max_position_embeddings=128)


def test_bf16_cuda_loss_close_to_fp32_cpu():
    """Same weights (seeded by name) in bf16 on CUDA and fp32 on CPU: losses agree to bf16 precision."""
    torch.manual_seed(0)
    tokens = torch.randint(0, SMALL.vocab_size, (2, 64))
    labels = torch.roll(tokens, -1, dims=1)
    ref = LlamaModel(SMALL)(tokens, labels=labels).mean()
    gpu = LlamaModel(SMALL, params_dtype=torch.bfloat16).cuda()
    got = gpu(tokens.cuda(), labels=labels.cuda()).mean()
    torch.testing.assert_close(got.float().cpu(), ref, rtol=2e-2, atol=2e-2)
    got.backward()
    assert all(p.grad is None or torch.isfinite(p.grad).all() for p in gpu.parameters())


def test_nccl_bf16_training_through_cli_loss_falls(tmp_path):
    nproc = min(torch.cuda.device_count(), 2)
    args = ["--train-iters", "20", "--micro-batch-size", "2", "--global-batch-size", "8", "--bf16",
            "--distributed-backend", "nccl", "--lr", "3e-3"]
    if nproc == 2:
        args += ["--pipeline-model-parallel-size", "2", "--pipeline-schedule", "zb-h1"]
    rows = train(nproc, args, str(tmp_path / "m.jsonl"))
    losses = [r["lm_loss"] for r in rows]
    assert all(math.isfinite(x) for x in losses)
    assert sum(losses[-3:]) < sum(losses[:3])
    assert rows[-1]["max_memory_gib"] > 0 and rows[-1]["tflops_per_device"] > 0

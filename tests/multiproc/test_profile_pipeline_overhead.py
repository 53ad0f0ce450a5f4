"""`llamapipe profile` under torchrun: the per-action cost of a pipeline with p2p between two gloo ranks
(`profile_overhead.measure_pipeline`) is agreed by both ranks, finite and in a sane range."""
from __future__ import annotations

import math

import torch

from tests.harness import run_distributed


def _pipeline_worker(rank: int, world: int) -> float:
    from llamapipe.model.llama import LlamaConfig
    from llamapipe.tools import profile_comm, profile_model, profile_overhead
    torch.set_num_threads(1)
    m = LlamaConfig(num_layers=2, hidden_size=64, ffn_hidden_size=128, num_attention_heads=4, num_query_groups=4,
                    vocab_size=512, max_position_embeddings=32)
    comm = profile_comm.measure(torch.device("cpu"), 32 * 64 * 4)
    return profile_overhead.measure_pipeline(m, 32, 1, torch.float32, torch.device("cpu"), 3, comm,
                                             profile_model.measure_chunk)


def test_pipelined_action_cost_is_agreed_and_sane():
    """Both ranks fit the same number from the same all-reduced times; a broken fit (compute left in, the
    p2p latency counted twice with the wrong sign) lands outside 0-20 ms per action on a tiny model."""
    results = run_distributed(_pipeline_worker, 2, timeout=180)
    assert results[0] == results[1]
    assert math.isfinite(results[0]) and 0.0 <= results[0] < 20e-3

"""Tied embeddings across two pipeline ranks (gloo): the first rank's embedding and the last rank's output weight
start equal; `finalize_model_grads` leaves both with the sum of the two gradients (the all-reduce over the
embedding group), bit for bit alike; the save-time comparison (an all-gather over the embedding group) says
equal on both ranks, and not equal on both once one copy moves by one ulp."""
from __future__ import annotations

import torch

from llamapipe.core.distributed.grad_reduce import finalize_model_grads, tied_copies_equal
from llamapipe.core.parallel_state import destroy_model_parallel, initialize_model_parallel
from llamapipe.model.llama import LlamaConfig, LlamaModel
from tests.harness import run_distributed

CONFIG = LlamaConfig(num_layers=2, hidden_size=32, ffn_hidden_size=64, num_attention_heads=4, num_query_groups=2,
                     vocab_size=100, tie_word_embeddings=True)


def _rank(rank: int, world_size: int) -> dict:
    ps = initialize_model_parallel(tp=1, pp=2)
    chunk = LlamaModel(CONFIG, ps, layer_range=(rank, rank + 1), pre_process=rank == 0, post_process=rank == 1,
                       seed=5)
    weight = chunk.embedding.weight if rank == 0 else chunk.output.weight
    start = weight.detach().clone()
    weight.grad = torch.full_like(weight, float(rank + 1)) * torch.arange(weight.shape[0]).unsqueeze(1)
    for p in chunk.parameters():
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    finalize_model_grads([chunk], ps, None, global_tokens=1.0)
    equal = tied_copies_equal([chunk], ps)
    with torch.no_grad():
        if rank == 1:
            weight[3, 4] = torch.nextafter(weight[3, 4], torch.tensor(1.0))
    moved = tied_copies_equal([chunk], ps)
    destroy_model_parallel()
    return {"start": start, "grad": weight.grad.clone(), "equal": equal, "moved": moved}


def test_two_stages_sum_and_compare_their_copies():
    first, last = run_distributed(_rank, 2, timeout=120)
    assert torch.equal(first["start"], last["start"]), "the copies must start equal"
    want = 3.0 * torch.arange(first["grad"].shape[0]).unsqueeze(1).expand_as(first["grad"])
    assert torch.equal(first["grad"], want) and torch.equal(last["grad"], want)
    assert first["equal"] is True and last["equal"] is True
    assert first["moved"] is False and last["moved"] is False

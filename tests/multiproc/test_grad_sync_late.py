"""--overlap-grad-reduce with a gradient that arrives after the plan's last action (core/distributed/grad_sync.py):
the vocabulary-parallel input embedding's shard (`grad_after_plan`) gets its weight gradient after every chunk is
done, so its bucket must not start at `chunk_done` but at `finish`, after the others. One process: when what
starts; two gloo ranks: the sums equal `finalize_model_grads` without overlap, bit for bit, and a sync that
treated the embedding like the rest (launched at chunk_done) loses its gradient (what the marker is for)."""
from __future__ import annotations

import torch
from torch import nn

from llamapipe.core.distributed.grad_reduce import finalize_model_grads
from llamapipe.core.distributed.grad_sync import GradSync
from llamapipe.core.parallel_state import ParallelState, destroy_model_parallel, initialize_model_parallel
from llamapipe.core.tensor_parallel.vocab_pipeline import PipelineVocabEmbedding
from llamapipe.core.tensor_parallel.weight_grad_store import WeightGradStore
from tests.harness import run_distributed

VOCAB, HIDDEN = 16, 8


class Chunk(nn.Module):
    """An embedding shard run apart (as the executor's pre-pass does) and one linear layer."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embedding = PipelineVocabEmbedding(VOCAB, HIDDEN, None, 0, 1)
        nn.init.normal_(self.embedding.weight)
        self.linear = nn.Linear(HIDDEN, HIDDEN)


def _step(chunk: Chunk, sync: GradSync | None, seed: int) -> int:
    """One step in the executor's order: embedding pre-pass, the plan's backward (the last one armed), the chunk
    done, then the embedding's backward. Returns how many buckets had started before the embedding's backward."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (2, 4), generator=gen)
    partial = chunk.embedding(ids)                                   # before the plan
    x = partial.detach().requires_grad_(True)
    if sync is not None:
        sync.begin_step(WeightGradStore())
        sync.arm(0)
        sync.last_action()
    torch.tanh(chunk.linear(x)).square().sum().backward()            # the plan's one BW
    if sync is not None:
        sync.disarm()
        sync.chunk_done(0, last_action=True)
    started = 0 if sync is None else sum(b.flat is not None for b in sync.buckets)
    torch.autograd.backward(partial, x.grad)                          # after the plan: the embedding's gradient
    return started


def test_late_parameter_has_its_own_bucket_started_at_finish():
    chunk = Chunk()
    sync = GradSync([chunk], ParallelState(), bucket_size=1)
    assert [b.params for b in sync.late_buckets] == [[chunk.embedding.weight]]
    started = _step(chunk, sync, 0)
    assert started == len(sync.buckets) - 1, "every bucket but the embedding's should start at chunk_done"
    want = chunk.embedding.weight.grad.clone() / 3.0
    assert sync.finish(3.0) == (0, len(sync.buckets) - 1, 1)      # the linear's during the BW, the late one after
    assert torch.equal(chunk.embedding.weight.grad, want) and want.abs().sum() > 0


def _dp_rank(rank: int, world_size: int) -> dict:
    ps = initialize_model_parallel(tp=1, pp=1)
    plain, overlapped, unmarked = Chunk(), Chunk(), Chunk()
    del unmarked.embedding.weight.grad_after_plan                     # the sync before late buckets existed
    syncs = {id(overlapped): GradSync([overlapped], ps, bucket_size=10),
             id(unmarked): GradSync([unmarked], ps, bucket_size=10)}
    for model in (plain, overlapped, unmarked):
        _step(model, syncs.get(id(model)), 10 + rank)
        finalize_model_grads([model], ps, None, global_tokens=16.0, bucket_size=10, grad_sync=syncs.get(id(model)))
    same = all(torch.equal(a.grad, b.grad) for a, b in zip(plain.parameters(), overlapped.parameters()))
    lost = not torch.equal(plain.embedding.weight.grad, unmarked.embedding.weight.grad)
    grads = [p.grad.clone() for p in overlapped.parameters()]
    destroy_model_parallel()
    return {"same": same, "lost": lost, "grads": grads}


def test_two_dp_ranks_reduce_the_late_gradient_like_the_end_of_step_reduction():
    results = run_distributed(_dp_rank, 2, timeout=120)
    for r in results:
        assert r["same"], "overlapped DP sums with a late gradient differ from the end-of-step reduction"
        assert r["lost"], "an unmarked late gradient should have been reduced too early (the test would not fail)"
    for a, b in zip(results[0]["grads"], results[1]["grads"]):
        assert torch.equal(a, b), "DP replicas disagree after the reduction"

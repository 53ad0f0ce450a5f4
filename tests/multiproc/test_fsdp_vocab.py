"""ZeRO-2/3 with the vocabulary-parallel output layer and embedding shards (core/distributed/fsdp.py), two gloo
ranks (dp 2): the shards are FSDP units of their own, kept as 1/dp pieces, and a step run the executor's way
(both microbatches' embedding pre-pass before anything else, chunk forwards, S for both, then T and the chunk
backwards, the embedding's backward last) gives after the reduction the same gradients as no_shard (DDP's
all-reduce), to fp32 rounding; without the shards as units of their own the pre-pass would make the embedding
FSDP's root and the chunk's forward fail."""
from __future__ import annotations

import torch

from llamapipe.core.distributed.fsdp import apply_data_parallel_sharding, full_of, local_tensor
from llamapipe.core.distributed.grad_reduce import finalize_model_grads
from llamapipe.core.parallel_state import destroy_model_parallel, initialize_model_parallel
from llamapipe.core.tensor_parallel.vocab_pipeline import EmbeddingPrepass, PipelineVocabOutput
from llamapipe.model.llama import LlamaConfig, LlamaModel
from tests.harness import run_distributed

MODEL = LlamaConfig(num_layers=2, hidden_size=32, ffn_hidden_size=64, num_attention_heads=4, vocab_size=250,
                    max_position_embeddings=64)
STRATEGIES = ("no_shard", "optim_grads", "optim_grads_params")


def _step(chunk: LlamaModel, rank: int) -> float:
    gen = torch.Generator().manual_seed(rank)
    ids, labels = torch.randint(0, 250, (2, 2, 8), generator=gen), torch.randint(0, 250, (2, 2, 8), generator=gen)
    prepass = EmbeddingPrepass(chunk.embedding)
    partials = [prepass(ids[mb]) for mb in range(2)]                 # before the chunk's first forward
    inputs = [p.detach().requires_grad_(True) for p in partials]
    hidden, states = [], []
    for mb in range(2):
        chunk.set_input_tensor(inputs[mb])
        hidden.append(chunk())
    for mb in range(2):                                               # S, S
        states.append(chunk.output(hidden[mb].detach(), labels[mb].t()))
    loss = 0.0
    for mb in range(2):                                               # T, B, T, B
        state, stats = states[mb]
        loss += float(PipelineVocabOutput.combine(stats[None])[2].sum())
        partial_grad = chunk.output.backward(state, stats[None], torch.ones(8, 2))
        torch.autograd.backward(hidden[mb], partial_grad)
    torch.autograd.backward(partials, [x.grad for x in inputs])      # the embedding's backward, after the plan
    return loss


def _rank(rank: int, world_size: int) -> dict:
    from torch.distributed.fsdp import FSDPModule
    ps = initialize_model_parallel(1, 1)
    out = {}
    for strategy in STRATEGIES:
        chunk = LlamaModel(MODEL, ps, vocab_parallel=True, vocab_shard=True, seed=3)
        apply_data_parallel_sharding([chunk], strategy, ps)
        if strategy != "no_shard":
            out[strategy + " units"] = [isinstance(m, FSDPModule) for m in (chunk.output, chunk.embedding)]
            out[strategy + " rows"] = [local_tensor(m.weight).shape[0] for m in (chunk.output, chunk.embedding)]
        out[strategy + " loss"] = _step(chunk, rank)
        finalize_model_grads([chunk], ps, None, global_tokens=64.0)
        out[strategy] = {n: full_of(local_tensor(p.grad), p).clone() for n, p in chunk.named_parameters()}
    destroy_model_parallel()
    return out


def test_zero2_and_zero3_shard_the_vocabulary_units_and_match_no_shard():
    for r in run_distributed(_rank, 2, timeout=180):
        for strategy in STRATEGIES[1:]:
            assert r[strategy + " units"] == [True, True], f"{strategy}: the vocabulary shards are not FSDP units"
            assert r[strategy + " rows"] == [128, 128], f"{strategy}: 256 padded rows not split over dp 2"
            assert r[strategy + " loss"] == r["no_shard loss"]
            grads, want = r[strategy], r["no_shard"]
            assert set(grads) == set(want) and {"output.weight", "embedding.weight"} <= set(want)
            for name in want:
                assert want[name].abs().sum() > 0, f"{name}: no gradient"
                torch.testing.assert_close(grads[name], want[name], rtol=1e-6, atol=1e-8, msg=f"{strategy} {name}")

"""Per-rank memory of each data-parallel sharding strategy at dp 4, counted from the tensors' storages.

After one training step's gradient reduction (tiny LLaMA chunk, fp32, AdamW state present), each rank holds
parameters + gradients + optimizer state. ZeRO says: no_shard holds all of it (4 bytes x 4 per element),
optim (ZeRO-1) shards the Adam moments, optim_grads / optim_grads_params shard everything (here at most 0.3x).
Between forward and backward ZeRO-2 keeps every layer's gathered weights; ZeRO-3 frees them.
The reduced gradients of every strategy are also checked against no_shard's.
"""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from llamapipe.core.config import OptimizerConfig
from llamapipe.core.distributed import fsdp_internals
from llamapipe.core.distributed.fsdp import STRATEGIES, apply_data_parallel_sharding, full_of, local_tensor, \
    storage_bytes
from llamapipe.core.distributed.grad_reduce import finalize_model_grads
from llamapipe.core.optimizer import build_optimizer
from llamapipe.core.parallel_state import destroy_model_parallel, initialize_model_parallel
from llamapipe.model.llama import LlamaConfig, LlamaModel
from tests.harness import run_distributed

MODEL = LlamaConfig(num_layers=4, hidden_size=64, ffn_hidden_size=128, num_attention_heads=4, vocab_size=256,
                    max_position_embeddings=64)
CFG = OptimizerConfig(lr=1e-3, clip_grad=1.0)


def _param_bytes(chunk: torch.nn.Module) -> int:
    """Parameter storages now allocated: the shards and, under FSDP, any gathered (unsharded) weights."""
    tensors = list(chunk.parameters())
    sharding = getattr(chunk, "_dp_sharding", None)
    if sharding is not None:
        tensors += [param for _, _, param in fsdp_internals.gathered_params(sharding.param_groups())
                    if param is not None]
    return storage_bytes(tensors)


def _measure(rank: int, world_size: int, strategy: str) -> dict:
    ps = initialize_model_parallel(1, 1)
    chunk = LlamaModel(MODEL, ps, layer_range=(0, MODEL.num_layers), pre_process=True, post_process=True, seed=7)
    apply_data_parallel_sharding([chunk], strategy, ps)
    opt = build_optimizer([chunk], replace(CFG, use_distributed_optimizer=strategy == "optim"), ps)
    gen = torch.Generator().manual_seed(0)
    ids, labels = torch.randint(0, 256, (8, 16), generator=gen), torch.randint(0, 256, (8, 16), generator=gen)
    mine = slice(rank * 8 // world_size, (rank + 1) * 8 // world_size)
    out = {}
    for step in range(2):                      # the second step measures with the Adam state allocated
        opt.zero_grad()
        loss = chunk(input_ids=ids[mine], labels=labels[mine]).sum()
        out["params_in_backward"] = _param_bytes(chunk)
        loss.backward()
        finalize_model_grads([chunk], ps, None, global_tokens=float(ids.numel()))
        if step == 1:
            out["grads"] = {n: full_of(local_tensor(p.grad), p).clone() for n, p in chunk.named_parameters()}
            break
        opt.step()
    state = [t for s in opt.inner.state.values() for t in s.values() if torch.is_tensor(t) and t.dim() > 0]
    masters = [m for m, has in zip(opt.mains, opt._has_master) if has]
    out["bytes"] = (_param_bytes(chunk) + storage_bytes([p.grad for p in chunk.parameters()])
                    + storage_bytes(state + masters))
    destroy_model_parallel()
    return out


def _all_strategies(rank: int, world_size: int) -> dict:
    return {s: _measure(rank, world_size, s) for s in STRATEGIES}


@pytest.fixture(scope="module")
def measured() -> list[dict]:
    return run_distributed(_all_strategies, 4, timeout=240)


def test_memory_shrinks_as_zero_says(measured):
    for rank in measured:
        full = rank["no_shard"]["bytes"]
        ratios = {s: rank[s]["bytes"] / full for s in STRATEGIES}
        assert 0.6 < ratios["optim"] < 0.65, ratios    # params + grads full, moments / 4: (2 + 2/4) / 4
        assert ratios["optim_grads"] <= 0.3 and ratios["optim_grads_params"] <= 0.3, ratios
        # between forward and backward ZeRO-2 holds the gathered weights of every layer, ZeRO-3 only the shards
        assert rank["optim_grads"]["params_in_backward"] > 2 * rank["optim_grads_params"]["params_in_backward"], \
            {s: rank[s]["params_in_backward"] for s in STRATEGIES}


def test_reduced_gradients_equal_no_shard(measured):
    for rank in measured:
        for strategy in STRATEGIES[1:]:
            for name, grad in rank["no_shard"]["grads"].items():
                torch.testing.assert_close(rank[strategy]["grads"][name], grad, rtol=1e-5, atol=1e-7)

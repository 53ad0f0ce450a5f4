"""finalize_model_grads on gloo ranks: DP reduction divided by the global token count equals the full-batch
gradient of the token-averaged loss; bucket size and overlap do not change a bit; sequence-parallel
grads are summed over TP and the token count travels from the last pipeline stage."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from llamapipe.core.distributed.grad_reduce import finalize_model_grads
from llamapipe.core.parallel_state import destroy_model_parallel, initialize_model_parallel
from tests.harness import run_distributed


def _run(fn, world_size: int) -> list:
    return run_distributed(fn, world_size, timeout=150)


def _toy_lm() -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 11))
    for p in model.parameters():
        p.tensor_model_parallel, p.partition_dim = False, -1
    return model


def _batch() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(2, 7, 6, generator=gen)              # (b, s, h): one sample per DP rank
    labels = torch.randint(0, 11, (2, 7), generator=gen)
    mask = torch.tensor([[1, 1, 1, 1, 1, 1, 0], [1, 0, 1, 0, 0, 0, 0]], dtype=torch.float32)
    return x, labels, mask


def _loss_sum(model: nn.Module, x: torch.Tensor, labels: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    logits = model(x)
    per_token = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), reduction="none")
    return (per_token * mask.reshape(-1)).sum()


def _dp_rank(rank: int, world_size: int) -> dict:
    state = initialize_model_parallel(tp=1, pp=1)
    x, labels, mask = _batch()
    reference = _toy_lm()
    (_loss_sum(reference, x, labels, mask) / mask.sum()).backward()
    model = _toy_lm()
    results = {}
    for name, kwargs in (("default", {}), ("tiny_buckets", {"bucket_size": 1}), ("mixed_buckets", {"bucket_size": 50}),
                         ("overlap", {"bucket_size": 50, "overlap_grad_reduce": True})):
        model.zero_grad(set_to_none=True)
        _loss_sum(model, x[rank:rank + 1], labels[rank:rank + 1], mask[rank:rank + 1]).backward()
        total = finalize_model_grads([model], state, mask[rank].sum(), **kwargs)
        results[name] = [p.grad.clone() for p in model.parameters()]
        results["total"] = total
    results["reference"] = [p.grad.clone() for p in reference.parameters()]
    destroy_model_parallel()
    return results


def test_dp_grads_equal_full_batch_gradient_for_any_bucketing():
    for rank_result in _run(_dp_rank, 2):
        assert rank_result["total"] == 8.0
        for got, want in zip(rank_result["default"], rank_result["reference"]):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7)
        for variant in ("tiny_buckets", "mixed_buckets", "overlap"):
            for got, want in zip(rank_result[variant], rank_result["default"]):
                assert torch.equal(got, want), f"{variant} differs from the default bucketing"


def _tp_pp_rank(rank: int, world_size: int) -> dict:
    state = initialize_model_parallel(tp=2, pp=2)
    chunk = nn.Module()
    chunk.norm = nn.Parameter(torch.zeros(3))
    chunk.norm.tensor_model_parallel, chunk.norm.partition_dim, chunk.norm.sequence_parallel = False, -1, True
    chunk.w = nn.Parameter(torch.zeros(2, 3))
    chunk.w.tensor_model_parallel, chunk.w.partition_dim = True, 0
    out = {"tp_rank": state.tp_rank, "pp_rank": state.pp_rank}
    for label, tokens in (("divided", torch.tensor(10.0)), ("undivided", None)):
        chunk.norm.grad = torch.full((3,), float(state.tp_rank + 1) + 10 * state.pp_rank)
        chunk.w.grad = torch.full((2, 3), float(rank))
        # only the last stage knows the count; the first stage's argument is ignored
        passed = tokens if state.is_last_stage else (None if label == "divided" else torch.tensor(99.0))
        out[label] = (finalize_model_grads([chunk], state, passed), chunk.norm.grad.clone(), chunk.w.grad.clone())
    out["rank"] = rank
    destroy_model_parallel()
    return out


def test_sequence_parallel_sum_and_token_count_from_last_stage():
    for r in _run(_tp_pp_rank, 4):
        norm_sum = 3.0 + 20 * r["pp_rank"]  # (1 + 10 pp) + (2 + 10 pp) over the two TP ranks
        total, norm_grad, w_grad = r["divided"]
        assert total == 10.0
        torch.testing.assert_close(norm_grad, torch.full((3,), norm_sum / 10.0), rtol=1e-6, atol=0)
        torch.testing.assert_close(w_grad, torch.full((2, 3), r["rank"] / 10.0), rtol=1e-6, atol=0)
        total, norm_grad, w_grad = r["undivided"]
        assert total is None
        torch.testing.assert_close(norm_grad, torch.full((3,), norm_sum), rtol=0, atol=0)
        torch.testing.assert_close(w_grad, torch.full((2, 3), float(r["rank"])), rtol=0, atol=0)


def _accumulated_vs_summed(fp32_accumulation: bool, microbatches: int = 24):
    """Gradients accumulated over microbatches, and the fp32 sum of each microbatch's own gradient."""
    from llamapipe.core.distributed.grad_reduce import accumulate_grads_in_fp32
    from llamapipe.model.llama import LlamaConfig, LlamaModel
    cfg = LlamaConfig(num_layers=2, hidden_size=64, ffn_hidden_size=128, num_attention_heads=4, num_query_groups=2,
                      vocab_size=256, max_position_embeddings=64)
    model = LlamaModel(cfg, params_dtype=torch.bfloat16)
    if fp32_accumulation:
        assert accumulate_grads_in_fp32([model])
    gen = torch.Generator().manual_seed(0)
    batches = [torch.randint(0, 256, (2, 17), generator=gen) for _ in range(microbatches)]
    summed = {name: torch.zeros(p.shape) for name, p in model.named_parameters()}
    for tokens in batches:                       # each microbatch's own gradient, summed in fp32
        model.zero_grad(set_to_none=True)
        model(tokens[:, :-1], labels=tokens[:, 1:]).sum().backward()
        for name, p in model.named_parameters():
            summed[name] += p.grad.float()
    model.zero_grad(set_to_none=True)
    for tokens in batches:                       # the same microbatches accumulated in .grad
        model(tokens[:, :-1], labels=tokens[:, 1:]).sum().backward()
    return {name: (p.grad, summed[name]) for name, p in model.named_parameters()}


def test_bf16_grads_accumulate_in_fp32_across_microbatches():
    fp32 = _accumulated_vs_summed(True)
    assert all(grad.dtype == torch.float32 for grad, _ in fp32.values())
    for name, (grad, summed) in fp32.items():
        torch.testing.assert_close(grad, summed, rtol=1e-5, atol=1e-5, msg=name)
    # Without it the same run drifts: bf16 accumulation loses bits at every microbatch.
    bf16 = _accumulated_vs_summed(False)
    worst = max(((g.float() - s).abs().max() / s.abs().max()).item() for g, s in bf16.values())
    assert worst > 1e-3

"""Optimizer on gloo ranks: grad norm and clipping over a TP-sharded model equal the unsharded model's;
ZeRO-1 (dp=2) follows the plain optimizer step for step (fp32, bf16), gathers the same per-parameter state,
resumes from it, and skips an fp16 step when only one DP rank's shard holds an inf."""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from torch import nn

from llamapipe.core.config import OptimizerConfig
from llamapipe.core.optimizer import build_optimizer
from llamapipe.core.parallel_state import destroy_model_parallel, initialize_model_parallel
from tests.harness import run_distributed


def _run(fn, world_size: int) -> list:
    return run_distributed(fn, world_size, timeout=150)

CFG = OptimizerConfig(lr=1e-2, weight_decay=0.1, adam_beta1=0.9, adam_beta2=0.95, adam_eps=1e-8, clip_grad=0.5)
OUT, IN = 8, 5


def _full_params() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(3)
    return {"weight": torch.randn(OUT, IN, generator=gen), "bias": torch.randn(OUT, generator=gen),
            "norm": 1.0 + 0.1 * torch.randn(IN, generator=gen)}


def _full_grads(step: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(50 + step)
    return {"weight": torch.randn(OUT, IN, generator=gen), "bias": torch.randn(OUT, generator=gen),
            "norm": torch.randn(IN, generator=gen)}


def _tp_chunk(tp_rank: int, tp_size: int) -> nn.Module:
    """Column-parallel linear (weight and bias sharded on dim 0) and a TP-replicated norm weight."""
    rows = slice(tp_rank * OUT // tp_size, (tp_rank + 1) * OUT // tp_size)
    chunk = nn.Module()
    for name, value in _full_params().items():
        sharded = name != "norm"
        param = nn.Parameter(value[rows].clone() if sharded else value.clone())
        param.tensor_model_parallel, param.partition_dim = sharded, (0 if sharded else -1)
        setattr(chunk, name, param)
    return chunk


def _tp_rank(rank: int, world_size: int) -> dict:
    state = initialize_model_parallel(tp=2, pp=1)
    chunk = _tp_chunk(state.tp_rank, 2)
    opt = build_optimizer([chunk], CFG, state)
    rows = slice(state.tp_rank * OUT // 2, (state.tp_rank + 1) * OUT // 2)
    norms = []
    for step in range(3):
        grads = _full_grads(step)
        for name, p in chunk.named_parameters():
            p.grad = grads[name][rows].clone() if name != "norm" else grads[name].clone()
        norms.append(opt.step().grad_norm)
        opt.zero_grad()
    out = {"tp_rank": state.tp_rank, "norms": norms, **{n: p.detach().clone() for n, p in chunk.named_parameters()}}
    destroy_model_parallel()
    return out


def test_grad_norm_and_clipping_over_tp_equal_unsharded_model(rank_results):
    ranks = [r["tp"] for r in rank_results]
    full = {n: nn.Parameter(v) for n, v in _full_params().items()}
    ref = torch.optim.AdamW([{"params": [full["weight"]], "weight_decay": CFG.weight_decay},
                             {"params": [full["bias"], full["norm"]], "weight_decay": 0.0}],
                            lr=CFG.lr, betas=(CFG.adam_beta1, CFG.adam_beta2), eps=CFG.adam_eps)
    ref_norms = []
    for step in range(3):
        for name, g in _full_grads(step).items():
            full[name].grad = g
        ref_norms.append(torch.nn.utils.clip_grad_norm_(list(full.values()), CFG.clip_grad).item())
        ref.step()
    for r in ranks:
        torch.testing.assert_close(torch.tensor(r["norms"]), torch.tensor(ref_norms), rtol=1e-6, atol=0)
        torch.testing.assert_close(r["norm"], full["norm"].detach(), rtol=1e-6, atol=1e-7)
    for name in ("weight", "bias"):
        merged = torch.cat([ranks[0][name], ranks[1][name]])
        torch.testing.assert_close(merged, full[name].detach(), rtol=1e-6, atol=1e-7)


class _Toy(nn.Module):
    """Odd sizes (68 elements) so the two DP shards split a weight matrix in the middle."""

    def __init__(self, dtype: torch.dtype) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.proj = nn.Linear(5, 7)
        self.norm = nn.Parameter(torch.ones(5))
        self.out = nn.Linear(7, 3, bias=False)
        for p in self.parameters():
            p.tensor_model_parallel, p.partition_dim = False, -1
        self.to(dtype)


def _set_grads(model: nn.Module, step: int, scale: float = 1.0) -> None:
    gen = torch.Generator().manual_seed(70 + step)  # identical on every DP rank, as after the DP all-reduce
    for p in model.parameters():
        p.grad = (scale * torch.randn(p.shape, generator=gen)).to(p.dtype)


def _zero1_rank(rank: int, world_size: int) -> dict:
    state = initialize_model_parallel(tp=1, pp=1)
    out = {}
    for dtype in (torch.float32, torch.bfloat16):
        cfg = replace(CFG, bf16=dtype == torch.bfloat16, clip_grad=0.05)
        plain_model, zero_model = _Toy(dtype), _Toy(dtype)
        plain = build_optimizer([plain_model], cfg, state)
        zero = build_optimizer([zero_model], replace(cfg, use_distributed_optimizer=True), state)
        assert zero.sharded and sum(s.numel for s in zero.segments) == 34
        for step in range(4):
            for model, opt in ((plain_model, plain), (zero_model, zero)):
                _set_grads(model, step)
                out[(dtype, "norm", step, model is zero_model)] = opt.step().grad_norm
                opt.zero_grad()
        out[(dtype, "params")] = [(p.detach().clone(), q.detach().clone())
                                  for p, q in zip(plain_model.parameters(), zero_model.parameters())]
        out[(dtype, "state")] = (plain.state_dict(), zero.state_dict())
        resumed_model = _Toy(dtype)
        resumed_model.load_state_dict(zero_model.state_dict())
        resumed = build_optimizer([resumed_model], replace(cfg, use_distributed_optimizer=True), state)
        resumed.load_state_dict(plain.state_dict())
        for model, opt in ((plain_model, plain), (resumed_model, resumed)):
            _set_grads(model, 9)
            opt.step()
        out[(dtype, "resumed")] = [(p.detach().clone(), q.detach().clone())
                                   for p, q in zip(plain_model.parameters(), resumed_model.parameters())]
    out["fp16_skip"] = _fp16_inf_on_one_shard(state)
    destroy_model_parallel()
    return out


def _both_layouts(rank: int, world_size: int) -> bytes:
    """One spawn for both checks: groups for tp=2 first, then new groups for dp=2."""
    return {"tp": _tp_rank(rank, world_size), "zero1": _zero1_rank(rank, world_size)}


@pytest.fixture(scope="module")
def rank_results() -> list[dict]:
    return _run(_both_layouts, 2)


def _fp16_inf_on_one_shard(state) -> tuple:
    model = _Toy(torch.float16)
    cfg = replace(CFG, fp16=True, initial_loss_scale=64.0, hysteresis=1, use_distributed_optimizer=True)
    opt = build_optimizer([model], cfg, state)
    before = [p.detach().clone() for p in model.parameters()]
    _set_grads(model, 0, scale=64.0)
    if state.dp_rank == 1:  # out.weight lies entirely in DP rank 1's shard; rank 0 never sees this inf
        model.out.weight.grad[2, 6] = float("inf")
    result = opt.step()
    unchanged = all(torch.equal(p.detach(), b) for p, b in zip(model.parameters(), before))
    return result.update_successful, result.found_inf, opt.get_loss_scale(), unchanged


def test_zero1_matches_plain_optimizer(rank_results):
    for r in (r["zero1"] for r in rank_results):
        for dtype in (torch.float32, torch.bfloat16):
            for step in range(4):
                assert abs(r[(dtype, "norm", step, True)] / r[(dtype, "norm", step, False)] - 1) < 1e-6
            for plain, zero in r[(dtype, "params")] + r[(dtype, "resumed")]:
                torch.testing.assert_close(zero, plain, rtol=1e-5, atol=0)
            plain_state, zero_state = r[(dtype, "state")]
            assert plain_state["step"] == zero_state["step"] == 4
            for name, entry in plain_state["param_state"].items():
                assert set(entry) == set(zero_state["param_state"][name])
                for key, value in entry.items():
                    torch.testing.assert_close(zero_state["param_state"][name][key], value, rtol=1e-5, atol=1e-8)
        assert r["fp16_skip"] == (False, True, 32.0, True)

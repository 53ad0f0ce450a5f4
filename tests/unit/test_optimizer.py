"""Single-process optimizer tests: LR schedule, AdamW vs torch reference, master weights, loss scaling, state."""
from __future__ import annotations

import copy
import math
from dataclasses import replace

import pytest
import torch
from torch import nn

from llamapipe.core.config import OptimizerConfig
from llamapipe.core.optimizer import DynamicGradScaler, OptimizerParamScheduler, build_optimizer
from llamapipe.core.parallel_state import ParallelState
from llamapipe.training.flag_names import worded_as_flags

CFG = OptimizerConfig(lr=1e-2, weight_decay=0.1, adam_beta1=0.9, adam_beta2=0.95, adam_eps=1e-8, clip_grad=0.0)


class Toy(nn.Module):
    """Linear layer (weight decays, bias does not) and a norm weight, with the model's TP attributes."""

    def __init__(self, seed: int = 0, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.proj = nn.Linear(5, 7)
        self.norm = nn.Parameter(1.0 + 0.1 * torch.randn(5))
        for name, p in self.named_parameters():
            p.tensor_model_parallel, p.partition_dim = name.startswith("proj"), (0 if name.startswith("proj") else -1)
        self.to(dtype)


def _grads(model: nn.Module, step: int, scale: float = 1.0) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(100 + step)
    return [scale * torch.randn(p.shape, generator=gen) for p in model.parameters()]


def _reference(model: nn.Module) -> tuple[list[nn.Parameter], torch.optim.AdamW]:
    """fp32 copies of the params and a plain torch AdamW with Megatron's decay groups."""
    params = [nn.Parameter(p.detach().float().clone()) for p in model.parameters()]
    decay = [p for p in params if p.dim() > 1]
    no_decay = [p for p in params if p.dim() == 1]
    ref = torch.optim.AdamW([{"params": decay, "weight_decay": CFG.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}],
                            lr=CFG.lr, betas=(CFG.adam_beta1, CFG.adam_beta2), eps=CFG.adam_eps)
    return params, ref


def test_lr_schedule_matches_megatron_formulas():
    cfg = replace(CFG, lr=1.0, min_lr=0.1, lr_warmup_iters=2, lr_decay_iters=10)
    holder = nn.Linear(1, 1)
    for style, mid in (("cosine", lambda r: 0.5 * (math.cos(math.pi * r) + 1)), ("linear", lambda r: 1 - r),
                       ("constant", None)):
        opt = torch.optim.SGD(holder.parameters(), lr=5.0)
        sched = OptimizerParamScheduler(opt, replace(cfg, lr_decay_style=style), train_iters=99)
        got = [sched.get_lr()] + [sched.step() for _ in range(12)]
        want = []
        for n in range(13):
            if n <= 2:
                want.append(n / 2)
            elif style == "constant":
                want.append(1.0)
            elif n > 10:
                want.append(0.1)
            else:
                want.append(0.1 + 0.9 * mid((n - 2) / 8))
        assert got == pytest.approx(want, rel=1e-12, abs=1e-15), style
        assert opt.param_groups[0]["lr"] == pytest.approx(want[-1])
    resumed = OptimizerParamScheduler(torch.optim.SGD(holder.parameters(), lr=5.0), cfg, train_iters=99)
    resumed.load_state_dict(sched.state_dict(), override=True)   # the last style tried differs: take this one
    assert resumed.num_steps == 12 and resumed.get_lr() == pytest.approx(0.1)  # cosine, past decay
    with pytest.raises(ValueError, match="--lr-warmup-iters"), worded_as_flags():
        OptimizerParamScheduler(opt, replace(cfg, lr_warmup_iters=20), train_iters=99)


def test_decay_defaults_to_train_iters():
    opt = torch.optim.SGD(nn.Linear(1, 1).parameters(), lr=1.0)
    sched = OptimizerParamScheduler(opt, replace(CFG, lr=1.0, min_lr=0.0, lr_decay_style="linear"), train_iters=4)
    assert [sched.step() for _ in range(5)] == pytest.approx([0.75, 0.5, 0.25, 0.0, 0.0])


def _megatron_lr(n: float, warmup: float, decay: float, style: str, max_lr: float = 1.0, min_lr: float = 0.1) -> float:
    """Megatron-LM's OptimizerParamScheduler.get_lr, written out for one step count."""
    if warmup > 0 and n <= warmup:
        return max_lr * n / warmup
    if n > decay:
        return min_lr
    ratio = (n - warmup) / (decay - warmup)
    coeff = 1.0 - ratio if style == "linear" else 0.5 * (math.cos(math.pi * ratio) + 1.0)
    return min_lr + coeff * (max_lr - min_lr)


# global batch sizes of --global-batch-size 12 --rampup-batch-size 2 2 20 (tests/unit/test_batch_rampup.py)
RAMP_BATCHES = [2, 2, 4, 6, 8, 12, 12]
CONSUMED = [2, 4, 8, 14, 22, 34, 46]


@pytest.mark.parametrize("style", ["cosine", "linear"])
def test_sample_based_schedule_counts_consumed_samples(style):
    """--train-samples: the step count is the consumed samples, also while the batch ramps up;
    --lr-warmup-samples 6 --lr-decay-samples 40."""
    cfg = replace(CFG, lr=1.0, min_lr=0.1, lr_decay_style=style, lr_warmup_iters=3, lr_decay_iters=5,
                  lr_warmup_samples=6, lr_decay_samples=40)    # the iteration flags are not used
    opt = torch.optim.SGD(nn.Linear(1, 1).parameters(), lr=5.0)
    sched = OptimizerParamScheduler(opt, cfg, train_iters=7, train_samples=50)
    assert sched.counts_samples and sched.get_lr() == 0.0
    got = [sched.step(batch) for batch in RAMP_BATCHES]
    assert CONSUMED[:2] == [2, 4] and got[:2] == pytest.approx([2 / 6, 4 / 6], rel=1e-15)
    assert got[-1] == 0.1                                    # 46 samples > --lr-decay-samples 40
    assert got == pytest.approx([_megatron_lr(n, 6, 40, style) for n in CONSUMED], rel=1e-12, abs=1e-15)
    resumed = OptimizerParamScheduler(torch.optim.SGD(nn.Linear(1, 1).parameters(), lr=5.0), cfg, 7, 50)
    resumed.load_state_dict(sched.state_dict())
    assert resumed.num_steps == 46 and resumed.get_lr(22) == pytest.approx(got[4], rel=1e-15)
    with pytest.raises(ValueError, match=r"--lr-warmup-samples 60 is larger than the decay length "
                                         r"\(--lr-decay-samples or --train-samples\) 40"), worded_as_flags():
        OptimizerParamScheduler(opt, replace(cfg, lr_warmup_samples=60), train_iters=7, train_samples=50)


def test_warmup_fraction_of_the_decay_span():
    """--lr-warmup-fraction 0.25: a quarter of --train-samples 48 (no --lr-decay-samples) = 12 samples; with
    --train-iters, a fraction of the decay iterations, the same values as the equal --lr-warmup-iters."""
    cfg = replace(CFG, lr=1.0, min_lr=0.1, lr_decay_style="cosine", lr_warmup_fraction=0.25)
    opt = torch.optim.SGD(nn.Linear(1, 1).parameters(), lr=5.0)
    sched = OptimizerParamScheduler(opt, cfg, train_iters=7, train_samples=48)
    assert (sched.lr_warmup_steps, sched.lr_decay_steps) == (12.0, 48)
    got = [sched.step(batch) for batch in RAMP_BATCHES]
    assert got == pytest.approx([_megatron_lr(n, 12, 48, "cosine") for n in CONSUMED], rel=1e-12, abs=1e-15)
    by_iters = OptimizerParamScheduler(opt, replace(cfg, lr_warmup_fraction=None, lr_warmup_iters=2,
                                                    lr_decay_iters=10), train_iters=99)
    by_fraction = OptimizerParamScheduler(opt, replace(cfg, lr_decay_iters=10, lr_warmup_fraction=0.2), train_iters=99)
    assert not by_fraction.counts_samples
    assert [by_fraction.step() for _ in range(12)] == [by_iters.step() for _ in range(12)]


@pytest.mark.parametrize("clip_grad", [0.0, 0.5])
def test_adamw_matches_torch_reference(clip_grad):
    """fp32: every step equals torch.optim.AdamW (+ clip_grad_norm_) with Megatron's decay groups."""
    model = Toy()
    ref_params, ref = _reference(model)
    opt = build_optimizer([model], replace(CFG, clip_grad=clip_grad), ParallelState())
    for step in range(4):
        grads = _grads(model, step, scale=3.0)
        for p, r, g in zip(model.parameters(), ref_params, grads):
            p.grad, r.grad = g.clone(), g.clone()
        ref_norm = torch.nn.utils.clip_grad_norm_(ref_params, clip_grad if clip_grad else float("inf"))
        result = opt.step()
        ref.step()
        assert result.update_successful and not result.found_inf
        assert result.grad_norm == pytest.approx(ref_norm.item(), rel=1e-6)
        for p, r in zip(model.parameters(), ref_params):
            torch.testing.assert_close(p.detach(), r.detach(), rtol=1e-6, atol=1e-7)
        opt.zero_grad()
        assert all(p.grad is None for p in model.parameters())


def test_bf16_master_weights_track_fp32_reference():
    """bf16 model: fp32 masters follow the fp32 reference on the bf16 grads; the model holds bf16(master)."""
    model = Toy(dtype=torch.bfloat16)
    ref_params, ref = _reference(model)
    opt = build_optimizer([model], replace(CFG, bf16=True), ParallelState())
    assert opt.get_loss_scale() == 1.0
    for step in range(3):
        for p, r, g in zip(model.parameters(), ref_params, _grads(model, step)):
            p.grad = g.to(torch.bfloat16)
            r.grad = p.grad.float()
        assert opt.step().update_successful
        ref.step()
    state = opt.state_dict()["param_state"]
    for (name, p), r in zip(model.named_parameters(), ref_params):
        torch.testing.assert_close(state[name]["master_param"], r.detach(), rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(p.detach(), r.detach().to(torch.bfloat16), rtol=0, atol=0)


def test_dynamic_loss_scaler_sequence():
    """Megatron's rule: hysteresis is spent by inf steps and refilled only when the scale grows."""
    scaler = DynamicGradScaler(8.0, min_scale=1.0, growth_interval=2, hysteresis=2)
    steps = [True, True, True, False, False, True, False, True, True, True, True]
    want = [8.0, 4.0, 2.0, 2.0, 4.0, 4.0, 4.0, 2.0, 1.0, 1.0, 1.0]
    got = []
    for found_inf in steps:
        scaler.update(found_inf)
        got.append(scaler.scale)
    assert got == want
    again = DynamicGradScaler(8.0, 1.0, 2, 2)
    again.load_state_dict(scaler.state_dict())
    assert again.state_dict() == scaler.state_dict()


def test_fp16_inf_grad_skips_step_and_backs_off():
    model = Toy(dtype=torch.float16)
    cfg = replace(CFG, fp16=True, initial_loss_scale=256.0, hysteresis=1, loss_scale_window=1000)
    opt = build_optimizer([model], cfg, ParallelState())
    before = [p.detach().clone() for p in model.parameters()]
    assert opt.get_loss_scale() == 256.0
    for p, g in zip(model.parameters(), _grads(model, 0)):
        p.grad = (256.0 * g).half()
    model.proj.weight.grad[1, 2] = float("inf")
    result = opt.step()
    assert not result.update_successful and result.found_inf and math.isnan(result.grad_norm)
    assert opt.get_loss_scale() == 128.0 and opt.num_steps == 0
    for p, b in zip(model.parameters(), before):
        torch.testing.assert_close(p.detach(), b, rtol=0, atol=0)
    ref_params, ref = _reference(model)
    opt.zero_grad()
    grads = _grads(model, 1)
    for p, r, g in zip(model.parameters(), ref_params, grads):
        p.grad = (128.0 * g).half()
        r.grad = p.grad.float() / 128.0
    assert opt.step().update_successful
    ref.step()
    for p, r in zip(model.parameters(), ref_params):
        torch.testing.assert_close(p.detach(), r.detach().half(), rtol=0, atol=0)


def test_nonfinite_grad_norm_without_scaler_skips_update():
    model = Toy()
    opt = build_optimizer([model], CFG, ParallelState())
    before = [p.detach().clone() for p in model.parameters()]
    for p, g in zip(model.parameters(), _grads(model, 0)):
        p.grad = g
    model.norm.grad[0] = float("nan")
    result = opt.step()
    assert not result.update_successful and not result.found_inf and math.isnan(result.grad_norm)
    for p, b in zip(model.parameters(), before):
        torch.testing.assert_close(p.detach(), b, rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_state_dict_round_trip_continues_identically(dtype):
    cfg = replace(CFG, bf16=dtype == torch.bfloat16, clip_grad=1.0)
    model = Toy(dtype=dtype)
    opt = build_optimizer([model], cfg, ParallelState())
    for step in range(2):
        for p, g in zip(model.parameters(), _grads(model, step)):
            p.grad = g.to(dtype)
        opt.step()
    state = opt.state_dict()
    assert state["step"] == 2 and set(state["param_state"]) == {"proj.weight", "proj.bias", "norm"}
    for name, p in model.named_parameters():
        entry = state["param_state"][name]
        assert set(entry) == ({"exp_avg", "exp_avg_sq", "master_param"} if dtype != torch.float32
                              else {"exp_avg", "exp_avg_sq"})
        assert all(t.shape == p.shape and t.dtype == torch.float32 for t in entry.values())
    twin = copy.deepcopy(model)
    twin_opt = build_optimizer([twin], cfg, ParallelState())
    twin_opt.load_state_dict(copy.deepcopy(state))
    for step in range(2, 4):
        for m in (model, twin):
            for p, g in zip(m.parameters(), _grads(m, step)):
                p.grad = g.to(dtype)
        opt.step()
        twin_opt.step()
    for p, q in zip(model.parameters(), twin.parameters()):
        torch.testing.assert_close(p.detach(), q.detach(), rtol=0, atol=0)
    broken = {**state, "param_state": {k: v for k, v in state["param_state"].items() if k != "norm"}}
    with pytest.raises(ValueError, match="norm"):
        twin_opt.load_state_dict(broken)

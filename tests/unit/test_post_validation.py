"""Optimizer post-validation in one process: a post-validated step leaves parameters, Adam state and the loss
scaler bit-identical to `Optimizer.step()` whatever the global statistics decide (apply, clip, skip), with and
without speculation; a rollback restores the pre-step state exactly (the `Snapshot`)."""
from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch

from llamapipe.core.optimizer import build_optimizer
from llamapipe.core.optimizer import post_validation as pv
from llamapipe.core.parallel_state import ParallelState
from tests.unit.test_optimizer import CFG, Toy, _grads


def _state(opt) -> list[torch.Tensor]:
    tensors = [p.detach().clone() for p in opt.params]
    for main in opt.mains:
        state = opt.inner.state.get(main, {})
        tensors += [state[k].clone() for k in ("exp_avg", "exp_avg_sq", "step") if k in state]
    return tensors


def _set_grads(model, step: int, scale: float) -> None:
    for p, g in zip(model.parameters(), _grads(model, step, scale)):
        p.grad = g.to(p.dtype)


def _train(cfg, scales: list[float], post_validated: bool, always: bool = False) -> tuple[list, list]:
    model = Toy(0, torch.float16 if cfg.fp16 else torch.float32)
    opt = build_optimizer([model], cfg, ParallelState())
    results = []
    for step, scale in enumerate(scales):
        _set_grads(model, step, scale)
        if not post_validated:
            r = opt.step()
            results.append((r.update_successful, r.grad_norm, opt.get_loss_scale()))
            continue
        pending = opt.begin_post_validated_step(1.0, 1.0, always_speculate=always)
        opt.zero_grad()                         # the next iteration's backward starts from fresh grads
        _set_grads(model, 1000 + step, 1.0)     # ... and writes them before the step resolves
        r = opt.resolve_post_validated_step(pending)
        results.append((r.update_successful, r.grad_norm, opt.get_loss_scale()))
        opt.zero_grad()
    return results, _state(opt)


@pytest.mark.parametrize("always", [False, True])
@pytest.mark.parametrize("clip", [0.0, 1e-3, 3.0])
def test_post_validated_steps_equal_synchronous_steps(clip, always):
    cfg = replace(CFG, clip_grad=clip)
    scales = [0.1, 1.0, 10.0, 0.1, float("nan"), 1.0]
    sync_results, sync_state = _train(cfg, scales, post_validated=False)
    pv_results, pv_state = _train(cfg, scales, post_validated=True, always=always)
    assert [r[0] for r in pv_results] == [r[0] for r in sync_results] == [True] * 4 + [False, True]
    assert str(pv_results) == str(sync_results)       # NaN-aware equality of the norms
    assert all(torch.equal(a, b) for a, b in zip(pv_state, sync_state)) and len(pv_state) == len(sync_state)


def test_fp16_overflow_skips_and_updates_the_loss_scale_like_the_synchronous_step():
    cfg = replace(CFG, fp16=True, clip_grad=1.0, initial_loss_scale=1024.0, hysteresis=1, loss_scale_window=2)
    scales = [1.0, float("inf"), 1.0, 1.0, 1.0]
    sync_results, sync_state = _train(cfg, scales, post_validated=False)
    pv_results, pv_state = _train(cfg, scales, post_validated=True, always=True)
    assert [r[0] for r in sync_results] == [True, False, True, True, True]
    assert str(pv_results) == str(sync_results)
    assert all(torch.equal(a, b) for a, b in zip(pv_state, sync_state))


def test_a_rank_speculates_only_when_its_own_part_cannot_clip():
    pack = torch.zeros(pv.STATS, dtype=torch.float64)
    pack[pv.SQ] = 0.81                                  # this rank's norm: 0.9
    assert pv.may_speculate(pack, clip_grad=1.0, loss_sum=3.0)
    assert not pv.may_speculate(pack, clip_grad=0.5, loss_sum=3.0)
    assert pv.may_speculate(pack, clip_grad=0.0, loss_sum=3.0)
    assert not pv.may_speculate(pack, clip_grad=1.0, loss_sum=math.inf)
    pack[pv.NONFINITE] = 1.0
    assert not pv.may_speculate(pack, clip_grad=0.0, loss_sum=3.0)


def test_decide_follows_the_synchronous_order_of_checks():
    pack = torch.tensor([4.0, 0.0, 6.0, 2.0], dtype=torch.float64)   # norm 2, loss 3
    assert pv.decide(pack, clip_grad=3.0, fp16=False) == ("apply", 2.0)
    assert pv.decide(pack, clip_grad=1.0, fp16=False) == ("clip", 2.0)
    pack[pv.LOSS] = math.inf
    assert pv.decide(pack, clip_grad=1.0, fp16=False)[0] == "nonfinite_loss"
    pack[pv.NONFINITE] = 1.0
    assert pv.decide(pack, clip_grad=1.0, fp16=True)[0] == "found_inf"

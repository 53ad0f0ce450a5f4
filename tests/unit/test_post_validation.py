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


def _train(cfg, scales: list[float], post_validated: bool, always: bool = False,
           policy: pv.SpeculationPolicy | None = None) -> tuple[list, list]:
    """`policy`: speculate on the steps it allows, whatever the rank's own statistics (as PostValidatedStep's
    "eager" test mode does), and tell it each resolution."""
    model = Toy(0, torch.float16 if cfg.fp16 else torch.float32)
    opt = build_optimizer([model], cfg, ParallelState())
    results = []
    for step, scale in enumerate(scales):
        _set_grads(model, step, scale)
        if not post_validated:
            r = opt.step()
            results.append((r.update_successful, r.grad_norm, opt.get_loss_scale()))
            continue
        allowed = policy.begin_step() if policy is not None else True
        pending = opt.begin_post_validated_step(1.0, 1.0, always_speculate=always or policy is not None and allowed,
                                                paused=not allowed)
        assert policy is None or pending.speculated == allowed
        opt.zero_grad()                         # the next iteration's backward starts from fresh grads
        _set_grads(model, 1000 + step, 1.0)     # ... and writes them before the step resolves
        r = opt.resolve_post_validated_step(pending)
        if policy is not None:
            policy.record(r.action, r.replay)
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


def test_the_policy_pauses_after_clipping_and_resumes_after_steps_that_applied():
    """Steps 1-4 apply (paused: the run starts paused), 5 speculates and applies, 6 speculates and clips (the one
    wrong speculation: replayed), 7-9 apply but the wait doubled to 8, 10-15 clip: paused throughout. The
    parameters and Adam state equal the synchronous steps' bit for bit."""
    cfg = replace(CFG, clip_grad=3.0)
    scales = [0.01] * 5 + [100.0] + [0.01] * 3 + [100.0] * 6
    policy = pv.SpeculationPolicy()
    pv_results, pv_state = _train(cfg, scales, post_validated=True, policy=policy)
    sync_results, sync_state = _train(cfg, scales, post_validated=False)
    assert str(pv_results) == str(sync_results) and all(torch.equal(a, b) for a, b in zip(pv_state, sync_state))
    assert [r[1] < 3.0 for r in sync_results] == [s < 1 for s in scales]       # the scales clip where meant
    assert policy.resume_after == 8 and policy.applied_in_a_row == 0     # 8: one wrong speculation
    assert policy.describe(len(scales)) == "speculation paused on 13 of 15 iterations (4 at the start, 9 after clipping)"


def test_a_paused_rank_never_speculates_and_reduces_no_flag():
    cfg = replace(CFG, clip_grad=0.0)
    model = Toy(0, torch.float32)
    opt = build_optimizer([model], cfg, ParallelState())
    _set_grads(model, 0, 1.0)
    pending = opt.begin_post_validated_step(1.0, 1.0, always_speculate=True, paused=True)
    assert not pending.speculated and pending.flag_work is None and pending.flag.item() == 0
    assert opt.resolve_post_validated_step(pending).action == "apply"


def test_each_wrong_speculation_doubles_the_wait_up_to_a_cap():
    policy = pv.SpeculationPolicy()
    allowed = []
    for _ in range(400):      # a step that clips after every stretch of steps that applied long enough to resume
        allowed.append(policy.begin_step())
        if allowed[-1]:
            policy.record("clip", speculated=True)
        else:
            policy.record("apply", speculated=False)
    waits = [i for i, a in enumerate(allowed) if a]
    assert [b - a for a, b in zip(waits, waits[1:])][:5] == [9, 17, 33, 65, 65]     # wait + the clipped step
    assert policy.resume_after == pv.RESUME_AFTER_MAX
    policy.record("found_inf", speculated=False)        # a skip that no rank speculated on: no doubling
    assert policy.resume_after == pv.RESUME_AFTER_MAX and policy.reason == "found_inf"
    assert not policy.begin_step() and policy.paused["found_inf"] == 1

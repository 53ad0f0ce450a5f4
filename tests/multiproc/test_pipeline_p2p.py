"""Plan-derived p2p: message derivation, shape handshake, variable sequence lengths, forward-only runs."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from llamapipe.core.pipeline_parallel import builders
from llamapipe.core.pipeline_parallel.p2p_communication import Message, needs_and_sends, receive_order
from llamapipe.core.pipeline_parallel.schedule_ir import Action
from tests.harness import run_distributed
from tests.multiproc.test_pipeline_executor import LAYERS, ToyChunk, forward_step, make_batches, make_chunks


def test_zbv_turn_is_a_local_hand_off():
    """Stage pp-1 -> pp of ZB-V lives on the last rank: its F output and B grad never leave the rank."""
    plan = builders.zbv(2, 3)
    _, send = needs_and_sends(plan, 1, Action("F", 0, 0))
    assert send == Message("act", 2, 0, 1, 1)
    need, _ = needs_and_sends(plan, 1, Action("B", 0, 0))
    assert need == Message("grad", 1, 0, 1, 1)
    assert needs_and_sends(plan, 0, Action("W", 1, 2)) == (None, None)


def test_receive_order_follows_the_senders_plan():
    """pp=2 interleaved: both neighbours are the same rank; receives follow the peer's send order."""
    plan = builders.interleaved(2, 2, 4)
    order = receive_order(plan, 0)[1]
    sent = [s for a in plan.actions[1] for s in [needs_and_sends(plan, 1, a)[1]] if s is not None]
    assert order == sent and {m.kind for m in order} == {"act", "grad"}
    assert len(order) == 4 * 2 + 4 * 2 - 4      # stage1->2 acts, stage1->0 grads, stage3->2 grads


def _varlen_batches(m: int, step: int) -> list[dict]:
    return [{k: v[:, : 3 + (mb + step) % 4] for k, v in b.items()}
            for mb, b in enumerate(make_batches(m, seed=step))]


def _single_rank(batches: list[dict], backward: bool) -> tuple[list[float], dict]:
    model = ToyChunk(0, LAYERS, True, True)
    losses = []
    for b in batches:
        loss = model(b["tokens"], b["labels"]).sum()
        if backward:
            loss.backward()
        losses.append(float(loss.detach()))
    return losses, {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


STEPS = ((0, True, False), (1, True, True), (2, False, False))   # (seed, variable lengths, forward only)


def p2p_worker(rank: int, world: int) -> dict:
    """Per schedule: a variable-length training step, a variable-length forward-only step, then a
    fixed-length step whose shape differs from the earlier ones (the per-step handshake must see it)."""
    from llamapipe.core.parallel_state import destroy_model_parallel, initialize_model_parallel
    from llamapipe.core.pipeline_parallel.schedule_specs import SPECS
    from llamapipe.core.pipeline_parallel.runtime import RuntimeOptions
    from llamapipe.core.pipeline_parallel.schedules import get_forward_backward_func
    ps = initialize_model_parallel(1, world)
    out = {}
    try:
        for schedule, vpp in (("1f1b", 1), ("interleaved", 2), ("zbv", 2)):
            chunks = make_chunks(ps.pp_rank, world, vpp, SPECS[schedule].placement(vpp))
            fbs = {variable: get_forward_backward_func(dataclasses.replace(ps, vpp_size=vpp), schedule,
                                                       options=RuntimeOptions(variable_seq_lengths=variable))
                   for variable in (False, True)}
            for seed, variable, forward_only in STEPS:
                batches = _varlen_batches(4, seed) if variable else make_batches(4, seed=seed)
                res = fbs[variable](forward_step_func=forward_step, data_iterator=[iter(batches) for _ in chunks],
                                    model=chunks, num_microbatches=4, forward_only=forward_only)
                out[(schedule, seed)] = [float(r["loss_sum"]) for r in res]
                if seed == 1:
                    out[(schedule, "grads")] = {n: p.grad.numpy().copy() for c in chunks
                                                for n, p in c.named_parameters()}
    finally:
        destroy_model_parallel()
    return out


@pytest.mark.slow
def test_variable_lengths_forward_only_and_shape_change_between_steps():
    results = run_distributed(p2p_worker, 2, timeout=120)
    last = results[1]          # 1f1b/interleaved: the last stage is on rank 1; zbv: on rank 0
    ref_grads = _single_rank(_varlen_batches(4, 0), backward=True)[1]
    for schedule in ("1f1b", "interleaved", "zbv"):
        holder = results[0] if schedule == "zbv" else last
        other = last if schedule == "zbv" else results[0]
        for seed, variable, forward_only in STEPS:
            batches = _varlen_batches(4, seed) if variable else make_batches(4, seed=seed)
            ref = _single_rank(batches, backward=False)[0]
            torch.testing.assert_close(torch.tensor(holder[(schedule, seed)]), torch.tensor(ref),
                                       rtol=1e-5, atol=0, msg=f"{schedule} step {seed}")
            assert other[(schedule, seed)] == [], "only the last stage returns losses"
        grads = {**results[0][(schedule, "grads")], **results[1][(schedule, "grads")]}
        for name, g in ref_grads.items():     # the forward-only step must not have touched the grads
            torch.testing.assert_close(torch.from_numpy(grads[name]), g, rtol=1e-5, atol=1e-5 * float(g.abs().max()),
                                       msg=f"{schedule} {name}")


def _latency_worker(rank: int, world: int) -> list[float]:
    from llamapipe.core.parallel_state import destroy_model_parallel, initialize_model_parallel
    from llamapipe.core.pipeline_parallel.p2p_communication import measure_latency
    ps = initialize_model_parallel(1, world)
    try:
        return [measure_latency(ps.pp_rank, ps.pp_ranks, ps.pp_group, nbytes=n, device=torch.device("cpu"))
                for n in (64, 64 << 20)]
    finally:
        destroy_model_parallel()


def test_measured_latency_is_agreed_and_grows_with_the_message():
    """Every rank gets the same one-way time (MAX over the pairs); 64 MiB takes longer than 64 bytes."""
    results = run_distributed(_latency_worker, 3)
    assert all(r == results[0] for r in results)
    small, large = results[0]
    assert 0 < small < 0.1 and large > small

"""--overlap-grad-reduce during the backward (core/distributed/grad_sync.py).

One process: which buckets start when (fused BW, B then W, W out of order, a non-final microbatch) and
that `finish` writes back exactly what the end-of-step reduction writes. Two gloo ranks: the sums over
data-parallel ranks are bit for bit those of `finalize_model_grads` without overlap.
"""
from __future__ import annotations

import torch
from torch import nn

from llamapipe.core.distributed.grad_reduce import finalize_model_grads
from llamapipe.core.distributed.grad_sync import GradSync
from llamapipe.core.parallel_state import ParallelState, destroy_model_parallel, initialize_model_parallel
from llamapipe.core.pipeline_parallel.schedule_specs import build
from llamapipe.core.tensor_parallel.weight_grad_store import WeightGradStore
from llamapipe.core.pipeline_parallel.executor import _last_backward_actions
from llamapipe.core.tensor_parallel.layers import ColumnParallelLinear
from tests.harness import run_distributed

HIDDEN, LAYERS = 8, 3


class Chunk(nn.Module):
    """LAYERS x (scale, linear): scales get autograd gradients, linears deferred ones."""

    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.scales = nn.ParameterList([nn.Parameter(1 + 0.1 * torch.randn(HIDDEN)) for _ in range(LAYERS)])
        self.linears = nn.ModuleList([ColumnParallelLinear(HIDDEN, HIDDEN) for _ in range(LAYERS)])
        for lin in self.linears:
            nn.init.normal_(lin.weight, std=0.3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for scale, lin in zip(self.scales, self.linears):
            x = torch.tanh(lin(x * scale))
        return x


def _tracked(sync: GradSync, names: dict) -> list:
    """Record the parameter names of each bucket as it launches."""
    events, launch = [], sync._launch

    def record(bucket):
        events.append(("launch", tuple(names[id(p)] for p in bucket.params)))
        launch(bucket)
    sync._launch = record
    return events


def _setup(bucket_size: int = 1):
    chunk = Chunk()
    names = {id(p): n for n, p in chunk.named_parameters()}
    sync = GradSync([chunk], ParallelState(), bucket_size)
    return chunk, sync, _tracked(sync, names)


def _microbatch(chunk: Chunk, seed: int, events: list) -> torch.Tensor:
    x = torch.randn(4, 1, HIDDEN, generator=torch.Generator().manual_seed(seed)).requires_grad_(True)
    x.register_hook(lambda g: events.append(("input grad",)))
    return chunk(x).square().sum()


def test_fused_backward_starts_buckets_before_the_backward_reaches_the_input():
    chunk, sync, events = _setup()
    sync.begin_step(WeightGradStore())
    _microbatch(chunk, 0, events).backward()          # microbatch 0: not the last, nothing starts
    assert events == [("input grad",)]
    sync.arm(0)
    _microbatch(chunk, 1, events).backward()          # the last one: buckets start as grads turn final
    sync.disarm()
    launched = [e[1] for e in events if e[0] == "launch"]
    assert len(launched) == 2 * LAYERS
    first_input_grad = events.index(("input grad",), 1)
    assert events[1] == ("launch", ("linears.2.weight",)), events   # the last layer's weight goes first
    before = {name for e in events[1:first_input_grad] if e[0] == "launch" for name in e[1]}
    assert {f"linears.{i}.weight" for i in (1, 2)} | {"scales.1", "scales.2"} <= before, \
        "the later layers' buckets should start while the backward still runs through the first layer"
    sync.chunk_done(0, last_action=True)
    assert sum(e[0] == "launch" for e in events) == 2 * LAYERS       # nothing launched twice
    assert sync.finish(2.0) == (2 * LAYERS, 0, 0)


def test_split_backward_starts_linear_buckets_only_when_their_w_runs():
    chunk, sync, events = _setup()
    store = WeightGradStore()
    sync.begin_step(store)
    sync.arm(0)
    with store.capture((0, 0)):
        _microbatch(chunk, 0, events).backward()
    sync.disarm()
    started = {name for e in events if e[0] == "launch" for name in e[1]}
    assert started == {f"scales.{i}" for i in range(LAYERS)}, "only the autograd (norm-like) grads are final after B"
    store.run((0, 0))
    order = [e[1][0] for e in events if e[0] == "launch" and e[1][0].startswith("linears")]
    assert order == [f"linears.{i}.weight" for i in reversed(range(LAYERS))]
    sync.chunk_done(0, last_action=True)
    sync.finish(None)
    store.assert_empty()


def test_weight_grads_queued_by_an_earlier_microbatch_hold_the_bucket():
    """W of the last B runs before W of an earlier B: a linear is final only after both."""
    chunk, sync, events = _setup(bucket_size=10 ** 9)     # one bucket for the whole chunk
    store = WeightGradStore()
    sync.begin_step(store)
    with store.capture((0, 0)):
        _microbatch(chunk, 0, events).backward()
    sync.arm(0)
    with store.capture((0, 1)):
        _microbatch(chunk, 1, events).backward()
    sync.disarm()
    store.run((0, 1))
    assert not any(e[0] == "launch" for e in events), "microbatch 0's weight gradients are still queued"
    store.run((0, 0))
    assert sum(e[0] == "launch" for e in events) == 1
    sync.finish(None)


def test_unarmed_chunk_starts_everything_when_done_and_finish_matches_the_plain_reduction():
    chunk, sync, events = _setup(bucket_size=20)
    reference = Chunk()
    for model in (chunk, reference):
        for seed in range(2):
            _microbatch(model, seed, []).backward()
    sync.begin_step(WeightGradStore())
    sync.chunk_done(0, last_action=False)             # e.g. ZB-V's first chunk, done before the other
    assert sum(e[0] == "launch" for e in events) == len(sync.buckets) > 1
    sync.end_step()
    assert sync.finish(7.0) == (len(sync.buckets), 0, 0)
    finalize_model_grads([reference], ParallelState(), None, global_tokens=7.0)
    for got, want in zip(chunk.parameters(), reference.parameters()):
        assert torch.equal(got.grad, want.grad)


def test_launch_phases_and_shared_parameters():
    chunk, sync, events = _setup()
    store = WeightGradStore()
    sync.begin_step(store)
    sync.arm(0)
    sync.last_action()
    _microbatch(chunk, 0, events).backward()          # fused BW as the rank's last action
    sync.disarm()
    sync.chunk_done(0, last_action=True)
    assert sync.finish(None) == (0, 2 * LAYERS, 0)
    assert "0 started their data-parallel all-reduce before its last backward action, 6 during it" in sync.summary()
    sync.remove()
    assert store._listener is None
    other = nn.Module()
    other.shared = chunk.linears[0].weight
    try:
        GradSync([chunk, other], ParallelState())
        raise AssertionError("a parameter in two chunks was accepted")
    except ValueError as err:
        assert "shared by two model chunks" in str(err)


def test_begin_step_refuses_an_unfinished_step_and_abort_forgets_it():
    chunk, sync, _ = _setup()
    store = WeightGradStore()
    sync.begin_step(store)
    _microbatch(chunk, 0, []).backward()
    sync.chunk_done(0, last_action=True)
    try:
        sync.begin_step(store)
        raise AssertionError("begin_step accepted a step whose gradients were never finished")
    except RuntimeError as err:
        assert "never finished" in str(err)
    sync.abort()
    sync.begin_step(store)
    sync.remove()
    assert store._listener is None


def test_last_backward_actions_of_a_zbv_plan():
    plan = build("zbv", 2, 2, 4)
    for rank_actions in plan.actions:
        last_b, last_any = _last_backward_actions(rank_actions)
        assert set(last_b) == set(last_any) == {0, 1}
        for chunk in (0, 1):
            later = rank_actions[last_any[chunk] + 1:]
            assert not any(a.chunk == chunk and a.kind != "F" for a in later)
            assert rank_actions[last_b[chunk]].kind in ("B", "BW") and last_b[chunk] <= last_any[chunk]


def _dp_rank(rank: int, world_size: int) -> dict:
    ps = initialize_model_parallel(tp=1, pp=1)
    plain, overlapped = Chunk(seed=0), Chunk(seed=0)
    sync = GradSync([overlapped], ps, bucket_size=30)
    for model in (plain, overlapped):
        store = WeightGradStore()
        if model is overlapped:
            sync.begin_step(store)
        for mb in range(3):
            if model is overlapped and mb == 2:
                sync.arm(0)
            with store.capture((0, mb)):
                _microbatch(model, 10 * rank + mb, []).backward()
            sync.disarm()
            store.run((0, mb))
    early_before_done = sum(b.flat is not None for b in sync.buckets)
    sync.chunk_done(0, last_action=True)
    finalize_model_grads([plain], ps, None, global_tokens=24.0, bucket_size=30)
    finalize_model_grads([overlapped], ps, None, global_tokens=24.0, grad_sync=sync)
    same = all(torch.equal(a.grad, b.grad) for a, b in zip(plain.parameters(), overlapped.parameters()))
    grads = [p.grad.clone() for p in overlapped.parameters()]
    destroy_model_parallel()
    return {"same": same, "early": early_before_done, "buckets": len(sync.buckets), "grads": grads}


def test_two_dp_ranks_sum_bit_for_bit_like_the_end_of_step_reduction():
    results = run_distributed(_dp_rank, 2, timeout=120)
    for r in results:
        assert r["same"], "overlapped DP sums differ from the end-of-step reduction"
        assert r["early"] == r["buckets"] > 1, "every bucket should have started during the last microbatch"
    for a, b in zip(results[0]["grads"], results[1]["grads"]):
        assert torch.equal(a, b), "DP replicas disagree after the reduction"

"""Executor on a toy model (gloo, CPU): every schedule equals the single-rank run, ZB equals 1F1B.

The toy chunk mimics the real model's contract: its linear layers hand their weight gradient to the
weight-gradient store their forward ran under (so B/W split is exercised) and a norm-like scale gets its
gradient through ordinary autograd. Also imported by the other pipeline tests.
"""
from __future__ import annotations

import functools

import pytest
import torch
from torch import nn

from llamapipe.core.tensor_parallel import weight_grad_store
from tests.harness import run_distributed

VOCAB, HIDDEN, LAYERS, BATCH, SEQ = 32, 16, 8, 2, 6


class _Linear(torch.autograd.Function):
    """y = x @ w.T whose weight gradient is deferred through the store (like the parallel linears)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        ctx.store = weight_grad_store.current()
        return x @ weight.t()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, weight = ctx.saved_tensors

        def weight_grad() -> None:
            g = grad.reshape(-1, grad.shape[-1]).t() @ x.reshape(-1, x.shape[-1])
            weight.grad = g if weight.grad is None else weight.grad + g

        weight_grad_store.defer(ctx.store, weight_grad, (weight,))
        return grad @ weight, None


def _init(shape: tuple, seed: int) -> nn.Parameter:
    return nn.Parameter(torch.randn(shape, generator=torch.Generator().manual_seed(seed)) * 0.3)


class ToyChunk(nn.Module):
    """Layers [start, end) of a toy LM; embedding on the first chunk, head and per-token loss on the last."""

    def __init__(self, start: int, end: int, pre_process: bool, post_process: bool, hidden: int = HIDDEN) -> None:
        super().__init__()
        self.pre_process, self.post_process, self.input_tensor = pre_process, post_process, None
        self.embedding = nn.Embedding(VOCAB, hidden) if pre_process else None
        if pre_process:
            self.embedding.weight = _init((VOCAB, hidden), 1)
        self.weights = nn.ParameterDict({str(i): _init((hidden, hidden), 100 + i) for i in range(start, end)})
        self.scales = nn.ParameterDict({str(i): nn.Parameter(torch.ones(hidden) + 0.1 * i)
                                        for i in range(start, end)})
        self.head = _init((VOCAB, hidden), 2) if post_process else None

    def set_input_tensor(self, tensor: torch.Tensor) -> None:
        self.input_tensor = tensor

    def forward(self, input_ids=None, labels=None) -> torch.Tensor:
        h = self.embedding(input_ids).transpose(0, 1) if self.pre_process else self.input_tensor  # (s, b, h)
        for key, weight in self.weights.items():
            h = h + _Linear.apply(torch.tanh(h) * self.scales[key], weight)
        if not self.post_process:
            return h
        logits = _Linear.apply(h, self.head).transpose(0, 1).float()      # (b, s, v)
        return nn.functional.cross_entropy(logits.reshape(-1, VOCAB), labels.reshape(-1),
                                           reduction="none").view(labels.shape)


def make_batches(num: int, seed: int = 0) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    return [{"tokens": torch.randint(0, VOCAB, (BATCH, SEQ), generator=g),
             "labels": torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)} for _ in range(num)]


def forward_step(data_iterator, model):
    batch = next(data_iterator)
    out = model(input_ids=batch["tokens"], labels=batch["labels"])

    def loss_func(per_token: torch.Tensor):
        return per_token.sum(), torch.tensor(per_token.numel()), {}
    return out, loss_func


def reference(steps: int, m: int, dp: int, lr: float = 0.5) -> tuple[list[float], dict]:
    """Single-rank run: per-step mean loss and the first step's gradients (grads / global tokens)."""
    torch.manual_seed(0)
    model = ToyChunk(0, LAYERS, True, True)
    losses, first_grads = [], None
    for step in range(steps):
        total = 0.0
        for dp_rank in range(dp):
            for batch in make_batches(m, seed=1000 * step + dp_rank):
                loss = model(batch["tokens"], batch["labels"]).sum()
                loss.backward()
                total += loss.item()
        tokens = m * dp * BATCH * SEQ
        grads = {n: p.grad / tokens for n, p in model.named_parameters()}
        first_grads = first_grads or grads
        losses.append(total / tokens)
        with torch.no_grad():
            for n, p in model.named_parameters():
                p -= lr * grads[n]
                p.grad = None
    return losses, first_grads


def make_chunks(pp_rank: int, pp: int, vpp: int, placement: str) -> list[ToyChunk]:
    from llamapipe.core.pipeline_parallel.schedule_ir import stage_of
    stages, per_stage = pp * vpp, LAYERS // (pp * vpp)
    return [ToyChunk(s * per_stage, (s + 1) * per_stage, s == 0, s == stages - 1)
            for s in (stage_of(pp_rank, c, pp, placement) for c in range(vpp))]


def train(ps, schedule: str, vpp: int, m: int, steps: int, lr: float = 0.5) -> tuple[list[float], dict]:
    """`steps` SGD steps with `schedule`; returns per-step mean loss and first-step grads (by name)."""
    import dataclasses
    import torch.distributed as dist
    from llamapipe.core.pipeline_parallel.runtime import RuntimeOptions
    from llamapipe.core.pipeline_parallel.schedule_specs import SPECS
    from llamapipe.core.pipeline_parallel.schedules import get_forward_backward_func
    ps = dataclasses.replace(ps, vpp_size=vpp)
    chunks = make_chunks(ps.pp_rank, ps.pp_size, vpp, SPECS[schedule.removeprefix("unit-")].placement(vpp))
    if schedule.startswith("unit-"):      # the fixed unit-cost plan, not fitted to measured costs
        from llamapipe.core.pipeline_parallel.schedules import forward_backward_zero_bubble
        fb = functools.partial(forward_backward_zero_bubble, variant=schedule[5:], parallel_state=ps)
    else:
        fb = get_forward_backward_func(ps, schedule, options=RuntimeOptions(profile_iters=1))
    tokens = m * ps.dp_size * BATCH * SEQ
    losses, first_grads = [], None
    for step in range(steps):
        batches = make_batches(m, seed=1000 * step + ps.dp_rank)
        out = fb(forward_step_func=forward_step, data_iterator=[iter(batches) for _ in chunks],
                 model=chunks, num_microbatches=m)
        total = torch.tensor([sum(float(o["loss_sum"]) for o in out)], dtype=torch.float64)
        for group in (ps.pp_group, ps.dp_group):
            dist.all_reduce(total, group=group)
        losses.append(float(total) / tokens)
        params = {n: p for c in chunks for n, p in c.named_parameters()}
        for p in params.values():
            p.grad /= tokens
            dist.all_reduce(p.grad, group=ps.dp_group)
        first_grads = first_grads or {n: p.grad.numpy().copy() for n, p in params.items()}  # by value
        with torch.no_grad():
            for p in params.values():
                p -= lr * p.grad
                p.grad = None
    return losses, first_grads


def train_worker(rank: int, world: int, tp: int, pp: int, cases: list, steps: int) -> dict:
    """Run every (schedule, vpp, m) case on one process grid; results keyed by case."""
    from llamapipe.core.parallel_state import destroy_model_parallel, initialize_model_parallel
    ps = initialize_model_parallel(tp, pp)
    try:
        return {case: train(ps, *case, steps=steps) for case in cases}
    finally:
        destroy_model_parallel()


def _merge(results: list) -> tuple[list[float], dict]:
    grads = {}
    for _, g in results:
        grads.update({n: torch.from_numpy(v) for n, v in g.items()})
    return results[0][0], grads


LAYOUTS = {  # (tp, pp, dp): [(schedule, vpp, m), ...]
    (1, 2, 1): [("1f1b", 1, 4), ("gpipe", 1, 4), ("zb-h1", 1, 4), ("zb-h2", 1, 4), ("unit-zb-h2", 1, 4),
                ("auto", 1, 4), ("1f1b", 1, 5), ("interleaved", 2, 4), ("zbv", 2, 3), ("auto", 2, 4)],
    (1, 4, 1): [("1f1b", 1, 6), ("zb-h2", 1, 6), ("unit-zb-h2", 1, 6), ("interleaved", 2, 8), ("zbv", 2, 6)],
    (2, 2, 1): [("1f1b", 1, 4), ("zb-h1", 1, 4)],
    (1, 2, 2): [("1f1b", 1, 4), ("zbv", 2, 4)],
}


@functools.lru_cache(maxsize=None)
def cached_reference(steps: int, m: int, dp: int) -> tuple[list[float], dict]:
    return reference(steps, m, dp)


@pytest.mark.slow
@pytest.mark.parametrize("tp,pp,dp", list(LAYOUTS))
def test_schedules_match_single_rank(tp, pp, dp):
    """3 SGD steps per schedule: per-step loss and first-step grads equal the single-rank run (rel 1e-5);
    zero-bubble schedules equal 1F1B on the same layout (rel 1e-6)."""
    steps, cases = 3, LAYOUTS[(tp, pp, dp)]
    results = run_distributed(train_worker, tp * pp * dp, tp, pp, cases, steps, timeout=240)
    merged = {case: _merge([r[case] for r in results]) for case in cases}
    for case in cases:
        ref_losses, ref_grads = cached_reference(steps, case[2], dp)
        for rank_result in results:
            torch.testing.assert_close(torch.tensor(rank_result[case][0]), torch.tensor(ref_losses),
                                       rtol=1e-5, atol=0, msg=str(case))
        grads = merged[case][1]
        assert set(grads) == set(ref_grads), "every parameter must live on exactly one pipeline stage"
        for name in ref_grads:
            torch.testing.assert_close(grads[name], ref_grads[name], rtol=1e-5, atol=1e-7, msg=f"{case} {name}")
        baseline = ("1f1b", 1, case[2])
        if case[0] in ("zb-h1", "zb-h2", "unit-zb-h2", "auto") and case[1] == 1 and baseline in merged:
            for name, g in merged[baseline][1].items():
                torch.testing.assert_close(grads[name], g, rtol=1e-6, atol=0, msg=f"{case} vs 1F1B {name}")


class _WaitingW(torch.autograd.Function):
    """Identity whose deferred weight gradient waits (up to `wait_s`) for the file rank 0 writes once its step is
    done, and records whether it appeared: an order observed, not a time measured."""

    @staticmethod
    def forward(ctx, x, weight, wait_s, log, done_file):
        ctx.weight, ctx.wait_s, ctx.log, ctx.done_file = weight, wait_s, log, done_file
        ctx.store = weight_grad_store.current()
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        import os
        import time

        def weight_grad() -> None:
            deadline = time.monotonic() + ctx.wait_s
            while not os.path.exists(ctx.done_file) and time.monotonic() < deadline:
                time.sleep(0.01)
            ctx.log["rank0_done_before_w"] = os.path.exists(ctx.done_file)
            ctx.weight.grad = torch.ones_like(ctx.weight)
        weight_grad_store.defer(ctx.store, weight_grad, (ctx.weight,))
        return grad.clone(), None, None, None, None


class _WaitingWChunk(nn.Module):
    def __init__(self, pre: bool, post: bool, wait_s: float, log: dict, done_file: str) -> None:
        super().__init__()
        self.pre_process, self.post_process, self.wait_s, self.log = pre, post, wait_s, log
        self.done_file = done_file
        self.weight, self.input_tensor = nn.Parameter(torch.zeros(1)), None

    def set_input_tensor(self, t):
        self.input_tensor = t

    def forward(self, input_ids=None, labels=None):
        x = input_ids.float() if self.pre_process else self.input_tensor
        return _WaitingW.apply(x, self.weight, self.wait_s, self.log, self.done_file)


def _early_send_worker(rank: int, world: int, fused_bw: bool, done_file: str) -> dict:
    from llamapipe.core.parallel_state import destroy_model_parallel, initialize_model_parallel
    from llamapipe.core.pipeline_parallel import executor
    from llamapipe.core.pipeline_parallel.builders import one_f_one_b
    from llamapipe.core.pipeline_parallel.runtime import RuntimeOptions
    ps, log = initialize_model_parallel(1, 2), {}
    try:
        # rank 1's W waits for rank 0 (whose own W does not): long enough for any load when rank 0 can finish
        # first (split B/W), and 1 s when it cannot (fused BW sends rank 0 its gradient only after W)
        wait_s = 0.0 if rank == 0 else 1.0 if fused_bw else 120.0
        chunk = _WaitingWChunk(rank == 0, rank == 1, wait_s, log, done_file)
        batch = {"tokens": torch.ones(2, 3), "labels": torch.ones(2, 3)}
        executor.run(one_f_one_b(2, 1), model_chunks=[chunk], forward_step_func=forward_step,
                     data_iterator=iter([batch]), parallel_state=ps, num_microbatches=1,
                     options=RuntimeOptions(fused_bw=fused_bw))
        if rank == 0:
            open(done_file, "w").close()
        return log
    finally:
        destroy_model_parallel()


@pytest.mark.parametrize("fused_bw", [False, True])
def test_bw_sends_the_input_gradient_before_its_weight_gradients(fused_bw, tmp_path):
    """Rank 1's W waits for rank 0 to finish its step: rank 0 does, unless fused_bw (Megatron's order), which
    sends rank 0 its input gradient only after W."""
    r0, r1 = run_distributed(_early_send_worker, 2, fused_bw, str(tmp_path / "rank0_done"))
    if fused_bw:
        assert r1["rank0_done_before_w"] is False
    else:
        assert r1["rank0_done_before_w"] is True


def _fitted_zb_h2_worker(rank: int, world: int) -> dict:
    from llamapipe.core.parallel_state import destroy_model_parallel, initialize_model_parallel
    from llamapipe.core.pipeline_parallel.runtime import RuntimeOptions
    from llamapipe.core.pipeline_parallel.schedules import get_forward_backward_func
    ps = initialize_model_parallel(1, world)
    try:
        chunks = make_chunks(ps.pp_rank, world, 1, "interleaved")
        fb = get_forward_backward_func(ps, "zb-h2", options=RuntimeOptions(profile_iters=2))
        plans = []
        for step in range(3):
            fb(forward_step_func=forward_step, data_iterator=[iter(make_batches(6, seed=step))], model=chunks,
               num_microbatches=6)
            plans.append(None if fb.plan is None else fb.plan.to_json())
            for p in chunks[0].parameters():
                p.grad = None
        return {"plans": plans, "costs": fb.costs}
    finally:
        destroy_model_parallel()


def test_zb_h2_profiles_then_runs_a_plan_fitted_to_measured_costs():
    """`zb-h2` runs profiled 1F1B for --pipeline-profile-iters steps, then every rank runs the same
    plan, built from the measured F/B/W and p2p costs within ZB-H2's 2p-1 microbatches of activations."""
    from llamapipe.core.pipeline_parallel.auto_plan import zb_h2_fitted
    from llamapipe.core.pipeline_parallel.schedule_ir import Plan
    from llamapipe.core.pipeline_parallel.simulator import simulate
    results = run_distributed(_fitted_zb_h2_worker, 4)
    assert all(r["plans"][:1] == [None] for r in results)       # still profiling after the first step
    plan = Plan.from_json(results[0]["plans"][1])
    assert all(r["plans"][1] == r["plans"][2] == results[0]["plans"][1] for r in results)
    costs = results[0]["costs"]
    assert plan.name == "zb-h2" and plan == zb_h2_fitted(4, 6, costs)
    assert costs.comm > 0                                     # p2p latency measured after profiling
    assert max(simulate(plan, costs).peak_memory) <= 2 * 4 - 1

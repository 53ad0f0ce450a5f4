"""Peak saved-activation bytes per rank, measured with saved_tensors_hooks, equal the simulator's prediction.

A unit is one microbatch-chunk forward's saved bytes and M_W/M_B the share still held after B (the
linears' inputs, kept for the deferred weight gradient); both are measured on a standalone F/B/W of
one chunk, then `simulate(plan, Costs(act_mem=1, w_mem=share)).peak_memory` times the unit must match
the peak measured while the executor runs the plan (within 5%), and nothing may stay alive afterwards.
"""
from __future__ import annotations

import dataclasses
import functools
import weakref

import pytest
import torch
from torch import nn

from llamapipe.core.pipeline_parallel.activation_memory import ActivationProbe
from llamapipe.core.pipeline_parallel.runtime import RuntimeOptions
from llamapipe.core.tensor_parallel.weight_grad_store import WeightGradStore
from tests.harness import run_distributed
from tests.multiproc.test_pipeline_executor import BATCH, LAYERS, SEQ, ToyChunk, _Linear, make_batches

HIDDEN = 128     # large next to the vocabulary, so every chunk saves about the same bytes


class MemChunk(ToyChunk):
    """Toy chunk whose per-token loss saves nothing large (a plain sum), so all chunks weigh the same."""

    def forward(self, input_ids=None, labels=None) -> torch.Tensor:
        h = self.input_tensor if not self.pre_process else self.embedding(input_ids).transpose(0, 1)
        for key, weight in self.weights.items():
            h = h + _Linear.apply(torch.tanh(h) * self.scales[key], weight)
        return h.sum(-1).transpose(0, 1) if self.post_process else h            # (b, s) or (s, b, h)


class SavedBytes:
    """Live bytes of distinct floating-point storages saved for backward (parameters excluded)."""

    def __init__(self) -> None:
        self.live = self.peak = 0
        self._ids: set[int] = set()
        self.sizes: dict[int, int] = {}     # data pointer -> bytes of each live saved storage

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        if t.is_floating_point() and not isinstance(t, nn.Parameter):
            storage = t.untyped_storage()
            if id(storage) not in self._ids:
                self._ids.add(id(storage))
                self.live += storage.nbytes()
                self.peak = max(self.peak, self.live)
                self.sizes[storage.data_ptr()] = storage.nbytes()
                weakref.finalize(storage, self._free, id(storage), storage.nbytes(), storage.data_ptr())
        return t

    def _free(self, key: int, nbytes: int, ptr: int) -> None:
        self._ids.discard(key)
        self.sizes.pop(ptr, None)
        self.live -= nbytes

    def hooks(self):
        return torch.autograd.graph.saved_tensors_hooks(self.pack, lambda t: t)


def _mem_chunks(pp_rank: int, pp: int, vpp: int, placement: str) -> list[MemChunk]:
    from llamapipe.core.pipeline_parallel.schedule_ir import stage_of
    stages, per = pp * vpp, LAYERS // (pp * vpp)
    chunks = []
    for s in (stage_of(pp_rank, c, pp, placement) for c in range(vpp)):
        chunks.append(MemChunk(s * per, (s + 1) * per, s == 0, s == stages - 1, hidden=HIDDEN))
    return chunks


def _unit(chunk: MemChunk) -> tuple[int, float]:
    """(saved bytes of one forward, share still saved after B) on a standalone F, B, W."""
    tracker, batch, store = SavedBytes(), make_batches(1)[0], WeightGradStore()
    chunk.set_input_tensor(torch.randn(SEQ, BATCH, HIDDEN, requires_grad=True))
    with tracker.hooks(), store.active():
        out = chunk(input_ids=batch["tokens"], labels=batch["labels"])
    unit = tracker.live
    with store.capture("unit"):
        out.backward(torch.ones_like(out))
    held = tracker.live
    store.run("unit")
    chunk.zero_grad(set_to_none=True)
    return unit, held / unit


def _forward_step(data_iterator, model):
    batch = next(data_iterator)
    return model(input_ids=batch["tokens"]), lambda out: (out.sum(), torch.tensor(out.numel()), {})


def memory_worker(rank: int, world: int, cases: list) -> dict:
    import dataclasses
    from llamapipe.core.parallel_state import destroy_model_parallel, initialize_model_parallel
    from llamapipe.core.pipeline_parallel import executor
    from llamapipe.core.pipeline_parallel.schedules import cached_plan
    from llamapipe.core.pipeline_parallel.simulator import Costs, simulate
    ps = initialize_model_parallel(1, world)
    out = {}
    try:
        for schedule, vpp, m in cases:
            plan = cached_plan(schedule, world, vpp, m)
            chunks = _mem_chunks(ps.pp_rank, world, vpp, plan.placement)
            unit, share = _unit(chunks[0])
            predicted = simulate(plan, Costs(act_mem=1.0, w_mem=share)).peak_memory[ps.pp_rank] * unit
            tracker, batches, probe = SavedBytes(), make_batches(m), ActivationProbe(chunks)
            run = functools.partial(executor.run, plan, model_chunks=chunks, forward_step_func=_forward_step,
                                    parallel_state=dataclasses.replace(ps, vpp_size=vpp), num_microbatches=m)
            with tracker.hooks():
                run(data_iterator=[iter(batches) for _ in chunks])
            run(data_iterator=[iter(batches) for _ in chunks], options=RuntimeOptions(observers=(probe,)))
            for chunk in chunks:
                chunk.zero_grad(set_to_none=True)
            out[(schedule, vpp, m)] = (tracker.peak, predicted, tracker.live, share)
            out[(schedule, vpp, m, "probe")] = (probe.unit_bytes, probe.w_share, unit, len(probe.shares))
    finally:
        destroy_model_parallel()
    return out


@pytest.mark.slow
def test_peak_saved_activations_match_simulator():
    cases = [("1f1b", 1, 6), ("zb-h1", 1, 6), ("zbv", 2, 6), ("zb-h2", 1, 6), ("gpipe", 1, 3)]
    results = run_distributed(memory_worker, 2, cases, timeout=180)
    for pp_rank, per_rank in enumerate(results):
        for case, (probe_unit, probe_share, unit, splits) in [(k, v) for k, v in per_rank.items() if "probe" in k]:
            # what `auto` measures in its first profiling iteration, inside the executor, per forward
            assert abs(probe_unit - unit) <= 0.05 * unit, f"{case} rank {pp_rank}: probe {probe_unit} vs {unit}"
            assert (splits > 0) == (case[0] not in ("1f1b", "gpipe")), f"{case}: {splits} B (not BW) seen"
            if splits:
                share = per_rank[case[:3]][3]
                assert abs(probe_share - share) <= 0.05, f"{case} rank {pp_rank}: W share {probe_share} vs {share}"
        for case, (peak, predicted, live_after, share) in [(k, v) for k, v in per_rank.items() if "probe" not in k]:
            assert live_after == 0, f"{case} rank {pp_rank}: {live_after} saved bytes alive after the step"
            assert 0.3 < share < 0.7, f"B should keep the linears' inputs for W, kept {share:.2f}"
            assert abs(peak - predicted) <= 0.05 * predicted, \
                f"{case} rank {pp_rank}: measured peak {peak} bytes, simulator predicts {predicted:.0f}"


@pytest.mark.parametrize("role", ["middle", "last"])
def test_probe_on_llama_chunks_matches_saved_tensor_hooks(role):
    """The probe `auto` uses (a graph walk and weak references, no hooks, so saved weights stay the same
    objects) against saved-tensor hooks: a LLaMA chunk's unit, and the share still alive after B."""
    from llamapipe.model.llama import LlamaModel
    from tests.multiproc.test_pipeline_llama import CONFIG
    chunk = LlamaModel(CONFIG, None, layer_range=(2, 4), pre_process=False, post_process=role == "last")
    exclude = {p.untyped_storage().data_ptr() for p in list(chunk.parameters()) + list(chunk.buffers())}
    g = torch.Generator().manual_seed(0)
    x, labels = torch.randn(16, 2, CONFIG.hidden_size, generator=g), torch.randint(0, 256, (2, 16), generator=g)

    store = WeightGradStore()

    def step(forward_done, backward_done):
        chunk.set_input_tensor(x.clone().requires_grad_(True))
        with store.active():
            loss = (chunk(labels=labels) if role == "last" else chunk()).float().sum()
        forward_done(loss)
        with store.capture("probe"):
            loss.backward()
        del loss                          # as the executor drops the output and input after B
        chunk.set_input_tensor(None)
        backward_done()
        store.run("probe")
        chunk.zero_grad(set_to_none=True)

    probe = ActivationProbe([chunk])
    step(lambda loss: probe.forward_done("k", loss), lambda: probe.backward_done("k", split=True))
    tracker, seen = SavedBytes(), {}
    with tracker.hooks():        # the hooks also see views of the weights; count activations only
        step(lambda loss: seen.update(unit=sum(n for p, n in tracker.sizes.items() if p not in exclude)),
             lambda: seen.update(alive=sum(n for p, n in tracker.sizes.items() if p not in exclude)))
    assert probe.units[0] > 0 and abs(probe.units[0] - seen["unit"]) <= 0.05 * seen["unit"], (probe.units, seen)
    assert abs(probe.shares[0] - seen["alive"] / seen["unit"]) <= 0.05, (probe.shares, seen)
    assert 0.1 < probe.shares[0] < 0.9


@pytest.mark.parametrize("granularity", ["full", "selective"])
def test_probe_with_recompute_reads_no_recomputed_tensor(granularity):
    """Under activation recompute the probe must not unpack checkpointed tensors (that re-runs the layer's
    forward and holds the result until B): no extra forward runs, and the unit shrinks."""
    from llamapipe.model.layers import Attention
    from llamapipe.model.llama import LlamaModel
    from tests.multiproc.test_pipeline_llama import CONFIG
    units = {}
    for label, config in (("plain", CONFIG), ("recompute", dataclasses.replace(CONFIG, recompute_granularity=granularity))):
        torch.manual_seed(0)
        chunk = LlamaModel(config, None, layer_range=(2, 4), pre_process=False, post_process=False)
        calls = []
        for layer in chunk.modules():
            if isinstance(layer, Attention):  # the attention block, once per layer (its core is a submodule)
                layer.register_forward_hook(lambda *a: calls.append(1))
        chunk.set_input_tensor(torch.randn(16, 2, CONFIG.hidden_size, requires_grad=True))
        out = chunk()
        before = len(calls)
        probe = ActivationProbe([chunk])
        probe.forward_done("k", out)
        assert len(calls) == before == 2, f"{label}: the probe ran {len(calls) - before} extra forwards"
        units[label] = probe.unit_bytes
    assert 0 < units["recompute"] < units["plain"], units


def test_held_share_adds_the_output_gradients_w_keeps():
    """Two stacked deferred linears, x (N x 8) -> y1 (N x 16) -> y2 (N x 32), loss (y2 * y2).sum(): the
    forward saves x, y1 and y2 (twice for the product, one storage). After B the W closures keep x and y1
    (saved) and the output gradients dy1 (N x 16) and dy2 (N x 32), which autograd never saved: the
    held share is (8 + 16 + 16 + 32) / (8 + 16 + 32) of a unit, the saved share (8 + 16) / 56."""
    from llamapipe.core.tensor_parallel.layers import INPUT_PARALLEL, LinearWithDeferredWeightGrad
    torch.manual_seed(0)
    w1, w2 = nn.Parameter(torch.randn(16, 8)), nn.Parameter(torch.randn(32, 16))
    holder = nn.ParameterList([w1, w2])
    probe, store = ActivationProbe([holder]), WeightGradStore()
    x = torch.randn(24, 8, requires_grad=True)
    with store.active():
        (y1,) = LinearWithDeferredWeightGrad.apply(x, None, INPUT_PARALLEL, w1)
        (y2,) = LinearWithDeferredWeightGrad.apply(y1, None, INPUT_PARALLEL, w2)
    loss = (y2 * y2).sum()
    probe.forward_done("k", loss)
    with store.capture("k"):
        loss.backward()
    del loss, y1, y2
    probe.backward_done("k", split=True, held=store.held_tensors("k"))
    store.run("k")
    assert probe.units == [24 * (8 + 16 + 32) * 4]
    assert probe.shares == [pytest.approx(24 / 56)]
    assert probe.held_shares == [pytest.approx(72 / 56)]
    # the simulator needs M_W <= M_B, so the unit grows to what W holds and M_W is one unit
    assert probe.planning_memory() == (24 * 72 * 4, 1.0)
    assert w1.grad is not None and w2.grad is not None


@pytest.mark.parametrize("role", ["middle", "last"])
def test_held_share_of_llama_chunks_counts_more_than_saved(role):
    """On a LLaMA chunk the W closures' output gradients are about as large again as the saved inputs
    they keep: the held share lies above the saved share and is what `auto` simulates."""
    from llamapipe.model.llama import LlamaModel
    from tests.multiproc.test_pipeline_llama import CONFIG
    chunk = LlamaModel(CONFIG, None, layer_range=(2, 4), pre_process=False, post_process=role == "last")
    chunk.set_input_tensor(torch.randn(16, 2, CONFIG.hidden_size, requires_grad=True))
    store = WeightGradStore()
    with store.active():
        loss = (chunk(labels=torch.randint(0, 256, (2, 16))) if role == "last" else chunk()).float().sum()
    probe = ActivationProbe([chunk])
    probe.forward_done("k", loss)
    with store.capture("k"):
        loss.backward()
    del loss
    chunk.set_input_tensor(None)
    probe.backward_done("k", split=True, held=store.held_tensors("k"))
    store.run("k")
    assert 0.1 < probe.w_share < probe.held_shares[0] < 1.0, (probe.shares, probe.held_shares)
    assert probe.held_shares[0] - probe.w_share > 0.2


def test_planning_memory_under_recompute_covers_what_w_holds():
    """With full recompute a forward saves only its checkpoints' inputs, but W still holds the recomputed
    layer inputs and the output gradients: many units. The planning unit must grow to that, not cap it."""
    from llamapipe.model.llama import LlamaModel
    from tests.multiproc.test_pipeline_llama import CONFIG
    config = dataclasses.replace(CONFIG, recompute_granularity="full")
    chunk = LlamaModel(config, None, layer_range=(2, 4), pre_process=False, post_process=False)
    chunk.set_input_tensor(torch.randn(16, 2, CONFIG.hidden_size, requires_grad=True))
    store = WeightGradStore()
    with store.active():
        out = chunk()
    probe = ActivationProbe([chunk])
    probe.forward_done("k", out)
    with store.capture("k"):
        out.backward(torch.randn_like(out))
    del out
    chunk.set_input_tensor(None)
    probe.backward_done("k", split=True, held=store.held_tensors("k"))
    store.run("k")
    assert probe.w_held_share > 1.5, probe.held_shares
    unit, w_mem = probe.planning_memory()
    assert w_mem == 1.0 and unit == round(probe.unit_bytes * probe.w_held_share)

"""Peak saved-activation bytes per rank, measured with saved_tensors_hooks, equal the simulator's prediction.

A unit is one microbatch-chunk forward's saved bytes and M_W/M_B the share still held after B (the
linears' inputs, kept for the deferred weight gradient); both are measured on a standalone F/B/W of
one chunk, then `simulate(plan, Costs(act_mem=1, w_mem=share)).peak_memory` times the unit must match
the peak measured while the executor runs the plan (within 5%), and nothing may stay alive afterwards.
"""
from __future__ import annotations

import weakref

import pytest
import torch
from torch import nn

from core.pipeline_parallel import weight_grad_store
from tests.harness import run_distributed
from tests.test_pipeline_executor import BATCH, LAYERS, SEQ, ToyChunk, _Linear, make_batches

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

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        if t.is_floating_point() and not isinstance(t, nn.Parameter):
            storage = t.untyped_storage()
            if id(storage) not in self._ids:
                self._ids.add(id(storage))
                self.live += storage.nbytes()
                self.peak = max(self.peak, self.live)
                weakref.finalize(storage, self._free, id(storage), storage.nbytes())
        return t

    def _free(self, key: int, nbytes: int) -> None:
        self._ids.discard(key)
        self.live -= nbytes

    def hooks(self):
        return torch.autograd.graph.saved_tensors_hooks(self.pack, lambda t: t)


def _mem_chunks(pp_rank: int, pp: int, vpp: int, placement: str) -> list[MemChunk]:
    from core.pipeline_parallel.schedule_ir import stage_of
    stages, per = pp * vpp, LAYERS // (pp * vpp)
    chunks = []
    for s in (stage_of(pp_rank, c, pp, placement) for c in range(vpp)):
        chunks.append(MemChunk(s * per, (s + 1) * per, s == 0, s == stages - 1, hidden=HIDDEN))
    return chunks


def _unit(chunk: MemChunk) -> tuple[int, float]:
    """(saved bytes of one forward, share still saved after B) on a standalone F, B, W."""
    tracker, batch = SavedBytes(), make_batches(1)[0]
    chunk.set_input_tensor(torch.randn(SEQ, BATCH, HIDDEN, requires_grad=True))
    with tracker.hooks():
        out = chunk(input_ids=batch["tokens"], labels=batch["labels"])
    unit = tracker.live
    with weight_grad_store.capture("unit"):
        out.backward(torch.ones_like(out))
    held = tracker.live
    weight_grad_store.run("unit")
    chunk.zero_grad(set_to_none=True)
    return unit, held / unit


def _forward_step(data_iterator, model):
    batch = next(data_iterator)
    return model(input_ids=batch["tokens"]), lambda out: (out.sum(), torch.tensor(out.numel()), {})


def memory_worker(rank: int, world: int, cases: list) -> dict:
    import dataclasses
    from core.parallel_state import destroy_model_parallel, initialize_model_parallel
    from core.pipeline_parallel import executor
    from core.pipeline_parallel.schedules import cached_plan
    from core.pipeline_parallel.simulator import Costs, simulate
    ps = initialize_model_parallel(1, world)
    out = {}
    try:
        for schedule, vpp, m in cases:
            plan = cached_plan(schedule, world, vpp, m)
            chunks = _mem_chunks(ps.pp_rank, world, vpp, plan.placement)
            unit, share = _unit(chunks[0])
            predicted = simulate(plan, Costs(act_mem=1.0, w_mem=share)).peak_memory[ps.pp_rank] * unit
            tracker, batches = SavedBytes(), make_batches(m)
            with tracker.hooks():
                executor.run(plan, model_chunks=chunks, forward_step_func=_forward_step,
                             data_iterator=[iter(batches) for _ in chunks],
                             parallel_state=dataclasses.replace(ps, vpp_size=vpp), num_microbatches=m)
            out[(schedule, vpp, m)] = (tracker.peak, predicted, tracker.live, share)
    finally:
        destroy_model_parallel()
    return out


@pytest.mark.slow
def test_peak_saved_activations_match_simulator():
    cases = [("1f1b", 1, 6), ("zb-h1", 1, 6), ("zbv", 2, 6), ("zb-h2", 1, 6), ("gpipe", 1, 3)]
    results = run_distributed(memory_worker, 2, cases, timeout=180)
    for pp_rank, per_rank in enumerate(results):
        for case, (peak, predicted, live_after, share) in per_rank.items():
            assert live_after == 0, f"{case} rank {pp_rank}: {live_after} saved bytes alive after the step"
            assert 0.3 < share < 0.7, f"B should keep the linears' inputs for W, kept {share:.2f}"
            assert abs(peak - predicted) <= 0.05 * predicted, \
                f"{case} rank {pp_rank}: measured peak {peak} bytes, simulator predicts {predicted:.0f}"

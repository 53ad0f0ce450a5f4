"""PipeOffload on the real LlamaModel (tiny, fp32, gloo, pp 2): O/R actions placed by the plan change nothing in
the numbers and take the offloaded activations off the device.

Compared: losses and first-step gradients against the single-rank run (rel 1e-5) and bit for bit against the same
schedule without offload; the probe's peak device-resident saved bytes per rank against the run without offload
and against the simulator's peak for the offload plan (units measured on the same run)."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from tests.harness import run_distributed
from tests.multiproc.test_pipeline_llama import CONFIG, _sgd_steps, assert_match_single_rank, llama_chunks


class _Moved:
    """Per chunk: the bytes each O moved to the host (read from the store's host bytes around it)."""

    def __init__(self) -> None:
        from llamapipe.core.pipeline_parallel.runtime import StepObserver
        self.__class__ = type("Moved", (StepObserver,), dict(vars(_Moved)))
        self.store, self.moved, self.plan, self.held = None, {}, None, 0

    def offload_begin(self, store) -> None:
        self.store = store

    def step_begin(self, plan, pp_rank, forward_only) -> None:
        self.plan, self.host = plan, 0

    def action_done(self, action, start, end, blocked_s) -> None:
        if self.store is not None:
            host = self.store.host_bytes()
            if action.kind == "O":
                self.moved[action.chunk] = host - self.host
            elif action.kind == "OW":
                self.held += host - self.host
            self.host = host


def predicted_peak(plan, pp_rank: int, units: list[int], moved: dict) -> float:
    """The plan's peak of device-resident saved bytes on `pp_rank`: each F adds its measured unit (in F order), an
    O takes off what it moved, an R brings it back, the B frees the unit (the probe's accounting: W-held bytes
    are not activations here)."""
    from llamapipe.core.pipeline_parallel.schedule_ir import BACKWARD_KINDS
    level = peak = 0.0
    forwards = iter(units)
    unit = {}
    for a in plan.actions[pp_rank]:
        key = (a.chunk, a.microbatch)
        if a.kind == "F":
            unit[key] = next(forwards)
            level += unit[key]
        elif a.kind in ("O", "R"):
            level += moved[a.chunk] * (-1 if a.kind == "O" else 1)
        elif a.kind in BACKWARD_KINDS:
            level -= unit[key]
        peak = max(peak, level)
    return peak


def offload_worker(rank: int, world: int, pp: int, cases: list) -> dict:
    from llamapipe.core.parallel_state import destroy_model_parallel, initialize_model_parallel
    from llamapipe.core.pipeline_parallel.activation_memory import ActivationProbe
    from llamapipe.core.pipeline_parallel.offload_plan import OffloadOptions
    from llamapipe.core.pipeline_parallel.runtime import RuntimeOptions
    from llamapipe.core.pipeline_parallel.schedules import get_forward_backward_func
    ps0 = initialize_model_parallel(1, pp)
    out = {}
    try:
        for case in cases:
            schedule, vpp, m, chunk_num, *held = case
            ps = dataclasses.replace(ps0, vpp_size=vpp)
            chunks = llama_chunks(ps, schedule, pp, vpp)
            probe, moved = ActivationProbe(chunks), _Moved()
            offload = (OffloadOptions(chunk_num, reload_lead=0, held=bool(held))   # reload_lead 0: as training on CPU
                       if chunk_num else None)
            options = RuntimeOptions(profile_iters=1, observers=(probe, moved), offload=offload)
            fb = get_forward_backward_func(ps, schedule, options=options)
            losses, grads = _sgd_steps(chunks, fb, ps, m)
            units = probe.units[-len([a for a in moved.plan.actions[ps.pp_rank] if a.kind == "F"]):]
            if chunk_num:       # the offloaded forwards' units: what the run without offload measured
                units = out[(schedule, vpp, m, 0)][3]
            out[case] = (losses, grads, probe.peaks[-1], units,
                         predicted_peak(moved.plan, ps.pp_rank, units, moved.moved), moved.held)
    finally:
        destroy_model_parallel()
    return out


CASES = [("interleaved", 2, 4, 0), ("interleaved", 2, 4, 1), ("zbv", 2, 4, 0), ("zbv", 2, 4, 1),
         ("1f1b", 1, 4, 0), ("1f1b", 1, 4, 1), ("group-interleaved", 2, 4, 0), ("group-interleaved", 2, 4, 1)]
HELD = ("zbv", 2, 4, 2, True)       # --offload-weight-grad-inputs: what deferred Ws hold goes to the host too


@pytest.mark.slow
def test_offload_keeps_the_numbers_and_frees_the_device():
    results = run_distributed(offload_worker, 2, 2, CASES + [HELD], timeout=240)
    three = [case[:3] for case in CASES]
    assert_match_single_rank([{c[:3]: r[c][:2] for c in CASES if c[3]} for r in results], three[1::2], dp=1)
    for r in results:
        for base, off in zip(CASES[0::2], CASES[1::2]):
            assert r[base][0] == r[off][0], f"{off}: losses not bit-identical to the run without offload"
            for name, grad in r[base][1].items():
                assert (grad == r[off][1][name]).all(), f"{off} {name}: gradient differs"
        zbv = r[("zbv", 2, 4, 0)]
        assert r[HELD][0] == zbv[0] and all((g == r[HELD][1][n]).all() for n, g in zbv[1].items()), HELD
    assert sum(r[HELD][5] for r in results) > 0, "no OW moved what a deferred W holds"
    for base, off in zip(CASES[0::2], CASES[1::2]):
        for rank, r in enumerate(results):
            before, after, predicted = r[base][2], r[off][2], r[off][4]
            assert abs(after - predicted) <= 0.05 * predicted, f"{off} rank {rank}: {after} bytes, plan {predicted}"
            assert r[base][2] == r[base][4], f"{base} rank {rank}: the accounting itself"
            if base[0] in ("zbv", "group-interleaved"):     # 2 chunks a rank; interleaved at pp 2 keeps chunk 1's
                # warm-up: 0.6 on rank 0 (the simulator's bound for that schedule); 1f1b has one chunk
                assert after <= 0.55 * before, f"{off} rank {rank}: {after} of {before} bytes"

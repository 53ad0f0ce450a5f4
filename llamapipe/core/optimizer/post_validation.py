"""Optimizer post-validation (zero-bubble paper, arXiv 2401.10241 section 4): step first, validate after.

A synchronous step is a barrier over the whole pipeline: the global grad norm (clipping) and the global
inf/NaN check need every stage's gradients. With post-validation each rank packs its own statistics
(squared grad norm, non-finite flag, and the loss sum and token count it holds) into
one small tensor, starts a *non-blocking* all-reduce of it over the model-parallel group, and, when its
own statistics say the update cannot be clipped or skipped, applies the unclipped AdamW update at once
("speculates") and goes on to the next iteration. The reduced result is read later (`finish`): when the
synchronous step would have done something else (clip, skip, stop), the update is rolled back from a
snapshot and redone exactly as the synchronous path does it, and every rank re-runs the iteration that
ran on the speculative parameters (`Resolution.replay`).

Rollback keeps a copy of what an AdamW step overwrites: the rank's fp32 main parameters and both moments
(12 bytes per parameter of the rank's optimizer shard) plus the step's gradients until validation (4 bytes
per parameter). No cheaper exact way exists: AdamW's update is not invertible in floating point.
A rank whose own statistics already show that clipping or a skip is coming does not speculate; it waits
for the reduction instead (the synchronous step). Nor does the rank whose gradients are final last: its own
contribution completes the reduction, which it sees within `GRACE_S`, so it steps synchronously without a
snapshot; only ranks that would otherwise wait (ranks with slack) pay for the snapshot. Whether any rank
speculated is reduced separately (a one-element flag, over data-parallel peers too: a replay is a
forward-backward with their collectives, so every rank must agree on it).

A rank's own part of the norm says little when another stage holds most of it (an uneven split: the light
stage's part stays under --clip-grad while the global norm clips), so each wrong speculation costs a
rollback and a whole re-run iteration. `SpeculationPolicy` therefore pauses speculation after any step that
was not applied unclipped and resumes it only after a run of steps that were.
"""
from __future__ import annotations

import math
import time
from collections import Counter
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.distributed as dist

SQ, NONFINITE, LOSS, TOKENS = range(4)
STATS = 4            # the sync path reduces a tensor of the same size, so its sums are bit-identical
GRACE_S = 1.0e-3     # how long a rank waits for the reduction before it speculates
RESUME_AFTER = 4     # steps in a row applied unclipped before speculation starts (again)
RESUME_AFTER_MAX = 64   # each wrong speculation doubles that wait, up to this
PAUSED_BY = {"start": "at the start", "clip": "after clipping", "found_inf": "after overflows",
             "nonfinite_norm": "after non-finite steps", "nonfinite_loss": "after non-finite steps"}


def arrives_within(work: Optional[Any], seconds: float) -> bool:
    """Whether the non-blocking reduction `work` completes within `seconds` (spinning; None: no reduction)."""
    if work is None:
        return True
    deadline = time.perf_counter() + seconds
    while not work.is_completed():
        if time.perf_counter() > deadline:
            return False
    return True


def wait(*works: Optional[Any]) -> None:
    """Wait for each non-blocking collective (None: there was none)."""
    for work in works:
        if work is not None:
            work.wait()


def reduce_stats_async(pack: torch.Tensor, groups: list) -> Optional[Any]:
    """All-reduce `pack` (SUM) over `groups` in turn; the last reduction is left running (its work is
    returned), the earlier ones block (they are over ranks that run in lockstep, e.g. DP peers)."""
    from llamapipe.core.distributed.grad_reduce import group_size
    groups = [g for g in groups if group_size(g) > 1]
    for group in groups[:-1]:
        dist.all_reduce(pack, group=group)
    return dist.all_reduce(pack, group=groups[-1], async_op=True) if groups else None


def count_speculating(speculated: bool, groups: list, device: torch.device) -> tuple[torch.Tensor, Optional[Any]]:
    """How many ranks speculated: a one-element tensor all-reduced over `groups` (the last without blocking).
    Pass DP peers too: a replay runs their collectives, so every rank must agree on it."""
    flag = torch.full((1,), float(speculated), dtype=torch.float64, device=device)
    return flag, reduce_stats_async(flag, groups)


class Snapshot:
    """What an AdamW step overwrites: main params, moments and step counts, the loss scaler, the step count.
    Buffers are allocated once and reused."""

    def __init__(self) -> None:
        self._buffers: list[torch.Tensor] = []
        self._had_state: list[bool] = []
        self._scaler: Optional[dict] = None
        self._num_steps = 0

    @staticmethod
    def _tensors(optimizer: Any, had_state: list[bool]) -> list[torch.Tensor]:
        tensors = list(optimizer.mains)
        for main, had in zip(optimizer.mains, had_state):
            if had:
                state = optimizer.inner.state[main]
                tensors += [state["exp_avg"], state["exp_avg_sq"], state["step"]]
        return tensors

    def capture(self, optimizer: Any) -> None:
        self._had_state = [("exp_avg" in optimizer.inner.state.get(m, {})) for m in optimizer.mains]
        tensors = self._tensors(optimizer, self._had_state)
        if [t.shape for t in self._buffers] != [t.shape for t in tensors]:
            self._buffers = [torch.empty_like(t) for t in tensors]
        for buffer, tensor in zip(self._buffers, tensors):
            buffer.copy_(tensor)
        scaler = optimizer.grad_scaler
        self._scaler = dict(scaler.state_dict()) if scaler is not None else None
        self._num_steps = optimizer.num_steps

    def restore(self, optimizer: Any) -> None:
        for main, had in zip(optimizer.mains, self._had_state):
            if not had:
                optimizer.inner.state.pop(main, None)
        for buffer, tensor in zip(self._buffers, self._tensors(optimizer, self._had_state)):
            tensor.copy_(buffer)
        if self._scaler is not None:
            optimizer.grad_scaler.load_state_dict(self._scaler)
        optimizer.num_steps = self._num_steps

    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self._buffers)


@dataclass
class PendingStep:
    """A step whose global statistics are still being reduced."""
    pack: torch.Tensor
    work: Optional[Any]
    grads: list[torch.Tensor]          # the step's main grads, kept until it is resolved
    speculated: bool                   # this rank already applied the unclipped update
    flag: torch.Tensor                 # how many ranks speculated (reduced by flag_work)
    flag_work: Optional[Any]
    resolution: Optional["Resolution"] = None


@dataclass(frozen=True)
class Resolution:
    """What the synchronous step would have done, and what it means for the iteration after it."""
    action: str                 # "apply", "clip", "found_inf" (fp16: skipped), "nonfinite_norm", "nonfinite_loss"
    grad_norm: float
    loss_sum: float
    tokens: float
    replay: bool                # some rank speculated wrongly (and rolled back): the next iteration must run again

    @property
    def update_successful(self) -> bool:
        return self.action in ("apply", "clip")

    @property
    def loss(self) -> float:
        return self.loss_sum / max(self.tokens, 1.0)


def decide(pack: torch.Tensor, clip_grad: float, fp16: bool) -> tuple[str, float]:
    """The synchronous step's decision from the reduced statistics: (action, grad norm)."""
    loss = pack[LOSS].item() / max(pack[TOKENS].item(), 1.0)
    if not fp16 and not math.isfinite(loss):
        return "nonfinite_loss", float("nan")
    if fp16 and pack[NONFINITE].item() > 0:
        return "found_inf", float("nan")
    norm = math.sqrt(pack[SQ].item())
    if not math.isfinite(norm):
        return "nonfinite_norm", norm
    if clip_grad > 0 and clip_grad / (norm + 1.0e-6) < 1.0:
        return "clip", norm
    return "apply", norm


def may_speculate(pack: torch.Tensor, clip_grad: float, loss_sum: float) -> bool:
    """Whether this rank's own (stage-level) statistics allow an unclipped, finite update: its part of the
    norm alone must stay under the clip threshold (the global norm is at least as large)."""
    if pack[NONFINITE].item() > 0 or not math.isfinite(loss_sum):
        return False
    norm = math.sqrt(pack[SQ].item())
    return math.isfinite(norm) and not (clip_grad > 0 and clip_grad / (norm + 1.0e-6) < 1.0)


class SpeculationPolicy:
    """Whether ranks may speculate on the step that starts now, from the global actions of the steps resolved
    before it. Those are the same on every rank, so every rank decides alike.

    A wrong speculation (the step clips or is skipped) costs a rollback and a re-run iteration; a right one
    saves at most one pipeline fill. So speculation pauses at every step that was not applied unclipped and
    resumes once `resume_after` steps in a row were. Every step still resolves while paused, so the policy
    keeps learning at no cost (no probing). Each wrong speculation doubles `resume_after` (up to
    RESUME_AFTER_MAX): norms that hover around --clip-grad replay a bounded number of times. A run starts
    paused, so a run that clips from its first step never replays.
    """

    def __init__(self) -> None:
        self.resume_after = RESUME_AFTER
        self.applied_in_a_row = 0
        self.reason = "start"           # why speculation is paused: "start" or the action that paused it
        self.paused: Counter = Counter()     # paused steps by reason

    def begin_step(self) -> bool:
        """Whether ranks may speculate on the step that starts now (a paused step is counted)."""
        if self.applied_in_a_row >= self.resume_after:
            return True
        self.paused[self.reason] += 1
        return False

    def record(self, action: str, speculated: bool) -> None:
        """The next step (steps resolve in the order they began) resolved with `action`; `speculated`: some rank
        had speculated on it."""
        if action == "apply":
            self.applied_in_a_row += 1
            return
        if speculated:
            self.resume_after = min(2 * self.resume_after, RESUME_AFTER_MAX)
        self.applied_in_a_row, self.reason = 0, action

    def describe(self, steps: int) -> str:
        """E.g. "speculation paused on 14 of 16 iterations (4 at the start, 10 after clipping)"."""
        why: Counter = Counter()
        for reason, n in self.paused.items():
            why[PAUSED_BY[reason]] += n
        detail = ", ".join(f"{n} {words}" for words, n in why.items())
        return f"speculation paused on {sum(why.values())} of {steps} iterations" + (f" ({detail})" if detail else "")

"""Measured activation memory, in the simulator's units (one microbatch's activations on one chunk).

After a forward, `saved_storages(root)` walks the autograd graph behind `root` and collects the distinct
floating-point storages its nodes saved for backward (model parameters and buffers excluded): their
bytes are the forward's unit (M_B). `ActivationProbe` does this for every forward of a step and follows
those storages with weak references; what is still alive after the forward's B is the part of the saved
activations the deferred weight gradients keep until W (`w_share`). The W closures also hold what autograd
did not save: the output gradients, and the all-gathered input under sequence parallelism. `w_held_share`
adds those (read from the closures queued in the step's `WeightGradStore`): all that W holds from B until it
runs (M_W).
`--pipeline-schedule auto` uses it on its first profiling iteration to simulate memory as it is and to
turn a byte cap into units (the cap's flag value is read by training/arguments/memory_limit.py).

The graph is only read: saved-tensor hooks would have been simpler, but while they are active autograd
hands backward a copy of each saved tensor instead of the tensor itself, which breaks code that sets
`.grad` or attributes on a saved weight.
"""
from __future__ import annotations

import statistics
import time
import weakref
from typing import Hashable, Iterable, Iterator, Optional

import torch
from torch import nn

from llamapipe.core.pipeline_parallel.runtime import StepObserver


def _saved_tensors(node) -> Iterator[torch.Tensor]:
    """Tensors a graph node stores for backward, read without unpacking (`_raw_saved_*`). A tensor behind an
    unpack hook (activation recompute) is not stored, and unpacking it would recompute it: what counts is
    what the checkpoint keeps, its region's inputs."""
    for name in [n for n in dir(node) if n.startswith("_raw_saved_")]:
        try:
            value = getattr(node, name)
        except RuntimeError:            # already freed
            continue
        yield from _stored(value if isinstance(value, (tuple, list)) else (value,))


def _stored(saved_tensors: Iterable) -> Iterator[torch.Tensor]:
    for saved in saved_tensors:
        if not isinstance(saved, torch._C._autograd.SavedTensor):
            continue
        if saved.unpack_hook is not None:      # e.g. inside torch.utils.checkpoint: count what it keeps
            yield from _stored(_checkpoint_inputs(saved.unpack_hook))
            continue
        try:
            data = saved.data
        except RuntimeError:
            continue
        if data is not None:
            yield data


def _checkpoint_inputs(unpack_hook) -> list:
    """The region inputs a non-reentrant checkpoint keeps for its recompute (torch's `_CheckpointFrame.
    saved_args`); [] for any other hook. Best effort: it reads torch internals and never unpacks."""
    try:
        cells = dict(zip(unpack_hook.__code__.co_freevars, unpack_hook.__closure__ or ()))
        return list(getattr(cells["frame"].cell_contents, "saved_args", []))
    except (AttributeError, KeyError, ValueError):
        return []


def storage_id(storage: torch.UntypedStorage) -> Optional[int]:
    """A storage's identity: its data pointer, or on the meta device (no memory, every pointer 0: the dry run)
    the storage object itself, which torch keeps while the storage lives; None for a storage torch has
    invalidated (FSDP frees an unsharded parameter's between uses), which holds nothing."""
    try:
        return storage.data_ptr() or id(storage)
    except RuntimeError:
        return None


def _activation_storages(tensors: Iterable[torch.Tensor], exclude: set,
                         found: dict[int, torch.UntypedStorage]) -> None:
    """Add to `found` the non-empty storages of floating-point `tensors`, by `storage_id`, except `exclude`d."""
    for t in tensors:
        if t.is_floating_point():
            storage = t.untyped_storage()
            key = storage_id(storage)
            if key is not None and key not in exclude and storage.nbytes() > 0:
                found[key] = storage


def saved_storages(root: torch.Tensor, exclude: Iterable[int] = ()) -> dict[int, torch.UntypedStorage]:
    """Distinct floating-point storages saved for backward behind `root`, by `storage_id` (`exclude`d ids
    left out)."""
    exclude = set(exclude)
    found: dict[int, torch.UntypedStorage] = {}
    seen, stack = set(), [root.grad_fn]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        _activation_storages(_saved_tensors(node), exclude, found)
        stack.extend(fn for fn, _ in node.next_functions)
    return found


class ActivationProbe(StepObserver):
    """Saved bytes of each forward of a step, and the share of them still alive after its B."""

    def __init__(self, model_chunks: Iterable[nn.Module]) -> None:
        self._exclude = {storage_id(t.untyped_storage()) for chunk in model_chunks
                         for t in list(chunk.parameters()) + list(chunk.buffers())}
        self._live: dict[Hashable, int] = {}
        self._unit: dict[Hashable, int] = {}
        self._alive: dict[Hashable, set] = {}   # storage_ids of a forward's saved storages still alive
        self.overhead_s = 0.0               # spent measuring (the executor keeps it out of action times)
        self.units: list[int] = []          # saved bytes of each forward
        self.shares: list[float] = []       # share of a forward's saved bytes still alive after its B
        self.held_shares: list[float] = []  # that plus what the W closures hold besides, over the unit
        self.peaks: list[int] = []          # per step: the most saved bytes on the device between actions
        self._store = None                  # the step's offload store (PipeOffload), if it offloads

    def step_begin(self, plan, pp_rank: int, forward_only: bool) -> None:
        self.peaks.append(0)

    def offload_begin(self, store) -> None:
        """Called before `step_begin` of a step that offloads; the store is forgotten at its end."""
        self._store = store

    def step_end(self, largest_send) -> None:
        self._store = None

    def action_done(self, action, start: float, end: float, blocked_s: float) -> None:
        """The device-resident saved bytes after `action`: forwards not yet backward (their saved storages still
        alive), the offloaded ones as the store holds them on the device."""
        if self.peaks:
            resident = sum(self._live.values()) + (self._store.device_bytes() if self._store is not None else 0)
            self.peaks[-1] = max(self.peaks[-1], resident)

    def forward_done(self, key: Hashable, output: torch.Tensor) -> None:
        """After the forward of `key` (chunk, microbatch); `output` is its output or loss."""
        if output.grad_fn is None:
            return
        start = time.perf_counter()
        storages = saved_storages(output, self._exclude)
        total = sum(s.nbytes() for s in storages.values())
        self.units.append(total)
        self._unit[key] = self._live[key] = total
        self._alive[key] = set(storages)
        for ptr, storage in storages.items():
            weakref.finalize(storage, self._freed, key, ptr, storage.nbytes())
        self.overhead_s += time.perf_counter() - start

    def _freed(self, key: Hashable, ptr: int, nbytes: int) -> None:
        if key in self._live:
            self._live[key] -= nbytes
            self._alive[key].discard(ptr)

    def backward_done(self, key: Hashable, split: bool, held: Iterable[torch.Tensor] = ()) -> None:
        """After the B (`split`: W still to come) or the fused BW of `key`, once it dropped its graph and
        before its W ran; `held`: the tensors key's W closures keep (`WeightGradStore.held_tensors`)."""
        start = time.perf_counter()
        live, unit, alive = self._live.pop(key, None), self._unit.pop(key, 0), self._alive.pop(key, set())
        if split and live is not None and unit > 0:
            self.shares.append(live / unit)
            self.held_shares.append((live + self._closure_bytes(held, alive)) / unit)
        self.overhead_s += time.perf_counter() - start

    def _closure_bytes(self, held: Iterable[torch.Tensor], counted: set) -> int:
        """Bytes of the distinct floating-point storages among `held`, beyond `counted` ids and the
        model's own parameters and buffers."""
        found: dict[int, torch.UntypedStorage] = {}
        _activation_storages(held, self._exclude | counted, found)
        return sum(storage.nbytes() for storage in found.values())

    @property
    def unit_bytes(self) -> int:
        return max(self.units, default=0)

    @property
    def w_share(self) -> float:
        """Median share of a unit's saved activations still alive from B until W (0.5 before any B)."""
        return min(max(statistics.median(self.shares), 0.0), 1.0) if self.shares else 0.5

    @property
    def w_held_share(self) -> float:
        """Median share of a unit that W holds from B until it runs: the saved activations still alive and
        the output gradients (and other tensors) of its closures; 0.5 before any B. It can exceed 1:
        under activation recompute the unit is only the checkpoints' inputs."""
        return max(statistics.median(self.held_shares), 0.0) if self.held_shares else 0.5

    def planning_memory(self) -> tuple[int, float]:
        """(bytes of one unit, M_W in units) for the simulator, whose model needs M_W <= M_B = 1. When W
        holds more than the forward saved, the unit grows to what W holds (and M_W = 1), so memory is
        overestimated between F and B rather than underestimated after B, and a byte cap stays safe."""
        held = self.w_held_share
        if held > 1.0:
            return round(self.unit_bytes * held), 1.0
        return self.unit_bytes, held

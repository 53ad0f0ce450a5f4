"""Where an offloaded forward's saved activations live between its O and its R (PipeOffload, arXiv 2503.01328).

During the forward of a (chunk, microbatch) that the plan offloads, `OffloadStore.packing(key)` installs
saved-tensor hooks (`torch.autograd.graph.saved_tensors_hooks`, what `torch.autograd.graph.save_on_cpu` uses):
every activation autograd saves for the backward is recorded here by its storage, so views of one storage (the
fused QKV output's q, k and v) are copied once and come back as views again. Parameters, the chunk's received
input (both leaves that need a gradient) and tensors under `min_numel` elements pass through untouched; with
`modules` (Megatron's --offload-modules) only what those submodules save during their forward is recorded. The
plan's O action moves the key's storages to host memory (up to `fraction` of their bytes, less `rank_delta_bytes`
x pipeline rank spread over the step's offloaded forwards: Megatron's --activation-offload-fraction and
--delta-offload-bytes-across-pp-ranks), its R moves them back, and the backward unpacks them; a tensor still on the
host when the backward asks (no R yet) is copied back then. What a deferred weight gradient holds from its B to
its W goes the same way (`offload_held` for the plan's OW, `reload_held` for its RW, `release_held` after the W):
the tensors in the W closures' cells become stand-ins while their storages are on the host.

On CUDA the host copies are pinned buffers from a pool (kept across steps, as on a CPU) and both directions run
on one copy stream with events,
so a copy overlaps compute; the device storage is released to the allocator only after its copy is done
(`record_stream`). On CPU both memories are the same RAM: an O copies each storage into a separate host store
and drops the device one, an R copies it back, so every path runs (and is tested) here and `device_bytes` says
what the device would hold.
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Hashable, Iterator, Optional

import torch
from torch import nn

from llamapipe.core.pipeline_parallel.activation_memory import storage_id
from llamapipe.core.pipeline_parallel.offload_plan import OffloadOptions


# Host buffers by (pinned, bytes), kept across steps: every step offloads the same shapes, so after the first one
# no O allocates (pinning memory is slow on CUDA; on a CPU a fresh block costs its page faults every step).
_HOST_POOL: dict[tuple[bool, int], list[torch.Tensor]] = {}


class _Storage:
    """One saved storage: on the device (`dev`) or on the host (`host`), never both once a copy is done."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self.dev: Optional[torch.Tensor] = torch.empty(0, dtype=torch.uint8, device=tensor.device).set_(
            tensor.untyped_storage())
        self.device, self.full = tensor.device, self.dev.numel()
        self.host: Optional[torch.Tensor] = None
        self.ready: Optional[torch.cuda.Event] = None      # the last copy's event (CUDA)

    @property
    def nbytes(self) -> int:
        """Its bytes now: 0 while partial recompute (model/recompute.py) has freed it on the device."""
        if self.dev is not None:
            return self.dev.untyped_storage().nbytes()
        return self.full

    @property
    def discarded(self) -> bool:
        return self.dev is not None and self.nbytes != self.full


class _View:
    """A saved tensor as a view of a `_Storage`: rebuilt from its dtype, offset, size and stride on unpack."""

    def __init__(self, storage: _Storage, tensor: torch.Tensor) -> None:
        self.storage, self.dtype = storage, tensor.dtype
        self.offset, self.size, self.stride = tensor.storage_offset(), tensor.size(), tensor.stride()


class OffloadStore:
    """The saved activations of the offloaded forwards of one rank's step, by (chunk, microbatch)."""

    def __init__(self, model_chunks: list[nn.Module], options: Optional["OffloadOptions"] = None, pp_rank: int = 0,
                 forwards: int = 1) -> None:
        options = options or OffloadOptions(chunk_num=len(model_chunks))
        self.min_numel, self.fraction = options.min_numel, options.fraction
        self.delta = options.rank_delta_bytes * pp_rank / max(forwards, 1)    # bytes fewer per offloaded forward
        self._modules = [m for c in model_chunks for name, m in c.named_modules()
                         if options.modules and name.endswith(options.modules)]
        self._inside = 0 if options.modules else 1      # > 0 while a selected module runs its forward
        self._params = {storage_id(t.untyped_storage()) for c in model_chunks     # and buffers (RoPE tables);
                        for t in list(c.parameters()) + list(c.buffers())}     # None: a storage FSDP freed
        self._keys: dict[Hashable, dict[int, _Storage]] = {}
        self._kept: dict[Hashable, dict[int, int]] = {}     # bytes of the other saved storages (stay on device)
        self._held: dict[Hashable, dict[int, _Storage]] = {}    # what deferred Ws hold, from their OW to their W
        self._cuda = any(p.is_cuda for c in model_chunks for p in c.parameters())
        self._stream = torch.cuda.Stream() if self._cuda else None
        self.copied_bytes = 0                               # bytes moved either way, over the store's life

    @contextmanager
    def packing(self, key: Hashable) -> Iterator[None]:
        """Record what the forward of `key` saves for its backward (see the module docstring)."""
        storages, kept = self._keys.setdefault(key, {}), self._kept.setdefault(key, {})

        def pack(tensor: torch.Tensor):
            if not self._offloadable(tensor):
                key = storage_id(tensor.untyped_storage())
                if tensor.is_floating_point() and key is not None and key not in self._params:
                    kept[tensor.untyped_storage()._cdata] = tensor.untyped_storage().nbytes()
                return tensor
            # the storage object itself, not its data pointer: a storage partial recompute frees (model/recompute.py)
            # gives its memory, and so its pointer, to later tensors of the same forward
            ptr = tensor.untyped_storage()._cdata
            if ptr not in storages:
                storages[ptr] = _Storage(tensor)
            return _View(storages[ptr], tensor)

        handles = [h for m in self._modules for h in (m.register_forward_pre_hook(self._enter),
                                                       m.register_forward_hook(self._leave))]
        try:
            with torch.autograd.graph.saved_tensors_hooks(pack, self._unpack):
                yield
        finally:
            for handle in handles:
                handle.remove()

    def _enter(self, module: nn.Module, args) -> None:
        self._inside += 1

    def _leave(self, module: nn.Module, args, output) -> None:
        self._inside -= 1

    def _offloadable(self, tensor: torch.Tensor) -> bool:
        if self._inside <= 0 or tensor.numel() < self.min_numel:
            return False
        if not tensor.is_floating_point() or (tensor.requires_grad and tensor.is_leaf):
            return False
        base = tensor._base if tensor._base is not None else tensor
        if isinstance(base, nn.Parameter) or storage_id(tensor.untyped_storage()) in self._params:
            return False
        return tensor.untyped_storage().nbytes() > 0

    def _unpack(self, packed) -> torch.Tensor:
        if not isinstance(packed, _View):
            return packed
        storage = packed.storage
        if storage.dev is None:             # no R ran for it: copy it back now
            self._to_device(storage)
        if storage.ready is not None:
            torch.cuda.current_stream().wait_event(storage.ready)
        return torch.empty(0, dtype=packed.dtype, device=storage.device).set_(
            storage.dev.untyped_storage(), packed.offset, packed.size, packed.stride)

    def offload(self, key: Hashable) -> None:
        """The O action: `key`'s storages to host memory, in the order the forward saved them, up to the budget."""
        storages = list(self._keys.get(key, {}).values())
        budget = self.fraction * sum(s.nbytes for s in storages) - self.delta
        for storage in storages:
            if storage.dev is not None and not storage.discarded and storage.nbytes <= budget:
                budget -= storage.nbytes
                self._to_host(storage)

    def reload(self, key: Hashable) -> None:
        """The R action: every storage of `key` back to the device."""
        for storage in self._keys.get(key, {}).values():
            if storage.dev is None:
                self._to_device(storage)

    def release(self, key: Hashable) -> None:
        """After `key`'s backward: forget its storages (autograd holds what its W still needs)."""
        self._kept.pop(key, None)
        for storage in self._keys.pop(key, {}).values():
            self._recycle(storage)

    def offload_held(self, key: Hashable, grads) -> None:
        """The OW action: what the W closures queued under `key` in `grads` (a `WeightGradStore`) hold, to host
        memory; the closures keep stand-ins until `reload_held`."""
        storages = self._held.setdefault(key, {})

        def pack(item):
            if not isinstance(item, torch.Tensor) or not self._held_offloadable(item):
                return item
            ptr = item.untyped_storage()._cdata
            if ptr not in storages:
                storages[ptr] = _Storage(item)
            return _View(storages[ptr], item)

        grads.swap_held(key, pack)
        for storage in storages.values():
            if storage.dev is not None:
                self._to_host(storage)

    def reload_held(self, key: Hashable, grads) -> None:
        """The RW action: the held storages of `key` back to the device, the closures' tensors rebuilt."""
        grads.swap_held(key, self._unpack)

    def release_held(self, key: Hashable) -> None:
        """After `key`'s W: forget its held storages."""
        for storage in self._held.pop(key, {}).values():
            self._recycle(storage)

    def _held_offloadable(self, tensor: torch.Tensor) -> bool:
        if not tensor.is_floating_point() or isinstance(tensor, nn.Parameter) or tensor.numel() < self.min_numel:
            return False
        return storage_id(tensor.untyped_storage()) not in self._params and tensor.untyped_storage().nbytes() > 0

    def recorded_bytes(self, key: Hashable) -> int:
        """What the forward of `key` saved, wherever it is now (its unit, as the probe counts an unhooked one)."""
        return sum(self._kept.get(key, {}).values()) + sum(s.nbytes for s in self._keys.get(key, {}).values())

    def device_bytes(self) -> int:
        """Bytes of what the recorded forwards saved that is now on the device (the storages they keep there
        included: the chunk's input, tensors under `min_bytes`)."""
        kept = sum(n for storages in self._kept.values() for n in storages.values())
        return kept + sum(s.nbytes for s in self._storages() if s.dev is not None)

    def host_bytes(self) -> int:
        """Bytes of recorded storages now in host memory."""
        return sum(s.nbytes for s in self._storages() if s.host is not None)

    def _storages(self) -> Iterator[_Storage]:
        for table in (self._keys, self._held):
            for storages in table.values():
                yield from storages.values()

    def _to_host(self, storage: _Storage) -> None:
        host = self._host_buffer(storage.nbytes, storage.device)
        with self._copy_stream():
            host.copy_(storage.dev, non_blocking=self._cuda)
            if self._cuda:
                storage.dev.record_stream(self._stream)
                storage.ready = _event(self._stream)
        storage.host, storage.dev = host, None
        self.copied_bytes += storage.nbytes

    def _to_device(self, storage: _Storage) -> None:
        dev = torch.empty(storage.nbytes, dtype=torch.uint8, device=storage.device)
        with self._copy_stream():
            dev.copy_(storage.host, non_blocking=self._cuda)
            if self._cuda:
                dev.record_stream(self._stream)
                storage.ready = _event(self._stream)
        self._recycle(storage)
        storage.dev = dev
        self.copied_bytes += storage.nbytes

    def _recycle(self, storage: _Storage) -> None:
        """Give a host buffer back to the pool once its copy is done."""
        if storage.host is not None and storage.host.device.type != "meta":
            if storage.ready is not None:
                storage.ready.synchronize()
            _HOST_POOL.setdefault((self._cuda, storage.nbytes), []).append(storage.host)
        storage.host = None

    def _host_buffer(self, nbytes: int, device: torch.device) -> torch.Tensor:
        if device.type == "meta":       # the dry run: the host copy is counted, not made
            return torch.empty(nbytes, dtype=torch.uint8, device="meta")
        free = _HOST_POOL.get((self._cuda, nbytes))
        if free:
            return free.pop()
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=self._cuda)

    @contextmanager
    def _copy_stream(self) -> Iterator[None]:
        if self._stream is None:
            yield
            return
        self._stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self._stream):
            yield


def _event(stream: torch.cuda.Stream) -> torch.cuda.Event:
    event = torch.cuda.Event()
    event.record(stream)
    return event

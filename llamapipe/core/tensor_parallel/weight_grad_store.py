"""Deferral of weight-gradient GEMMs for zero-bubble B/W split (arXiv 2401.10241).

Parallel linear layers never let autograd compute their weight gradient: their backward computes the
input gradient and hands a closure that computes the weight gradient to `defer`. The executor owns one
`WeightGradStore` per step and makes it current around the step (`active()`); a layer's forward remembers
the current store on its autograd context (`current()`), because its backward may run on an autograd
device thread, where the context variables of the thread that called backward are not set. Outside a
`capture(key)` block of that store the closure runs at once (plain BW); inside, it is queued under `key`
(the executor uses (chunk, microbatch)) and runs at that key's W action via `run(key)`. With no store (a
model used outside the executor) it runs at once. At the end of a step nothing may be left queued
(`assert_empty`). The store counts, per parameter, the closures still queued for it (`queued`) and tells a
listener when a queued closure has run (`set_listener`): that is how `core.distributed.grad_sync` knows a
deferred weight gradient is final.
"""
from __future__ import annotations

from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any, Callable, Hashable, Iterator, Optional, Sequence

import torch

Listener = Callable[[Sequence[torch.Tensor]], None]


class WeightGradStore:
    """The weight-gradient closures of one step, queued per key until that key's W."""

    def __init__(self) -> None:
        self._pending: dict[Hashable, list] = {}
        self._capturing: Optional[list] = None
        self._capture_key: Hashable = None
        self._queued: dict[int, int] = {}          # id(param) -> closures queued for it
        self._listener: Optional[Listener] = None

    @contextmanager
    def active(self) -> Iterator[WeightGradStore]:
        """Make this the store that forwards inside the block remember (see `current`)."""
        token = _CURRENT.set(self)
        try:
            yield self
        finally:
            _CURRENT.reset(token)

    def schedule(self, weight_grad_fn: Callable[[], None], params: Sequence[torch.Tensor]) -> None:
        """Run `weight_grad_fn` now, or queue it while a B action is capturing; `params` are the
        parameters whose `.grad` it writes (`core.distributed.grad_sync` waits for them)."""
        if self._capturing is None:
            weight_grad_fn()
            return
        self._capturing.append((weight_grad_fn, params))
        for p in params:
            self._queued[id(p)] = self._queued.get(id(p), 0) + 1

    @property
    def capturing(self) -> bool:
        """Whether a closure scheduled now is queued for a later W (inside `capture` / `begin`)."""
        return self._capturing is not None

    def queued(self, param: torch.Tensor) -> int:
        """How many queued closures will still write `param.grad`."""
        return self._queued.get(id(param), 0)

    def set_listener(self, listener: Optional[Listener]) -> None:
        """Call `listener(params)` after each queued closure ran (None: nobody listens)."""
        self._listener = listener

    def remove_listener(self, listener: Listener) -> None:
        """Stop calling `listener` if it is the one set."""
        if self._listener == listener:
            self._listener = None

    def begin(self, key: Hashable) -> None:
        """Start queueing closures under `key` (for runtimes that cannot wrap backward in `capture`)."""
        assert self._capturing is None, "capture blocks do not nest"
        assert key not in self._pending, f"weight gradients for {key} are already queued"
        self._capturing, self._capture_key = [], key

    def end(self) -> Hashable:
        """Stop queueing; returns the key the closures were queued under."""
        assert self._capturing is not None, "end() without begin()"
        key = self._capture_key
        self._pending[key], self._capturing, self._capture_key = self._capturing, None, None
        return key

    @contextmanager
    def capture(self, key: Hashable) -> Iterator[None]:
        """Queue under `key` every weight-gradient closure scheduled inside the block; the store is also
        current inside it, so a forward run there defers too."""
        self.begin(key)
        try:
            with self.active():
                yield
        finally:
            self.end()

    def run(self, key: Hashable) -> int:
        """Compute the weight gradients queued under `key`; returns how many closures ran.

        Closures run with grad mode off, as they would inside autograd's backward."""
        fns = self._pending.pop(key)
        with torch.no_grad():
            for fn, params in fns:
                fn()
                for p in params:
                    self._queued[id(p)] -= 1
                if self._listener is not None:
                    self._listener(params)
        return len(fns)

    def held_tensors(self, key: Hashable) -> Iterator[torch.Tensor]:
        """Tensors the closures queued under `key` keep alive until its W: the free variables of each closure,
        and tensors inside tuples / lists among them (e.g. the layer's input and its output gradients)."""
        for fn, _ in self._pending.get(key, ()):
            for cell in getattr(fn, "__closure__", None) or ():
                try:
                    value = cell.cell_contents
                except ValueError:           # an empty cell
                    continue
                for item in value if isinstance(value, (tuple, list)) else (value,):
                    if isinstance(item, torch.Tensor):
                        yield item

    def swap_held(self, key: Hashable, swap: Callable[[Any], Any]) -> None:
        """Replace, in their closure cells, everything `held_tensors(key)` looks at by `swap(item)` (tuples and
        lists rebuilt around it): the offload store's OW puts host-side stand-ins there and its RW the tensors
        back, so between the two the device memory is free. `swap` returns an item it does not take unchanged."""
        seen: set[int] = set()
        for fn, _ in self._pending.get(key, ()):
            for cell in getattr(fn, "__closure__", None) or ():
                if id(cell) in seen:
                    continue
                seen.add(id(cell))
                try:
                    value = cell.cell_contents
                except ValueError:           # an empty cell
                    continue
                if isinstance(value, (tuple, list)):
                    cell.cell_contents = type(value)(swap(item) for item in value)
                else:
                    cell.cell_contents = swap(value)

    def assert_empty(self) -> None:
        assert not self._pending, f"weight gradients still queued at step end: {sorted(map(str, self._pending))}"


# Context-local: the current store is scoped to the `active()` block that set it and to its thread.
_CURRENT: ContextVar[Optional[WeightGradStore]] = ContextVar("weight_grad_store", default=None)


def current() -> Optional[WeightGradStore]:
    """The store made current around this forward (`WeightGradStore.active`), or None outside any."""
    return _CURRENT.get()


def defer(store: Optional[WeightGradStore], weight_grad_fn: Callable[[], None],
          params: Sequence[torch.Tensor]) -> None:
    """From a backward: hand `weight_grad_fn` to `store` (the one its forward remembered), or run it now
    when there is none."""
    if store is None:
        weight_grad_fn()
    else:
        store.schedule(weight_grad_fn, params)

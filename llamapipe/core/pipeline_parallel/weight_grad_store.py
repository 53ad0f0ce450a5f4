"""Deferral of weight-gradient GEMMs for zero-bubble B/W split (arXiv 2401.10241).

Parallel linear layers never let autograd compute their weight gradient: their backward computes the
input gradient and hands a closure that computes the weight gradient to `schedule()`. Outside a
`capture(key)` block the closure runs at once (plain BW); inside, it is queued under `key` (the
executor uses (chunk, microbatch)) and runs at that key's W action via `run(key)`. At the end of a step
nothing may be left queued (`assert_empty`). The store counts, per parameter, the closures still queued
for it (`queued`) and tells a listener when a queued closure has run (`set_listener`): that is how
`core.grad_sync` knows a deferred weight gradient is final.
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Callable, Hashable, Iterator, Optional, Sequence

import torch

_pending: dict = {}
_capturing: Optional[list] = None
_capture_key: Hashable = None
_queued: dict = {}                      # id(param) -> closures queued for it
_listener: Optional[Callable[[Sequence[torch.Tensor]], None]] = None


def schedule(weight_grad_fn: Callable[[], None], params: Sequence[torch.Tensor]) -> None:
    """Run `weight_grad_fn` now, or queue it when a B action is capturing; `params` are the
    parameters whose `.grad` it writes (`core.grad_sync` waits for them)."""
    if _capturing is None:
        weight_grad_fn()
    else:
        _capturing.append((weight_grad_fn, params))
        for p in params:
            _queued[id(p)] = _queued.get(id(p), 0) + 1


def queued(param: torch.Tensor) -> int:
    """How many queued closures will still write `param.grad`."""
    return _queued.get(id(param), 0)


def set_listener(listener: Optional[Callable[[Sequence[torch.Tensor]], None]]) -> None:
    """Call `listener(params)` after each queued closure ran (None: nobody listens)."""
    global _listener
    _listener = listener


def remove_listener(listener: Callable[[Sequence[torch.Tensor]], None]) -> None:
    """Stop calling `listener` if it is the one set."""
    if _listener == listener:
        set_listener(None)


def begin(key: Hashable) -> None:
    """Start queueing closures under `key` (for runtimes that cannot wrap backward in `capture`)."""
    global _capturing, _capture_key
    assert _capturing is None, "capture blocks do not nest"
    assert key not in _pending, f"weight gradients for {key} are already queued"
    _capturing, _capture_key = [], key


def end() -> Hashable:
    """Stop queueing; returns the key the closures were queued under."""
    global _capturing, _capture_key
    assert _capturing is not None, "end() without begin()"
    key, _pending[_capture_key], _capturing, _capture_key = _capture_key, _capturing, None, None
    return key


@contextmanager
def capture(key: Hashable) -> Iterator[None]:
    """Queue every weight-gradient closure scheduled inside the block under `key`."""
    begin(key)
    try:
        yield
    finally:
        end()


def run(key: Hashable) -> int:
    """Compute the weight gradients queued under `key`; returns how many closures ran.

    Closures run with grad mode off, as they would inside autograd's backward."""
    fns = _pending.pop(key)
    with torch.no_grad():
        for fn, params in fns:
            fn()
            for p in params:
                _queued[id(p)] -= 1
            if _listener is not None:
                _listener(params)
    return len(fns)


def held_tensors(key: Hashable) -> Iterator[torch.Tensor]:
    """Tensors the closures queued under `key` keep alive until its W: the free variables of each closure,
    and tensors inside tuples / lists among them (e.g. the layer's input and its output gradients)."""
    for fn, _ in _pending.get(key, ()):
        for cell in getattr(fn, "__closure__", None) or ():
            try:
                value = cell.cell_contents
            except ValueError:           # an empty cell
                continue
            for item in value if isinstance(value, (tuple, list)) else (value,):
                if isinstance(item, torch.Tensor):
                    yield item


def pending_keys() -> list:
    return list(_pending)


def assert_empty() -> None:
    assert not _pending, f"weight gradients still queued at step end: {sorted(map(str, _pending))}"


def clear() -> None:
    """Drop everything queued (after a failed step)."""
    global _capturing, _capture_key
    _pending.clear()
    _queued.clear()
    _capturing = _capture_key = None

"""Repeated meta operations answered from a cache of their output shapes: the dry run's step, several times faster.

torch computes the shapes of most operations on meta tensors with Python reference implementations (0.1 to 0.5
ms an operation), and a step repeats the same few hundred operations on the same shapes for every microbatch of
every action. `MetaOpCache` (a dispatch mode, below autograd, so the graph and every backward formula are
torch's own) runs each distinct (operation, argument shapes, strides, dtypes, other arguments) once and
answers the repeats: a new meta tensor of the recorded shape and strides for a functional operation, the
argument itself for an in-place or `out=` one whose shape it did not change. Views, collectives and anything
whose result is not a meta tensor run as they are.
"""
from __future__ import annotations

from typing import Any, Optional

import torch
from torch.utils._python_dispatch import TorchDispatchMode

_Meta = tuple   # (shape, stride, dtype, storage offset) of a tensor


def _meta_of(t: torch.Tensor) -> _Meta:
    return t.shape, t.stride(), t.dtype, t.storage_offset()


def _key(value: Any) -> Any:
    """A hashable stand-in for an argument; raises TypeError for one that has none (a process group)."""
    kind = type(value)
    if kind is torch.Tensor or kind is torch.nn.Parameter:
        if not value.is_meta:
            raise TypeError("a real tensor")
        return value.shape, value.stride(), value.dtype, value.storage_offset()
    if kind is tuple or kind is list:
        return tuple(_key(v) for v in value)
    if isinstance(value, torch.Tensor):
        raise TypeError("a subclass with its own dispatch (DTensor)")
    hash(value)
    return value


def _writes(func) -> Optional[list[int]]:
    """The arguments an aten operation writes (none: functional); None for one the cache leaves alone (a view,
    or not aten: a collective)."""
    schema = func._schema
    if func.namespace != "aten" or any(a.alias_info is not None and not a.alias_info.is_write
                                       for a in schema.arguments):
        return None
    return [i for i, a in enumerate(schema.arguments) if a.alias_info is not None and a.alias_info.is_write]


class MetaOpCache(TorchDispatchMode):
    """While active, repeated aten operations on meta tensors take their outputs' shapes from a cache."""

    def __init__(self) -> None:
        super().__init__()
        self._results: dict[tuple, tuple] = {}
        self._writes: dict[Any, Optional[list[int]]] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func not in self._writes:
            self._writes[func] = _writes(func)
        writes = self._writes[func]
        if writes is None:
            return func(*args, **kwargs)
        try:
            key = (func, _key(args), _key(tuple(sorted(kwargs.items()))) if kwargs else ())
        except TypeError:
            return func(*args, **kwargs)
        cached = self._results.get(key)
        if cached is not None:
            return self._answer(cached, func._schema, writes, args, kwargs)
        out = func(*args, **kwargs)
        self._record(key, out, func._schema, writes, args, kwargs)
        return out

    def _record(self, key: tuple, out: Any, schema, writes: list[int], args: tuple, kwargs: dict) -> None:
        outs = out if isinstance(out, (tuple, list)) else (out,)
        if not all(isinstance(t, torch.Tensor) and t.is_meta for t in outs):
            return
        if writes:      # in place or out=: cached when it returns the written arguments unchanged in shape
            written = [_argument(schema, i, args, kwargs) for i in writes]
            if len(outs) == len(written) and all(o is w for o, w in zip(outs, written)) and \
                    all(_meta_of(w) == m for w, m in zip(written, _written_meta(key, schema, writes))):
                self._results[key] = ("written", isinstance(out, (tuple, list)))
            return
        self._results[key] = ("new", type(out) if isinstance(out, (tuple, list)) else None,
                              [_meta_of(t) for t in outs])

    def _answer(self, cached: tuple, schema, writes: list[int], args: tuple, kwargs: dict) -> Any:
        if cached[0] == "written":
            written = [_argument(schema, i, args, kwargs) for i in writes]
            return tuple(written) if cached[1] else written[0]
        _, many, metas = cached
        outs = [torch.empty_strided(shape, stride, dtype=dtype, device="meta") for shape, stride, dtype, _ in metas]
        return many(outs) if many is not None else outs[0]


def _argument(schema, index: int, args: tuple, kwargs: dict) -> Optional[torch.Tensor]:
    arg = schema.arguments[index]
    return args[index] if index < len(args) and not arg.kwarg_only else kwargs.get(arg.name)


def _written_meta(key: tuple, schema, writes: list[int]) -> list[_Meta]:
    """The written arguments' shapes before the operation, from its cache key."""
    _, args, kwargs = key
    named = dict(kwargs)
    return [args[i] if i < len(args) and not schema.arguments[i].kwarg_only else named[schema.arguments[i].name]
            for i in writes]

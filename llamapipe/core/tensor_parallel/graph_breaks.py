"""Functions that stay outside torch.compile regions: the graph breaks of a compiled model.

The parallel linear layers must run eagerly under `--compile`: their backward hands the weight-gradient GEMM
to the zero-bubble `WeightGradStore` (arXiv 2401.10241), which a compiled backward cannot do, and the
tensor-parallel collectives on gloo do not trace. A function decorated with `@eager` is called through a
registry; `enable_graph_breaks()` swaps every registered function for its `torch.compiler.disable` version,
so TorchDynamo stops its graph at the call, runs the function (and all it calls) eagerly, and resumes a new
graph after it. Until then the registry holds the plain functions: eager runs pay one dictionary lookup per
call and never import TorchDynamo (about 0.7 s per process).
"""
from __future__ import annotations

import functools
from typing import Callable, TypeVar

import torch

Fn = TypeVar("Fn", bound=Callable)

_EAGER: dict[str, Callable] = {}      # qualified name -> the function a call runs (plain or compiler-disabled)
_WRAPPERS: list[Callable] = []         # the `call` wrappers handed out by `eager`


def eager(fn: Fn) -> Fn:
    """Mark `fn` to run outside compiled regions once `enable_graph_breaks()` ran."""
    key = f"{fn.__module__}.{fn.__qualname__}"
    assert key not in _EAGER, f"{key} is registered twice"
    _EAGER[key] = fn

    @functools.wraps(fn)
    def call(*args, **kwargs):
        return _EAGER[key](*args, **kwargs)
    _WRAPPERS.append(call)
    return call  # type: ignore[return-value]


def enable_graph_breaks() -> None:
    """Make every `@eager` function a graph break (idempotent; imports TorchDynamo).

    TorchDynamo stops at a call to a skipped wrapper and runs it as plain Python (its frame is skipped too,
    so it is not compiled on its own); the wrapper then calls the compiler-disabled function, under which
    nothing is compiled, however deep."""
    from torch._dynamo.decorators import skip
    for key, fn in _EAGER.items():
        if not getattr(fn, "_torchdynamo_disable", False):
            _EAGER[key] = torch.compiler.disable(fn, reason="runs eagerly: deferred weight gradients, collectives")
    for call in _WRAPPERS:
        skip(call)

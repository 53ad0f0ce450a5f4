"""Autograd communication ops for tensor and sequence parallelism (Megatron-LM, arXiv 1909.08053, 2205.05198).

Each op is a pair of collectives: what the forward does and what its backward must do so that gradients
are exact. Tensor-parallel ops act on the last dimension; sequence-parallel ops act on dimension 0 (the
sequence axis of the (s, b, h) layout). Every op is the identity when `tp_group` is None or has one rank,
so a single-process model never touches torch.distributed.
"""
from __future__ import annotations

from typing import Any, Optional

import torch
import torch.distributed as dist


def _tp_size(tp_group: Optional[Any]) -> int:
    return 1 if tp_group is None else dist.get_world_size(tp_group)


def all_reduce(x: torch.Tensor, tp_group: Optional[Any]) -> torch.Tensor:
    """Sum over TP ranks, in place."""
    if _tp_size(tp_group) > 1:
        dist.all_reduce(x, group=tp_group)
    return x


def all_gather(x: torch.Tensor, tp_group: Optional[Any], dim: int) -> torch.Tensor:
    """Concatenate every TP rank's `x` along `dim` in tp_rank order."""
    tp_size = _tp_size(tp_group)
    if tp_size == 1:
        return x
    x = x.contiguous()
    parts = [torch.empty_like(x) for _ in range(tp_size)]
    dist.all_gather(parts, x, group=tp_group)
    return torch.cat(parts, dim=dim)


def split(x: torch.Tensor, tp_group: Optional[Any], dim: int) -> torch.Tensor:
    """This rank's contiguous slice of `x` along `dim`."""
    tp_size = _tp_size(tp_group)
    if tp_size == 1:
        return x
    assert x.shape[dim] % tp_size == 0, f"dim {dim} of size {x.shape[dim]} does not split over {tp_size} ranks"
    return x.chunk(tp_size, dim=dim)[dist.get_rank(tp_group)].contiguous()


def reduce_scatter(x: torch.Tensor, tp_group: Optional[Any]) -> torch.Tensor:
    """Sum over TP ranks, then keep this rank's slice along dimension 0."""
    tp_size = _tp_size(tp_group)
    if tp_size == 1:
        return x
    x = x.contiguous()
    if dist.get_backend(tp_group) == "gloo":  # gloo has no reduce_scatter
        return split(all_reduce(x.clone(), tp_group), tp_group, 0)
    out = x.new_empty((x.shape[0] // tp_size,) + tuple(x.shape[1:]))
    dist.reduce_scatter_single(out, x, group=tp_group)
    return out


class _ReduceFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, tp_group: Any) -> torch.Tensor:
        return all_reduce(x.clone(), tp_group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None


class _ScatterToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, tp_group: Any) -> torch.Tensor:
        ctx.tp_group = tp_group
        return split(x, tp_group, -1)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return all_gather(grad, ctx.tp_group, -1), None


class _GatherFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, tp_group: Any) -> torch.Tensor:
        ctx.tp_group = tp_group
        return all_gather(x, tp_group, -1)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return split(grad, ctx.tp_group, -1), None


class _GatherFromSP(torch.autograd.Function):
    """All-gather along the sequence; the backward reduce-scatters because the consumer is TP-partitioned."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, tp_group: Any) -> torch.Tensor:
        ctx.tp_group = tp_group
        return all_gather(x, tp_group, 0)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return reduce_scatter(grad, ctx.tp_group), None


class _ReduceScatterToSP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, tp_group: Any) -> torch.Tensor:
        ctx.tp_group = tp_group
        return reduce_scatter(x, tp_group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return all_gather(grad, ctx.tp_group, 0), None


def reduce_from_tensor_model_parallel_region(x: torch.Tensor, tp_group: Optional[Any]) -> torch.Tensor:
    """Forward all-reduce, backward identity (output of a row-parallel layer)."""
    return x if _tp_size(tp_group) == 1 else _ReduceFromTP.apply(x, tp_group)


def scatter_to_tensor_model_parallel_region(x: torch.Tensor, tp_group: Optional[Any]) -> torch.Tensor:
    """Forward split of the last dimension, backward all-gather."""
    return x if _tp_size(tp_group) == 1 else _ScatterToTP.apply(x, tp_group)


def gather_from_tensor_model_parallel_region(x: torch.Tensor, tp_group: Optional[Any]) -> torch.Tensor:
    """Forward all-gather of the last dimension, backward split."""
    return x if _tp_size(tp_group) == 1 else _GatherFromTP.apply(x, tp_group)


def gather_from_sequence_parallel_region(x: torch.Tensor, tp_group: Optional[Any]) -> torch.Tensor:
    """Forward all-gather of the sequence (dim 0), backward reduce-scatter."""
    return x if _tp_size(tp_group) == 1 else _GatherFromSP.apply(x, tp_group)


def reduce_scatter_to_sequence_parallel_region(x: torch.Tensor, tp_group: Optional[Any]) -> torch.Tensor:
    """Forward reduce-scatter along the sequence (dim 0), backward all-gather."""
    return x if _tp_size(tp_group) == 1 else _ReduceScatterToSP.apply(x, tp_group)

"""Tensor-parallel layers (Megatron-LM, arXiv 1909.08053) with sequence parallelism (arXiv 2205.05198).

`ColumnParallelLinear` splits the output features over TP ranks, `RowParallelLinear` the input
features, `VocabParallelEmbedding` the vocabulary rows. LLaMA has no biases; a column-parallel layer may
have one (`bias=True`, Qwen2's q/k/v): it is split like the output rows (partition_dim 0), added to this
rank's output slice by plain autograd, so its gradient (a sum over tokens) is computed in B, never deferred to
W, like the norm weights'. Under sequence parallelism the column output is whole in the sequence, so the bias
gradient is complete on each rank and needs no sequence-parallel all-reduce.
Every linear product goes through ONE autograd function, `LinearWithDeferredWeightGrad`, whose backward
computes the input gradient and hands the weight-gradient GEMM to the store its forward ran under
(`weight_grad_store.current`), so the zero-bubble schedules (arXiv 2401.10241) can run it later. Under
`--compile` every linear call is a graph break (`graph_breaks.eager`): it runs eagerly between compiled regions.
Parameters carry Megatron's attributes (`tensor_model_parallel`, `partition_dim`, and `vocab_padded` /
`sequence_parallel` where they apply; `per_head` on a replicated weight applied to each of a rank's heads); a
shard is a contiguous slice of the logical tensor along `partition_dim` in tp_rank order.
"""
from __future__ import annotations

from typing import Any, Iterable, Optional, Sequence, Union

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from llamapipe.core.tensor_parallel import weight_grad_store
from llamapipe.core.tensor_parallel import mappings
from llamapipe.core.tensor_parallel.graph_breaks import eager

# How a linear layer's input relates to the TP group (decides the input-gradient collective).
INPUT_PARALLEL = "parallel"   # already split over TP (row-parallel): no collective
INPUT_COPY = "copy"           # replicated over TP: all-reduce the input gradient
INPUT_GATHER = "gather"       # sequence-parallel: all-gather dim 0, reduce-scatter the input gradient


def tp_size_rank(tp_group: Optional[Any]) -> tuple[int, int]:
    if tp_group is None:
        return 1, 0
    return dist.get_world_size(tp_group), dist.get_rank(tp_group)


def set_tensor_model_parallel_attributes(param: nn.Parameter, partition_dim: int, **extra: bool) -> None:
    """Megatron's parameter attributes; partition_dim -1 means replicated over TP."""
    param.tensor_model_parallel = partition_dim >= 0
    param.partition_dim = partition_dim
    for name, value in extra.items():
        setattr(param, name, value)


class LinearWithDeferredWeightGrad(torch.autograd.Function):
    """y_i = x @ w_i^T for several weights sharing one input; weight gradients go through the store.

    Sharing the input lets q/k/v (or gate/up) pay one gather and one input-gradient collective.
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, tp_group: Any, input_mode: str, *weights: torch.Tensor):
        ctx.tp_group, ctx.input_mode, ctx.weights = tp_group, input_mode, weights
        ctx.store = weight_grad_store.current()     # backward may run on another thread: remember it here
        ctx.save_for_backward(x)
        total = mappings.all_gather(x, tp_group, 0) if input_mode == INPUT_GATHER else x
        return tuple(torch.matmul(total, w.t()) for w in weights)

    @staticmethod
    def backward(ctx, *grads: torch.Tensor):
        (x,) = ctx.saved_tensors
        weights, tp_group, mode = ctx.weights, ctx.tp_group, ctx.input_mode
        # Megatron re-gathers instead of keeping the gathered input alive between F and B; a weight gradient
        # deferred to W keeps the sequence shard and gathers there, not the tp-times larger gathered input.
        deferred = ctx.store is not None and ctx.store.capturing
        total = mappings.all_gather(x, tp_group, 0) if mode == INPUT_GATHER and not deferred else x
        gather_at_w = mode == INPUT_GATHER and deferred
        grad_input = torch.matmul(grads[0], weights[0])  # (s, b, in)
        flat_grad_input = grad_input.view(-1, grad_input.shape[-1])
        for g, w in zip(grads[1:], weights[1:]):
            flat_grad_input.addmm_(g.reshape(-1, g.shape[-1]), w)  # the sum happens inside the GEMM
        if mode == INPUT_COPY:
            mappings.all_reduce(grad_input, tp_group)
        elif mode == INPUT_GATHER:
            grad_input = mappings.reduce_scatter(grad_input, tp_group)

        def weight_grad() -> None:
            full = mappings.all_gather(total, tp_group, 0) if gather_at_w else total
            flat_input = full.reshape(-1, full.shape[-1])  # (s*b, in)
            for g, w in zip(grads, weights):
                flat_grad = g.reshape(-1, g.shape[-1]).t()  # (out, s*b)
                if w.grad is None:
                    w.grad = torch.matmul(flat_grad, flat_input).to(grad_dtype(w))  # (out, in)
                elif w.grad.dtype == flat_input.dtype:
                    w.grad.addmm_(flat_grad, flat_input)
                else:
                    w.grad.add_(torch.matmul(flat_grad, flat_input))

        weight_grad_store.defer(ctx.store, weight_grad, weights)
        return (grad_input, None, None) + (None,) * len(weights)


def grad_dtype(param: torch.Tensor) -> torch.dtype:
    """The dtype `param.grad` accumulates in: fp32 for half-precision params once
    `core.distributed.accumulate_grads_in_fp32` ran, else the param's own dtype."""
    return getattr(param, "grad_dtype", None) or param.dtype


@eager  # under --compile: a graph break, so the weight gradient stays deferred to W
def parallel_linear(x: torch.Tensor, weights: Sequence[torch.Tensor], tp_group: Optional[Any],
                    input_mode: str) -> tuple[torch.Tensor, ...]:
    """Apply several weights to one input through the deferred-weight-gradient function."""
    if tp_size_rank(tp_group)[0] == 1:
        input_mode = INPUT_PARALLEL
    return LinearWithDeferredWeightGrad.apply(x, tp_group, input_mode, *weights)


class ColumnParallelLinear(nn.Module):
    """y = x A^T with A split along its output rows; the output stays split over TP."""

    def __init__(self, in_features: int, out_features: int, tp_group: Optional[Any] = None, *,
                 sequence_parallel: bool = False, params_dtype: torch.dtype = torch.float32,
                 bias: bool = False) -> None:
        super().__init__()
        tp_size, _ = tp_size_rank(tp_group)
        assert out_features % tp_size == 0, f"{out_features} output features do not split over {tp_size} ranks"
        self.tp_group = tp_group
        self.input_mode = INPUT_GATHER if sequence_parallel else INPUT_COPY
        self.weight = nn.Parameter(torch.empty(out_features // tp_size, in_features, dtype=params_dtype))
        set_tensor_model_parallel_attributes(self.weight, 0)
        self.bias: Optional[nn.Parameter] = None
        if bias:
            self.bias = nn.Parameter(torch.zeros(out_features // tp_size, dtype=params_dtype))
            set_tensor_model_parallel_attributes(self.bias, 0)

    @eager
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: (s, b, in) or (s/tp, b, in) with sequence parallel -> (s, b, out/tp)
        return add_bias(parallel_linear(x, [self.weight], self.tp_group, self.input_mode)[0], self.bias)


def add_bias(y: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
    """y + bias when there is one: autograd computes the bias gradient in B (see the module docstring)."""
    return y if bias is None else y + bias


class RowParallelLinear(nn.Module):
    """y = x A^T with A split along its input columns; partial outputs are summed over TP."""

    def __init__(self, in_features: int, out_features: int, tp_group: Optional[Any] = None, *,
                 sequence_parallel: bool = False, params_dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        tp_size, _ = tp_size_rank(tp_group)
        assert in_features % tp_size == 0, f"{in_features} input features do not split over {tp_size} ranks"
        self.tp_group, self.sequence_parallel = tp_group, sequence_parallel
        self.weight = nn.Parameter(torch.empty(out_features, in_features // tp_size, dtype=params_dtype))
        set_tensor_model_parallel_attributes(self.weight, 1)

    @eager  # the product and its reduction form one graph break under --compile
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: (s, b, in/tp) -> (s, b, out), or (s/tp, b, out) with sequence parallel
        partial = LinearWithDeferredWeightGrad.apply(x, self.tp_group, INPUT_PARALLEL, self.weight)[0]
        if self.sequence_parallel:
            return mappings.reduce_scatter_to_sequence_parallel_region(partial, self.tp_group)
        return mappings.reduce_from_tensor_model_parallel_region(partial, self.tp_group)


class VocabParallelEmbedding(nn.Module):
    """Embedding with the (padded) vocabulary rows split over TP; ids outside the shard give zeros."""

    def __init__(self, padded_vocab_size: int, hidden_size: int, tp_group: Optional[Any] = None, *,
                 sequence_parallel: bool = False, params_dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        tp_size, tp_rank = tp_size_rank(tp_group)
        assert padded_vocab_size % tp_size == 0, f"vocabulary {padded_vocab_size} does not split over {tp_size}"
        rows = padded_vocab_size // tp_size
        self.vocab_start, self.vocab_end = tp_rank * rows, (tp_rank + 1) * rows
        self.tp_group, self.tp_size, self.sequence_parallel = tp_group, tp_size, sequence_parallel
        self.weight = nn.Parameter(torch.empty(rows, hidden_size, dtype=params_dtype))
        set_tensor_model_parallel_attributes(self.weight, 0, vocab_padded=True)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        ids = input_ids.t()  # (s, b): the model runs sequence-first
        if self.tp_size == 1:
            return F.embedding(ids, self.weight)  # (s, b, h)
        outside = (ids < self.vocab_start) | (ids >= self.vocab_end)
        local_ids = (ids - self.vocab_start).masked_fill(outside, 0)
        partial = F.embedding(local_ids, self.weight).masked_fill(outside.unsqueeze(-1), 0.0)  # (s, b, h)
        if self.sequence_parallel:
            return mappings.reduce_scatter_to_sequence_parallel_region(partial, self.tp_group)  # (s/tp, b, h)
        return mappings.reduce_from_tensor_model_parallel_region(partial, self.tp_group)


# The attributes of a replicated parameter whose gradient each TP rank holds only part of, summed over TP at the
# step's end: a norm on this rank's sequence shard, or a weight applied to each of this rank's heads (q/k norms).
TP_PARTIAL_GRADS = ("sequence_parallel", "per_head")


def grad_partial_over_tp(param: torch.Tensor) -> bool:
    return any(getattr(param, attr, False) for attr in TP_PARTIAL_GRADS)


def allreduce_sequence_parallel_grads(modules: Union[nn.Module, Iterable[nn.Module]], tp_group: Optional[Any]) -> None:
    """Sum over TP the grads of replicated parameters each TP rank holds part of (`TP_PARTIAL_GRADS`: norms on
    sequence shards, per-head norms), in one coalesced all-reduce."""
    if tp_size_rank(tp_group)[0] == 1:
        return
    modules = [modules] if isinstance(modules, nn.Module) else list(modules)
    params = {id(p): p for m in modules for p in m.parameters()
              if grad_partial_over_tp(p) and p.grad is not None}
    all_reduce_coalesced([p.grad for p in params.values()], tp_group)


def all_reduce_coalesced(tensors: list[torch.Tensor], group: Any) -> None:
    """Sum `tensors` over `group` in place with one all-reduce of their concatenation."""
    if not tensors:
        return
    flat = _flatten_dense_tensors(tensors)
    dist.all_reduce(flat, group=group)
    for tensor, reduced in zip(tensors, _unflatten_dense_tensors(flat, tensors)):
        tensor.copy_(reduced)


def shard_logical_tensor(full: torch.Tensor, param: torch.Tensor, tp_rank: int, tp_size: int) -> torch.Tensor:
    """This rank's slice of a logical tensor; vocab-padded tensors are zero-padded or cut to the layout's rows."""
    if getattr(param, "vocab_padded", False):
        rows = param.shape[0] * tp_size if param.tensor_model_parallel else param.shape[0]
        if full.shape[0] < rows:
            full = torch.cat([full, full.new_zeros((rows - full.shape[0],) + tuple(full.shape[1:]))])
        full = full[:rows]
    if not getattr(param, "tensor_model_parallel", False):
        return full
    size = param.shape[param.partition_dim]
    return full.narrow(param.partition_dim, tp_rank * size, size)


def gather_logical_tensor(shard: torch.Tensor, param: torch.Tensor, tp_group: Optional[Any]) -> torch.Tensor:
    """Inverse of `shard_logical_tensor` (without the padding change): all-gather along partition_dim."""
    if not getattr(param, "tensor_model_parallel", False):
        return shard
    return mappings.all_gather(shard, tp_group, param.partition_dim)

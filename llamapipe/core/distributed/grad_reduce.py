"""Data-parallel gradient reduction at the end of a step (after the last W), Megatron's finalize_model_grads.

Order: (1) sum over TP the grads of replicated params that TP ranks hold parts of (sequence-parallel and
per-head norms); (2) count the step's loss tokens (known on the last pipeline stage) and sum that count over
DP; (3) sum every grad over DP in flat buckets (one all-reduce per bucket, optionally all launched before any
is awaited) and divide by the token count; (4) sum the two copies of a tied embedding that the first and the
last stage hold (core/distributed/tied_embeddings.py).
The runtime back-propagates per-microbatch loss SUMS, so after this each grad is exactly the gradient of
the single-rank token-averaged loss. Half-precision grads are reduced in fp32. Bucketing only groups
elements; each element's sum is the same for any bucket size.
"""
from __future__ import annotations

from typing import Any, Callable, Iterable, Optional

import torch
import torch.distributed as dist

from llamapipe.core.distributed.fsdp import is_sharded, local_tensor, reduce_scatter_grads
from llamapipe.core.distributed.tied_embeddings import tied_params
from llamapipe.core.parallel_state import ParallelState
from llamapipe.core.tensor_parallel.layers import allreduce_sequence_parallel_grads, grad_dtype

DEFAULT_BUCKET_SIZE = 25_000_000  # elements per DP all-reduce bucket (ParallelConfig.ddp_bucket_size)


def group_size(group: Any) -> int:
    """Size of a process group; 1 for None (single process)."""
    if group is None or not dist.is_initialized():
        return 1
    return dist.get_world_size(group)


def all_reduce_over(tensor: torch.Tensor, groups: Iterable[Any], op: Any = dist.ReduceOp.SUM) -> torch.Tensor:
    """All-reduce `tensor` in place over each group in turn, skipping None and size-1 groups."""
    for group in groups:
        if group_size(group) > 1:
            dist.all_reduce(tensor, op=op, group=group)
    return tensor


def accumulate_grads_in_fp32(model_chunks: list[torch.nn.Module]) -> bool:
    """Make bf16/fp16 parameters accumulate `.grad` in fp32 across microbatches (Megatron's fp32 main_grad).

    Uses the tensor attribute `grad_dtype` (torch >= 2.10); returns False where torch lacks it, and the
    gradients then accumulate in the parameters' own precision.
    """
    params = [p for chunk in model_chunks for p in chunk.parameters() if p.dtype in (torch.bfloat16, torch.float16)]
    if not params:
        return True
    if not hasattr(torch._C.TensorBase, "grad_dtype"):
        return False
    for p in params:
        p.grad_dtype = torch.float32
    return True


def _model_params(model_chunks: list[torch.nn.Module]) -> list[torch.nn.Parameter]:
    params = [p for chunk in model_chunks for p in chunk.parameters() if p.requires_grad]
    for p in params:
        if p.grad is None:  # every DP rank must build identical buckets, so absent grads count as zeros
            p.grad = torch.zeros_like(p, dtype=grad_dtype(p))
    return params


def bucket_groups(grads: list[torch.Tensor], bucket_size: int,
                  dtype_of: Callable[[torch.Tensor], torch.dtype] = lambda t: t.dtype,
                  numel_of: Callable[[torch.Tensor], int] = lambda t: t.numel()) -> list[list[torch.Tensor]]:
    """Group grads (reverse order, as backward produces them) into buckets of >= bucket_size elements, one
    dtype per bucket (`dtype_of`: e.g. a parameter's grad dtype, to bucket parameters before they have grads;
    `numel_of`: the planner buckets plain element counts, core/comm_memory.py)."""
    buckets: list[list[torch.Tensor]] = []
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for g in reversed(grads):
        current = by_dtype.setdefault(dtype_of(g), [])
        current.append(g)
        if sum(numel_of(t) for t in current) >= bucket_size:
            buckets.append(current)
            by_dtype[dtype_of(g)] = []
    buckets.extend(b for b in by_dtype.values() if b)
    return buckets


def all_reduce_bucketed(grads: list[torch.Tensor], group: Any, bucket_size: int = DEFAULT_BUCKET_SIZE,
                        divisor: Optional[float] = None, async_op: bool = False) -> None:
    """Sum `grads` over `group` in flat fp32-or-wider buckets, divide by `divisor`, write back in place.

    With `async_op` every bucket's all-reduce is launched before the first is awaited, so communication
    of one bucket overlaps the packing of the next; results are identical to the synchronous path.
    """
    if bucket_size <= 0:
        raise ValueError(f"the gradient bucket size {bucket_size} must be positive")
    reduce = group_size(group) > 1
    pending = []
    for bucket in bucket_groups(grads, bucket_size):
        dtype = torch.promote_types(bucket[0].dtype, torch.float32)
        flat = torch.cat([g.reshape(-1).to(dtype) for g in bucket])
        work = dist.all_reduce(flat, group=group, async_op=async_op) if reduce else None
        pending.append((bucket, flat, work))
        if not async_op:
            unpack_bucket(bucket, flat, work, divisor)
    if async_op:
        for bucket, flat, work in pending:
            unpack_bucket(bucket, flat, work, divisor)


def unpack_bucket(bucket: list[torch.Tensor], flat: torch.Tensor, work: Any, divisor: Optional[float]) -> None:
    if work is not None:
        work.wait()
    if divisor is not None:
        flat.div_(divisor)
    offset = 0
    for g in bucket:
        g.copy_(flat[offset:offset + g.numel()].view_as(g))
        offset += g.numel()


def global_num_tokens(num_tokens: Optional[torch.Tensor], parallel_state: ParallelState) -> Optional[float]:
    """The step's loss-token count summed over DP, taken from the last pipeline stage (None: no division).

    Only the last stage's `num_tokens` is read; other stages may pass None.
    """
    ps = parallel_state
    # [has_count, count]: non-last stages learn from the broadcast whether a count exists at all
    packed = torch.zeros(2, dtype=torch.float64)
    if ps.is_last_stage and num_tokens is not None:
        packed[0], packed[1] = 1.0, float(num_tokens.detach().double().sum().item())
    if group_size(ps.pp_group) > 1:
        dist.broadcast(packed, src=ps.pp_ranks[-1], group=ps.pp_group)
    if packed[0].item() == 0.0:
        return None
    all_reduce_over(packed[1:], [ps.dp_cp_group])
    total = packed[1].item()
    if total <= 0:
        raise ValueError("the global batch has no loss tokens (every loss_mask entry is 0), so the loss is undefined")
    return total


def finalize_model_grads(model_chunks: list[torch.nn.Module], parallel_state: ParallelState,
                         num_tokens: Optional[torch.Tensor], *, bucket_size: int = DEFAULT_BUCKET_SIZE,
                         overlap_grad_reduce: bool = False,
                         global_tokens: Optional[float] = None, grad_sync: Any = None) -> Optional[float]:
    """Reduce all grads of this rank's chunks over TP (sequence-parallel and per-head params) and DP; returns the
    token count.

    Collective over the TP, PP and DP groups of `parallel_state`; call once per step after the last W.
    `global_tokens`, when the caller already reduced the step's token count over PP and DP, is used as is;
    it is required when the loss is not on the last pipeline rank (ZB-V puts it on pp rank 0).
    `grad_sync` (a `core.grad_sync.GradSync` that already started some buckets during the backward)
    reduces the rest and divides; the sums are the same as without it (buckets are per chunk).
    """
    ps = parallel_state
    if is_sharded(model_chunks):
        return _finalize_sharded(model_chunks, ps, num_tokens, global_tokens, grad_sync)
    params = _model_params(model_chunks)
    if grad_sync is None:
        allreduce_sequence_parallel_grads(model_chunks, ps.tp_group)  # small norm grads: one coalesced all-reduce
    if global_tokens is None:
        total = global_num_tokens(num_tokens, ps)
    elif global_tokens <= 0:
        raise ValueError("the global batch has no loss tokens (every loss_mask entry is 0), so the loss is undefined")
    else:
        total = float(global_tokens)
    if grad_sync is not None:
        grad_sync.finish(total)
    elif total is not None or group_size(ps.dp_cp_group) > 1:  # dp=1 still divides in fp32, like dp>1
        all_reduce_bucketed([p.grad for p in params], ps.dp_cp_group, bucket_size, divisor=total,
                            async_op=overlap_grad_reduce)
    sum_tied_grads(model_chunks, ps)
    return total


def sum_tied_grads(model_chunks: list[torch.nn.Module], ps: ParallelState) -> None:
    """Give both copies of a tied embedding the sum of their (DP-reduced) gradients (`tied_embeddings`, Megatron's
    _allreduce_embedding_grads): collective over the embedding group on the ranks that hold one copy, a local sum
    on a rank that holds both (the V placements), nothing elsewhere. Under ZeRO-2/3 on this rank's shards."""
    grads = [local_tensor(p.grad) for p in tied_params(model_chunks)]
    assert all(g is not None for g in grads), "a tied embedding copy has no gradient at the step's end"
    if len(grads) == 2:
        total = grads[0] + grads[1]
        for g in grads:
            g.copy_(total)
    elif grads:
        assert len(grads) == 1, f"{len(grads)} tied embedding copies on one rank"
        all_reduce_over(grads[0], [ps.embedding_group])


def _finalize_sharded(model_chunks: list[torch.nn.Module], ps: ParallelState, num_tokens: Optional[torch.Tensor],
                      global_tokens: Optional[float], grad_sync: Any) -> Optional[float]:
    """ZeRO-2/3 (`core.distributed.fsdp`): reduce-scatter instead of all-reduce, once, after the last W."""
    if global_tokens is not None and global_tokens <= 0:
        raise ValueError("the global batch has no loss tokens (every loss_mask entry is 0), so the loss is undefined")
    total = float(global_tokens) if global_tokens is not None else global_num_tokens(num_tokens, ps)
    if grad_sync is not None:
        grad_sync.end_step()
    reduce_scatter_grads(model_chunks, ps, total)
    sum_tied_grads(model_chunks, ps)
    return total


@torch.no_grad()
def tied_copies_equal(model_chunks: list[torch.nn.Module], ps: ParallelState) -> Optional[bool]:
    """Whether the two copies of a tied embedding are equal bit for bit, the same answer on every rank (None where
    no rank holds copies: untied, one stage, vocabulary parallelism). Compared locally on a rank holding both,
    after an all-gather over the embedding group otherwise; collective over the world."""
    copies = [local_tensor(p).detach().contiguous() for p in tied_params(model_chunks)]
    if len(copies) == 1:
        both = [torch.empty_like(copies[0]) for _ in range(2)]
        dist.all_gather(both, copies[0], group=ps.embedding_group)
        copies = both
    flags = torch.tensor([float(bool(copies)), float(bool(copies) and not torch.equal(*copies))])
    if dist.is_initialized():
        dist.all_reduce(flags, op=dist.ReduceOp.MAX)
    return None if flags[0].item() == 0 else flags[1].item() == 0

"""Causal attention over a sequence split across context-parallel ranks: ring (p2p) and all-gather.

Every CP rank holds its queries, keys and values in the load-balanced layout of sharding.py (global chunks r
and 2cp-1-r). The result on each rank is causal attention over the global sequence, restricted to its
queries, with exact gradients for q, k and v.

- `p2p`, ring attention (arXiv 2310.01889; Megatron-LM's default): K/V travel around the ring in cp steps,
  the next step's transfer in flight (batch_isend_irecv) while the current block is computed. Which query
  chunk attends which key chunk follows from the global chunk indices (`attention_blocks`): the rank's own
  block is causal, a block from a lower rank is attended by both local chunks, one from a higher rank only by
  the tail chunk: every rank computes the same amount at each step. The partial results are merged by
  log-sum-exp. The backward runs the ring again with the global output and log-sum-exp (as
  ring-flash-attention does) while dK/dV accumulators travel the ring with the blocks back to their owners.
  Saved for backward: q, k, v, out, lse, all O(s / cp).
- `allgather` (LLaMA 3, arXiv 2407.21783 section 3.3.2): one all-gather of K/V, then each local query chunk
  attends the keys up to its own end. The backward gathers K/V again (so only local tensors are saved) and
  reduce-scatters their gradients to the owners. Transient memory is O(s) for K/V.

Packed documents (Megatron's --reset-attention-mask, core/document_attention.py): given the document ids of the
whole sequence, each block is further restricted to (query, key) pairs of one document, read from the two
chunks' global positions; a block in which no pair shares a document is skipped, in the forward and the
backward, so short documents leave most of the ring's blocks uncomputed.

All-to-all (`a2a`, Ulysses) and `a2a+p2p` swap heads for the sequence first: ulysses.py. torch's own `context_parallel` API does not run here: see
docs/context_parallel.md for why.
"""
from __future__ import annotations

import math
from functools import partial
from typing import Any, Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F

from llamapipe.core.config import ConfigError
from llamapipe.core.context_parallel.blocks import (accumulators, attention_blocks, backward_blocks, docs_of,
                                                    forward_blocks, gather_kv)
from llamapipe.core.context_parallel.ulysses import (A2A_TYPES, SubGroup, UlyssesGroup, check_query_groups,
                                                     gather_heads, scatter_heads)
from llamapipe.core.context_parallel.sharding import chunk_ids, shard_sequence
from llamapipe.core.document_attention import document_attention
from llamapipe.core.pipeline_parallel.position import waiting
from llamapipe.core.tensor_parallel.graph_breaks import eager
from llamapipe.core.tensor_parallel.mappings import reduce_scatter

COMM_TYPES = ("p2p", "allgather", *A2A_TYPES)
class _Ring:
    """Non-blocking sends to the next CP rank and receives from the previous one (batch_isend_irecv)."""

    def __init__(self, group: Any) -> None:
        rank, size = _rank(group), _size(group)
        self.group = group.group if isinstance(group, SubGroup) else group
        global_rank = group.global_rank if isinstance(group, SubGroup) else partial(dist.get_global_rank, group)
        self.next = global_rank((rank + 1) % size)
        self.prev = global_rank((rank - 1) % size)

    def start(self, send: torch.Tensor, tag: int) -> tuple[torch.Tensor, list]:
        recv = torch.empty_like(send)
        ops = [dist.P2POp(dist.isend, send, self.next, self.group, tag),
               dist.P2POp(dist.irecv, recv, self.prev, self.group, tag)]
        return recv, dist.batch_isend_irecv(ops)


def _size(group: Any) -> int:
    return group.size() if isinstance(group, SubGroup) else dist.get_world_size(group)


def _rank(group: Any) -> int:
    return group.rank() if isinstance(group, SubGroup) else dist.get_rank(group)


def _wait(works: list, ring: _Ring, what: str = "keys/values") -> None:
    """Wait for a ring transfer; a hang report names the neighbours it waits on (`position.waiting`)."""
    with waiting(f"{what} in the context-parallel ring", (ring.prev, ring.next)):
        for work in works:
            work.wait()


def _save(ctx, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
          group: Any, scale: float, documents: Optional[torch.Tensor], *past: torch.Tensor) -> torch.Tensor:
    """End of every forward (ring, all-gather, and a Seq1F1B piece's, whose `past` are the earlier pieces' local
    keys/values): keep only the local tensors (O(s / cp)) and the document ids (b, s) when there are any."""
    out = out.to(q.dtype)
    ctx.save_for_backward(q, k, v, out, lse, *past)
    ctx.group, ctx.scale, ctx.documents = group, scale, documents
    return out


def _restore(ctx) -> tuple:
    """Start of every backward: the saved tensors (a piece's `past`: ctx.saved_tensors[5:]), the group, scale,
    CP size and rank, and a zero fp32 dq."""
    q, k, v, out, lse = ctx.saved_tensors[:5]
    group = ctx.group
    dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    return q, k, v, out, lse, group, ctx.scale, _size(group), _rank(group), dq


class _RingAttention(torch.autograd.Function):
    """p2p: K/V around the ring, forward and backward; dK/dV accumulators follow them home."""

    @staticmethod
    def forward(ctx, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: Any, scale: float,
                documents: Optional[torch.Tensor]) -> torch.Tensor:
        cp_size, cp_rank = _size(group), _rank(group)
        ring, chunk = _Ring(group), q.shape[2] // 2
        out, lse = accumulators(q)
        kv = torch.stack([k, v])  # (2, b, groups, s_local, d): one message per step
        for step in range(cp_size):
            if step + 1 < cp_size:
                kv_next, works = ring.start(kv, tag=0)
            src = (cp_rank - step) % cp_size
            blocks = attention_blocks(chunk_ids(cp_size, cp_rank), chunk_ids(cp_size, src))
            forward_blocks(q, kv[0], kv[1], blocks, chunk, scale, out, lse, docs_of(documents, cp_size, cp_rank, src))
            if step + 1 < cp_size:
                _wait(works, ring)
                kv = kv_next
        return _save(ctx, q, k, v, out, lse, group, scale, documents)

    @staticmethod
    def backward(ctx, dout: torch.Tensor):
        q, k, v, out, lse, group, scale, cp_size, cp_rank, dq = _restore(ctx)
        ring, chunk = _Ring(group), q.shape[2] // 2
        kv, dkv_in, dkv_works = torch.stack([k, v]), None, []
        for step in range(cp_size):
            if step + 1 < cp_size:
                kv_next, kv_works = ring.start(kv, tag=0)
            src = (cp_rank - step) % cp_size
            dkv = torch.zeros(kv.shape, dtype=torch.float32, device=q.device)  # grads of src's K/V
            blocks = attention_blocks(chunk_ids(cp_size, cp_rank), chunk_ids(cp_size, src))
            backward_blocks(dout, q, kv[0], kv[1], out, lse, blocks, chunk, scale, dq, dkv,
                             docs_of(ctx.documents, cp_size, cp_rank, src))
            if step > 0:    # what the ranks before me added to src's K/V gradients
                _wait(dkv_works, ring, "key/value gradients")
                dkv += dkv_in
            # onwards; after the last step, to src itself. Tags keep K/V and dK/dV apart on gloo; NCCL ignores
            # tags and matches by posting order, which is the same on every rank (K/V, then dK/dV, each step)
            dkv_in, dkv_works = ring.start(dkv, tag=1)
            if step + 1 < cp_size:
                _wait(kv_works, ring)
                kv = kv_next
        _wait(dkv_works, ring, "key/value gradients")
        return dq.to(q.dtype), dkv_in[0].to(k.dtype), dkv_in[1].to(v.dtype), None, None, None


class _AllGatherAttention(torch.autograd.Function):
    """allgather: every rank gathers K/V and attends its two query chunks to the keys before them."""

    @staticmethod
    def forward(ctx, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: Any, scale: float,
                documents: Optional[torch.Tensor]) -> torch.Tensor:
        cp_size, cp_rank = dist.get_world_size(group), dist.get_rank(group)
        kv = gather_kv(torch.stack([k, v]), group)  # (2, b, groups, s, d)
        out, lse = accumulators(q)
        blocks = attention_blocks(chunk_ids(cp_size, cp_rank), range(2 * cp_size))
        forward_blocks(q, kv[0], kv[1], blocks, q.shape[2] // 2, scale, out, lse,
                        docs_of(documents, cp_size, cp_rank, None))
        return _save(ctx, q, k, v, out, lse, group, scale, documents)

    @staticmethod
    def backward(ctx, dout: torch.Tensor):
        q, k, v, out, lse, group, scale, cp_size, cp_rank, dq = _restore(ctx)
        kv = gather_kv(torch.stack([k, v]), group)
        dkv = torch.zeros(kv.shape, dtype=torch.float32, device=q.device)
        blocks = attention_blocks(chunk_ids(cp_size, cp_rank), range(2 * cp_size))
        backward_blocks(dout, q, kv[0], kv[1], out, lse, blocks, q.shape[2] // 2, scale, dq, dkv,
                         docs_of(ctx.documents, cp_size, cp_rank, None))
        per_rank = torch.cat([shard_sequence(dkv, 3, cp_size, r) for r in range(cp_size)])  # (cp * 2, ...)
        mine = reduce_scatter(per_rank, group)   # (2, b, groups, s_local, d): my K/V's, summed over ranks
        return dq.to(q.dtype), mine[0].to(k.dtype), mine[1].to(v.dtype), None, None, None


@eager   # under --compile: collectives on gloo do not trace
def context_parallel_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cp_group: Optional[Any],
                               comm_type: str = "p2p", *, scale: Optional[float] = None,
                               document_ids: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Causal attention of the local queries over the global sequence split across `cp_group`, within the
    documents of `document_ids` (b, s) of the whole sequence when given.

    q: (b, heads, s_local, d), k/v: (b, groups, s_local, d) in the load-balanced layout (sharding.py) ->
    (b, heads, s_local, d). A group of one (or None) is plain causal SDPA (document_attention with documents)."""
    if comm_type not in COMM_TYPES:
        raise ConfigError(f"cp_comm_type {comm_type} is not one of {', '.join(COMM_TYPES)}", "cp_comm_type")
    assert q.shape[1] % k.shape[1] == 0, f"{q.shape[1]} query heads are not a multiple of {k.shape[1]} groups"
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    if isinstance(cp_group, UlyssesGroup):
        return _ulysses_attention(q, k, v, cp_group, scale, document_ids)
    if cp_group is None or _size(cp_group) == 1:
        if document_ids is not None:
            return document_attention(q, k, v, document_ids, scale=scale)
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale,
                                              enable_gqa=q.shape[1] != k.shape[1])
    assert q.shape[2] % 2 == 0, f"{q.shape[2]} local tokens do not form the two chunks of the balanced layout"
    function = _RingAttention if comm_type == "p2p" else _AllGatherAttention
    return function.apply(q, k, v, cp_group, scale, document_ids)


def _ulysses_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cp_group: UlyssesGroup, scale: float,
                       document_ids: Optional[torch.Tensor]) -> torch.Tensor:
    """a2a / a2a+p2p (ulysses.py): heads out and the sequence in over the a2a level, attention over the p2p level
    (one rank: the whole sequence, in global order), then back."""
    a2a, p2p = cp_group.levels()
    check_query_groups(k.shape[1], a2a)
    q, k, v = (scatter_heads(t, a2a) for t in (q, k, v))
    if p2p.size() == 1:
        out = context_parallel_attention(q, k, v, None, scale=scale, document_ids=document_ids)
    else:
        out = _RingAttention.apply(q, k, v, p2p, scale, document_ids)
    return gather_heads(out, a2a)

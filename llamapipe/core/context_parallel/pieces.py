"""All-gather context-parallel attention of one Seq1F1B piece (core/pipeline_parallel/seq_split.py,
model/piece_attention.py): the piece's own keys causally, as `allgather` attends a whole sequence (attention.py),
and every earlier piece's keys in full.

Under CP each piece of the sequence is cut into the 2 x cp chunks of the load-balanced layout (sharding.py), so a
rank holds its shard of every piece: its queries, keys and values of this piece, and (in the piece cache) its
keys and values of the earlier ones. The forward gathers the piece's keys/values over the CP group and attends
the local query chunks to the keys before them (`attention_blocks`); then it gathers each earlier piece's and
attends every local query to all of them (an earlier piece lies wholly before this one). The partial results
merge by log-sum-exp. The backward gathers again (only local tensors are saved) and reduce-scatters each
gathered piece's key/value gradients to the ranks that hold them: the earlier pieces' come back as the
gradients of the cache's leaves. Packed documents: `document_ids` (b, end of this piece) of the sequence so far.
"""
from __future__ import annotations

from typing import Any, Optional

import torch
import torch.distributed as dist

from llamapipe.core.context_parallel.attention import _restore, _save
from llamapipe.core.context_parallel.blocks import (accumulators, attention_blocks, backward_blocks, docs_of,
                                                    forward_blocks, gather_kv)
from llamapipe.core.context_parallel.sharding import chunk_ids, shard_sequence
from llamapipe.core.tensor_parallel.mappings import reduce_scatter


def _plan(documents: Optional[torch.Tensor], q: torch.Tensor, cp_size: int, cp_rank: int, past: tuple) -> tuple:
    """(the own piece's blocks, its document ids, the earlier pieces' (block, document ids) in order)."""
    s_local, piece = q.shape[2], q.shape[2] * cp_size
    own_blocks = attention_blocks(chunk_ids(cp_size, cp_rank), range(2 * cp_size))
    own_ids = None if documents is None else documents[:, documents.shape[1] - piece:]
    own_docs = docs_of(own_ids, cp_size, cp_rank, None)
    earlier, start = [], 0
    for pk in past[::2]:
        n = pk.shape[2] * cp_size
        docs = None if documents is None else (own_docs[0], documents[:, start:start + n])
        earlier.append(((0, s_local, 0, n, False), docs))     # in tokens (chunk 1): every query, every key
        start += n
    return own_blocks, own_docs, earlier


def _scatter_back(dkv: torch.Tensor, group: Any, cp_size: int) -> torch.Tensor:
    """Gathered key/value gradients (2, b, groups, n, d), summed over the ranks, as each rank's shard."""
    per_rank = torch.cat([shard_sequence(dkv, 3, cp_size, r) for r in range(cp_size)])
    return reduce_scatter(per_rank, group)


class _AllGatherPieceAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: Any, scale: float,
                documents: Optional[torch.Tensor], *past: torch.Tensor) -> torch.Tensor:
        cp_size, cp_rank = dist.get_world_size(group), dist.get_rank(group)
        own_blocks, own_docs, earlier = _plan(documents, q, cp_size, cp_rank, past)
        out, lse = accumulators(q)
        kv = gather_kv(torch.stack([k, v]), group)
        forward_blocks(q, kv[0], kv[1], own_blocks, q.shape[2] // 2, scale, out, lse, own_docs)
        for i, (block, docs) in enumerate(earlier):
            kv = gather_kv(torch.stack([past[2 * i], past[2 * i + 1]]), group)
            forward_blocks(q, kv[0], kv[1], [block], 1, scale, out, lse, docs)
        return _save(ctx, q, k, v, out, lse, group, scale, documents, *past)

    @staticmethod
    def backward(ctx, dout: torch.Tensor):
        q, k, v, out, lse, group, scale, cp_size, cp_rank, dq = _restore(ctx)
        past = ctx.saved_tensors[5:]
        own_blocks, own_docs, earlier = _plan(ctx.documents, q, cp_size, cp_rank, tuple(past))
        grads = []
        for i, (block, docs) in enumerate(earlier):
            kv = gather_kv(torch.stack([past[2 * i], past[2 * i + 1]]), group)
            dkv = torch.zeros(kv.shape, dtype=torch.float32, device=q.device)
            backward_blocks(dout, q, kv[0], kv[1], out, lse, [block], 1, scale, dq, dkv, docs)
            mine = _scatter_back(dkv, group, cp_size)
            grads += [mine[0].to(past[2 * i].dtype), mine[1].to(past[2 * i + 1].dtype)]
        kv = gather_kv(torch.stack([k, v]), group)
        dkv = torch.zeros(kv.shape, dtype=torch.float32, device=q.device)
        backward_blocks(dout, q, kv[0], kv[1], out, lse, own_blocks, q.shape[2] // 2, scale, dq, dkv, own_docs)
        mine = _scatter_back(dkv, group, cp_size)
        return (dq.to(q.dtype), mine[0].to(k.dtype), mine[1].to(v.dtype), None, None, None, *grads)


def allgather_piece_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, past_k: list, past_v: list,
                              group: Any, scale: float, document_ids: Optional[torch.Tensor] = None) -> torch.Tensor:
    """q: (b, heads, s_local, d), k/v: (b, groups, s_local, d) of this rank's shard of the piece; past_k/past_v:
    this rank's shards of the earlier pieces (b, groups, s_i / cp, d) -> (b, heads, s_local, d)."""
    pairs = [t for kv in zip(past_k, past_v) for t in kv]
    return _AllGatherPieceAttention.apply(q, k, v, group, scale, document_ids, *pairs)

"""Ring (p2p) context-parallel attention of one Seq1F1B piece (core/pipeline_parallel/seq_split.py,
model/piece_attention.py): the piece's own keys causally, as the ring attends a whole sequence (attention.py), and
every earlier piece's keys in full.

Under CP each piece is cut into the 2 x cp chunks of the load-balanced layout (sharding.py), so a rank holds its
shard of every piece: its queries, keys and values of this piece and (in the piece cache) its keys and values of
the earlier ones. All of them travel the ring together, one message per step: this rank's shard of the piece
followed by its shards of the earlier pieces, concatenated along the sequence (every rank's message has the same
length). At step t the block from rank src = rank - t is attended as the ring attends it: the piece's own part
by the global chunk indices (`attention_blocks`: causal on the diagonal), the earlier pieces' part by every
local query (an earlier piece lies wholly before this one). The partial results merge by log-sum-exp. The
backward runs the ring again with the merged output and log-sum-exp, while the key/value gradient accumulators
(as long as the message) travel with the blocks back to their holders: the earlier pieces' parts come back as
the gradients of the cache's leaves (PieceKVCache adds them to its accumulators). The waits are those of the
whole-sequence ring (`_wait`), so a hang report names the neighbours.

Packed documents: `document_ids` (b, end of this piece) of the sequence so far; each block is restricted to
(query, key) pairs of one document, read from the global positions of the src rank's shards.
"""
from __future__ import annotations

from typing import Any, Optional

import torch

from llamapipe.core.context_parallel.attention import _rank, _restore, _Ring, _save, _size, _wait
from llamapipe.core.context_parallel.blocks import (accumulators, attention_blocks, backward_blocks, docs_of,
                                                    forward_blocks)
from llamapipe.core.context_parallel.sharding import chunk_ids, local_positions


def _blocks(q: torch.Tensor, documents: Optional[torch.Tensor], lengths: list[int], cp_size: int, cp_rank: int,
            src: int) -> list[tuple]:
    """The calls that attend this rank's queries to rank src's message: [(key slice, blocks, chunk, docs)]: the
    piece's own shard by chunks, then the earlier pieces' shards (`lengths`, local) all visible, in tokens."""
    s_local = q.shape[2]
    own_docs = None
    if documents is not None:
        own_docs = docs_of(documents[:, documents.shape[1] - s_local * cp_size:], cp_size, cp_rank, src)
    calls = [(slice(0, s_local), attention_blocks(chunk_ids(cp_size, cp_rank), chunk_ids(cp_size, src)),
              s_local // 2, own_docs)]
    past = sum(lengths)
    if past:
        docs = None
        if documents is not None:   # the src rank's tokens of each earlier piece, in message order
            keys, start = [], 0
            for n in lengths:
                positions = local_positions(n * cp_size, cp_size, src).to(documents.device)
                keys.append(documents[:, start:start + n * cp_size][:, positions])
                start += n * cp_size
            docs = (own_docs[0], torch.cat(keys, dim=1))
        calls.append((slice(s_local, s_local + past), [(0, s_local, 0, past, False)], 1, docs))
    return calls


class _RingPieceAttention(torch.autograd.Function):
    """The piece's and the earlier pieces' key/value shards around the ring; dK/dV accumulators follow them home."""

    @staticmethod
    def forward(ctx, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: Any, scale: float,
                documents: Optional[torch.Tensor], *past: torch.Tensor) -> torch.Tensor:
        cp_size, cp_rank, ring = _size(group), _rank(group), _Ring(group)
        lengths = [t.shape[2] for t in past[::2]]
        out, lse = accumulators(q)
        kv = torch.stack([torch.cat([k, *past[::2]], dim=2), torch.cat([v, *past[1::2]], dim=2)])
        for step in range(cp_size):
            if step + 1 < cp_size:
                kv_next, works = ring.start(kv, tag=0)
            for keys, blocks, chunk, docs in _blocks(q, documents, lengths, cp_size, cp_rank,
                                                     (cp_rank - step) % cp_size):
                forward_blocks(q, kv[0][:, :, keys], kv[1][:, :, keys], blocks, chunk, scale, out, lse, docs)
            if step + 1 < cp_size:
                _wait(works, ring)
                kv = kv_next
        return _save(ctx, q, k, v, out, lse, group, scale, documents, *past)

    @staticmethod
    def backward(ctx, dout: torch.Tensor):
        q, k, v, out, lse, group, scale, cp_size, cp_rank, dq = _restore(ctx)
        past, documents, ring = ctx.saved_tensors[5:], ctx.documents, _Ring(group)
        lengths = [t.shape[2] for t in past[::2]]
        kv = torch.stack([torch.cat([k, *past[::2]], dim=2), torch.cat([v, *past[1::2]], dim=2)])
        dkv_in, dkv_works = None, []
        for step in range(cp_size):
            if step + 1 < cp_size:
                kv_next, kv_works = ring.start(kv, tag=0)
            dkv = torch.zeros(kv.shape, dtype=torch.float32, device=q.device)   # grads of src's message
            for keys, blocks, chunk, docs in _blocks(q, documents, lengths, cp_size, cp_rank,
                                                     (cp_rank - step) % cp_size):
                backward_blocks(dout, q, kv[0][:, :, keys], kv[1][:, :, keys], out, lse, blocks, chunk, scale, dq,
                                dkv[:, :, :, keys], docs)
            if step > 0:    # what the ranks before me added to src's gradients
                _wait(dkv_works, ring, "key/value gradients")
                dkv += dkv_in
            dkv_in, dkv_works = ring.start(dkv, tag=1)   # onwards; after the last step, to src itself
            if step + 1 < cp_size:
                _wait(kv_works, ring)
                kv = kv_next
        _wait(dkv_works, ring, "key/value gradients")
        parts = dkv_in.split([k.shape[2], *lengths], dim=3)
        grads = [t for i, part in enumerate(parts[1:]) for t in (part[0].to(past[2 * i].dtype),
                                                                  part[1].to(past[2 * i + 1].dtype))]
        return (dq.to(q.dtype), parts[0][0].to(k.dtype), parts[0][1].to(v.dtype), None, None, None, *grads)


def ring_piece_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, past_k: list, past_v: list, group: Any,
                         scale: float, document_ids: Optional[torch.Tensor] = None) -> torch.Tensor:
    """q: (b, heads, s_local, d), k/v: (b, groups, s_local, d) of this rank's shard of the piece; past_k/past_v:
    this rank's shards of the earlier pieces (b, groups, s_i / cp, d) -> (b, heads, s_local, d). `group`: a
    process group or a SubGroup (the p2p level of a2a+p2p)."""
    pairs = [t for kv in zip(past_k, past_v) for t in kv]
    return _RingPieceAttention.apply(q, k, v, group, scale, document_ids, *pairs)

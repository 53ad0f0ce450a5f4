"""The attention side of Seq1F1B (core/pipeline_parallel/seq_split.py): each attention layer's cache of the keys
and values of the earlier pieces of a sequence, and the way their gradients flow back.

Piece i of a sequence attends to its own keys and those of pieces 0..i-1. Its forward takes the earlier pieces'
cached keys/values (after RoPE) as detached leaves that require grad, so its backward stops at them; a hook on
each leaf adds the gradient it gets to the cache's accumulator of that piece. The keys/values of piece j pass
through `_KVGradSink`, the identity whose backward adds that accumulator: the pieces' backwards run in reverse
order, so when piece j's backward reaches it every later piece's backward has already added its part. The cache
entry of piece j is dropped there too (after a forward-only pass, when the sequence's last piece has run).

B/W split (`WeightGradStore`): the key/value gradients are input gradients, computed in the B; only the
projections' weight gradients wait for the W, and they take the summed key/value gradient. Recompute: a
recomputed forward stores the same keys again and its new leaves are never reached, since gradients flow through
the original graph to the original leaves.

Attention (`piece_attention`): one kernel call per earlier piece (all its keys visible) and one over the piece's
own keys (causal), merged by log-sum-exp as context-parallel attention merges its blocks; the backward takes the
merged output and log-sum-exp per block. So a piece saves no concatenated copy of the earlier keys (they are the
cache's tensors) and no mask; packed documents restrict each block by a same-document mask.
"""
from __future__ import annotations

import math
from typing import Any, Optional

import torch
import torch.nn.functional as F

from llamapipe.core.context_parallel.kernels import attend, attend_backward
from llamapipe.core.context_parallel.pieces import allgather_piece_attention
from llamapipe.core.context_parallel.ring_pieces import ring_piece_attention
from llamapipe.core.context_parallel.ulysses import UlyssesGroup, check_query_groups, gather_heads, scatter_heads
from llamapipe.core.document_attention import same_document
from llamapipe.core.pipeline_parallel.seq_split import Piece
from llamapipe.core.tensor_parallel.graph_breaks import eager


class PieceKVCache:
    """Keys and values (b, groups, s, d) of the pieces that ran their forward and not yet their backward, per
    (microbatch, piece), and the key/value gradients later pieces gave them."""

    def __init__(self) -> None:
        self.kv: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}
        self.grads: dict[tuple[int, int], list] = {}

    def extend(self, piece: Piece, k: torch.Tensor, v: torch.Tensor) -> tuple[list, list, torch.Tensor, torch.Tensor]:
        """(keys of pieces 0..i-1, their values, this piece's keys, its values); this piece's are cached."""
        key = (piece.microbatch, piece.index)
        grad = torch.is_grad_enabled() and (k.requires_grad or v.requires_grad)
        if grad:
            k, v = _KVGradSink.apply(k, v, self, key)
        self.kv[key] = (k.detach(), v.detach())
        past_k, past_v = [], []
        for i in range(piece.index):
            pk, pv = self.kv[(piece.microbatch, i)]
            if grad:
                pk, pv = pk.detach().requires_grad_(), pv.detach().requires_grad_()
                for slot, leaf in enumerate((pk, pv)):
                    leaf.register_hook(self._adder((piece.microbatch, i), slot))
            past_k.append(pk)
            past_v.append(pv)
        if not grad and piece.index == piece.count - 1:     # no backward will drop them
            for i in range(piece.count):
                self.kv.pop((piece.microbatch, i), None)
        return past_k, past_v, k, v

    def _adder(self, key: tuple[int, int], slot: int):
        def add(grad: torch.Tensor) -> None:
            acc = self.grads.setdefault(key, [None, None])
            acc[slot] = grad.clone() if acc[slot] is None else acc[slot].add_(grad)
        return add

    def take(self, key: tuple[int, int]) -> list:
        """The accumulated gradients of piece `key` (its backward runs now); its cache entry is dropped."""
        self.kv.pop(key, None)
        return self.grads.pop(key, [None, None])

    def clear(self) -> None:
        self.kv.clear()
        self.grads.clear()


class _KVGradSink(torch.autograd.Function):
    """Identity on a piece's keys and values; its backward adds the gradients later pieces gave them."""

    @staticmethod
    def forward(ctx, k: torch.Tensor, v: torch.Tensor, cache: PieceKVCache, key: tuple[int, int]):
        ctx.cache, ctx.key = cache, key
        return k.view_as(k), v.view_as(v)

    @staticmethod
    def backward(ctx, gk: Optional[torch.Tensor], gv: Optional[torch.Tensor]):
        acc = ctx.cache.take(ctx.key)
        out = []
        for g, a in zip((gk, gv), acc):
            out.append(a if g is None else (g if a is None else g + a))
        return out[0], out[1], None, None


@eager   # under --compile: the cache's dictionaries and hooks, and collectives on gloo, do not trace
def cached_piece_attention(cache: PieceKVCache, piece: Piece, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                           cp_group: Optional[Any], grouped: bool, document_ids: Optional[torch.Tensor] = None,
                           cp_comm_type: str = "p2p") -> torch.Tensor:
    """A piece's attention with `cache` holding the earlier pieces' keys/values. Under context parallelism this
    rank holds its load-balanced shard of the piece (q: (b, heads, s, d), k/v: (b, groups, s, d)):
    - a2a (`cp_group` a UlyssesGroup whose a2a level is the whole CP group): the all-to-all gathers the whole
      piece, in global order, for this rank's heads, which is what the cache keeps and `piece_attention`
      attends (the earlier pieces whole, for the same heads: all on this rank); the reverse all-to-all returns
      this rank's tokens;
    - allgather / p2p: the cache keeps this rank's shards; `allgather_piece_attention` gathers the piece's and
      each earlier piece's keys/values over the CP group (core/context_parallel/pieces.py), `ring_piece_attention`
      passes them around the ring (core/context_parallel/ring_pieces.py);
    - a2a+p2p: the all-to-all over the a2a level gathers each piece, for this rank's heads, in the load-balanced
      layout of the p2p level; the cache keeps that and the ring runs over the p2p level."""
    if cp_group is None:
        past_k, past_v, k, v = cache.extend(piece, k, v)
        return piece_attention(q, past_k, past_v, k, v, grouped, document_ids)
    scale = 1.0 / math.sqrt(q.shape[-1])
    if not isinstance(cp_group, UlyssesGroup):
        past_k, past_v, k, v = cache.extend(piece, k, v)
        attend_cp = allgather_piece_attention if cp_comm_type == "allgather" else ring_piece_attention
        return attend_cp(q, k, v, past_k, past_v, cp_group, scale, document_ids)
    a2a, p2p = cp_group.levels()
    check_query_groups(k.shape[1], a2a)
    q, k, v = (scatter_heads(t, a2a) for t in (q, k, v))
    past_k, past_v, k, v = cache.extend(piece, k, v)
    if p2p.size() > 1:
        out = ring_piece_attention(q, k, v, past_k, past_v, p2p, scale, document_ids)
    else:
        out = piece_attention(q, past_k, past_v, k, v, grouped, document_ids)
    return gather_heads(out, a2a)


def piece_attention(q: torch.Tensor, past_k: list, past_v: list, k: torch.Tensor, v: torch.Tensor, grouped: bool,
                    document_ids: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Causal attention of a piece's queries (b, heads, s, d) over the earlier pieces' keys/values (lists of
    (b, groups, s_i, d), all visible) and its own (causal): one kernel call per block, merged by log-sum-exp
    (core/context_parallel/kernels.py), so no concatenated copy of the keys is saved and no mask is built.
    `document_ids` (b, start + s) or None: a query attends only keys of its own document."""
    if not past_k and document_ids is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=grouped)
    bounds = [0]
    for t in past_k:
        bounds.append(bounds[-1] + t.shape[2])
    allowed = None
    if document_ids is not None:
        docs = document_ids.to(q.device)
        q_docs = docs[:, bounds[-1]:]
        allowed = [same_document(q_docs, docs[:, a:b], False) for a, b in zip(bounds, bounds[1:])]
        allowed.append(same_document(q_docs, q_docs, True))
    pairs = [t for kv in zip(past_k, past_v) for t in kv]
    return _PieceAttention.apply(q, k, v, 1.0 / math.sqrt(q.shape[-1]), allowed, *pairs)


class _PieceAttention(torch.autograd.Function):
    """Blocks: every earlier piece (non-causal), then the piece's own keys (causal); saves q, the blocks' keys and
    values as they are (the earlier pieces' are the cache's tensors), the output and the log-sum-exp."""

    @staticmethod
    def forward(ctx, q, k, v, scale: float, allowed: Optional[list], *pairs):
        blocks = [(pairs[2 * i], pairs[2 * i + 1], False) for i in range(len(pairs) // 2)] + [(k, v, True)]
        masks = allowed or [None] * len(blocks)
        out = lse = None
        for (bk, bv, causal), mask in zip(blocks, masks):
            o, l = attend(q, bk, bv, causal, scale, mask)
            if out is None:
                out, lse = o.float(), l
                continue
            new = torch.logaddexp(lse, l)
            finite = new.masked_fill(new == float("-inf"), 0.0)
            out = out * (lse - finite).exp().unsqueeze(-1) + o.float() * (l - finite).exp().unsqueeze(-1)
            lse = new
        out = out.to(q.dtype)
        ctx.scale, ctx.masks, ctx.n = scale, masks, len(blocks)
        ctx.save_for_backward(q, out, lse, *[t for bk, bv, _ in blocks for t in (bk, bv)])
        return out

    @staticmethod
    def backward(ctx, dout):
        q, out, lse, *kv = ctx.saved_tensors
        dq, grads = None, []
        for i in range(ctx.n):
            causal = i == ctx.n - 1
            g_q, g_k, g_v = attend_backward(dout.contiguous(), q, kv[2 * i], kv[2 * i + 1], out, lse, causal,
                                            ctx.scale, ctx.masks[i])
            dq = g_q if dq is None else dq + g_q
            grads += [g_k, g_v]
        own_k, own_v = grads[-2:]
        return (dq, own_k, own_v, None, None, *grads[:-2])

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
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from llamapipe.core.pipeline_parallel.seq_split import Piece


class PieceKVCache:
    """Keys and values (b, groups, s, d) of the pieces that ran their forward and not yet their backward, per
    (microbatch, piece), and the key/value gradients later pieces gave them."""

    def __init__(self) -> None:
        self.kv: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}
        self.grads: dict[tuple[int, int], list] = {}

    def extend(self, piece: Piece, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
        """Keys and values of pieces 0..piece.index along dim 2, and how many tokens precede this piece."""
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
        start = sum(t.shape[2] for t in past_k)
        if not grad and piece.index == piece.count - 1:     # no backward will drop them
            for i in range(piece.count):
                self.kv.pop((piece.microbatch, i), None)
        if past_k:
            k, v = torch.cat(past_k + [k], dim=2), torch.cat(past_v + [v], dim=2)
        return k, v, start

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


def offset_mask(q_len: int, k_len: int, start: int, device: torch.device,
                q_docs: Optional[torch.Tensor] = None, k_docs: Optional[torch.Tensor] = None) -> torch.Tensor:
    """(q_len, k_len) bool, or (b, 1, q_len, k_len) with documents: query i (at position start + i) attends key j
    when j <= start + i, and, given document ids, when both are in one document."""
    mask = torch.ones(q_len, k_len, dtype=torch.bool, device=device).tril(diagonal=start)
    if q_docs is None:
        return mask
    return mask & (q_docs[:, None, :, None] == k_docs[:, None, None, :])


def piece_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int, grouped: bool,
                    document_ids: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Causal attention of a piece's queries (b, heads, s, d) at positions start.. over keys/values
    (b, groups, start + s, d) of the sequence so far; `document_ids` (b, start + s) or None."""
    s, total = q.shape[2], k.shape[2]
    if document_ids is None and start == 0:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=grouped)
    docs = None if document_ids is None else document_ids.to(q.device)
    mask = offset_mask(s, total, start, q.device, None if docs is None else docs[:, start:], docs)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=grouped)

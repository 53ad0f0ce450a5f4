"""Causal attention within packed documents: Megatron's --reset-attention-mask, a block-causal mask.

A training sample packs several documents into one sequence; with the mask, token i attends key j only when
j <= i and both lie in the same document. Documents are given per token as `document_ids` (b, s): the index of
the token's document in its sample, non-decreasing along the sequence (the data pipeline counts the
end-of-document tokens before each position, so an EOD token belongs to the document it ends).

Two kernels, both exact, chosen by device:

- CPU: the "variable length" form of FlashAttention (a call per document, no masked work) on torch's CPU
  flash kernel. A document of `MIN_TILE` tokens or more is one causal SDPA call on its own rows; shorter
  neighbours are attended together, a tile of about `MIN_TILE` tokens under a boolean block-causal mask, so a
  sample of many short documents does not cost a call each. The work is then the sum of the documents'
  triangles (plus tiles of at most 2 x MIN_TILE tokens), not the sequence's: at 4096 tokens in documents of a
  few hundred tokens that is several times less than the causal mask over the whole sample
  (benchmarks/bench_packed_documents.py). The tile boundaries depend on the data, so this runs eagerly under
  --compile (a graph break, core/tensor_parallel/graph_breaks.py).
- CUDA: flex_attention (compiled) with a BlockMask built from the document ids, which skips every fully
  masked block of the (query, key) grid. Its backward does not run on CPU (torch 2.13), so on this project's
  CPU-only test machine only its forward is checked against the CPU kernel (tests/unit/test_document_attention.py).

Context parallelism applies the same mask per (query chunk, key chunk) block from the global document ids
(`same_document`; core/context_parallel/attention.py).
"""
from __future__ import annotations

import math
from functools import lru_cache
from typing import Optional

import torch
import torch.nn.functional as F

from llamapipe.core.tensor_parallel.graph_breaks import eager

MIN_TILE = 256   # tokens: a shorter document shares its kernel call with its neighbours


def same_document(q_docs: torch.Tensor, k_docs: torch.Tensor, causal: bool) -> torch.Tensor:
    """Which query attends which key, (b, 1, sq, sk) bool: same document, and on a causal (diagonal) block
    only keys at or before the query. q_docs: (b, sq), k_docs: (b, sk) document ids."""
    allowed = q_docs[:, None, :, None] == k_docs[:, None, None, :]
    if causal:
        sq, sk = q_docs.shape[1], k_docs.shape[1]
        allowed &= torch.ones(sq, sk, dtype=torch.bool, device=q_docs.device).tril_()
    return allowed


def tiles(document_ids: torch.Tensor, min_tile: int = MIN_TILE) -> list[tuple[int, int, bool]]:
    """(start, end, one_document) spans covering one sample's document ids (s,): each long document alone,
    short neighbours grouped until a tile holds `min_tile` tokens."""
    _, counts = torch.unique_consecutive(document_ids, return_counts=True)
    spans, start, docs = [], 0, 0
    end = 0
    for n in counts.tolist():
        if n >= min_tile:
            if docs:
                spans.append((start, end, docs == 1))
            spans.append((end, end + n, True))
            start, end, docs = end + n, end + n, 0
            continue
        end, docs = end + n, docs + 1
        if end - start >= min_tile:
            spans.append((start, end, docs == 1))
            start, docs = end, 0
    if docs:
        spans.append((start, end, docs == 1))
    return spans


def _tiled(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, document_ids: torch.Tensor,
           scale: float) -> torch.Tensor:
    gqa = q.shape[1] != k.shape[1]
    rows = []
    for row in range(q.shape[0]):
        docs, parts = document_ids[row], []
        for start, end, one in tiles(docs):
            span = slice(start, end)
            qs, ks, vs = (t[row:row + 1, :, span] for t in (q, k, v))
            mask = None if one else same_document(docs[None, span], docs[None, span], causal=True)
            parts.append(F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, is_causal=one, scale=scale,
                                                        enable_gqa=gqa))
        rows.append(torch.cat(parts, dim=2))
    return torch.cat(rows, dim=0)


@lru_cache(maxsize=1)
def _compiled_flex():
    from torch.nn.attention.flex_attention import flex_attention
    return torch.compile(flex_attention, dynamic=False)


def flex_document_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, document_ids: torch.Tensor,
                            scale: float, *, compiled: bool = True) -> torch.Tensor:
    """The CUDA kernel: flex_attention under a BlockMask of the documents (`compiled=False`: torch's unfused
    reference, which also runs forward-only on CPU)."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    docs, s = document_ids, q.shape[2]

    def mask_mod(b, h, q_idx, kv_idx):
        return (docs[b, q_idx] == docs[b, kv_idx]) & (kv_idx <= q_idx)

    block_mask = create_block_mask(mask_mod, docs.shape[0], None, s, s, device=q.device)
    kernel = _compiled_flex() if compiled else flex_attention
    return kernel(q, k, v, block_mask=block_mask, scale=scale, enable_gqa=q.shape[1] != k.shape[1])


@eager   # under --compile: the tiles depend on the data
def document_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, document_ids: torch.Tensor, *,
                       scale: Optional[float] = None) -> torch.Tensor:
    """Causal attention within documents. q: (b, heads, s, d), k/v: (b, groups, s, d), document_ids: (b, s)
    -> (b, heads, s, d)."""
    assert document_ids.shape == (q.shape[0], q.shape[2]), (document_ids.shape, q.shape)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    if q.is_cuda:
        return flex_document_attention(q, k, v, document_ids, scale)
    return _tiled(q, k, v, document_ids, scale)

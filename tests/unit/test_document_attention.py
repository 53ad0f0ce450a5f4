"""Attention within packed documents (core/document_attention.py) and the per-block mask of context parallelism
(core/context_parallel/kernels.py), against references that do not share their code.

- `document_attention` (the CPU tiles): each document's rows of the output, and the gradients, equal causal SDPA
  over that document alone (float64, 1e-12), with documents longer and shorter than a tile and grouped queries.
- flex_attention's document BlockMask (the CUDA kernel; its backward does not run on CPU, so its forward only,
  unfused) equals the same.
- One context-parallel block under a document mask with rows that attend nothing: the CPU flash kernel equals
  the plain-matmul one, output, log-sum-exp (-inf on empty rows) and gradients from a global log-sum-exp.
"""
import pytest
import torch
import torch.nn.functional as F

from llamapipe.core.context_parallel.kernels import attend, attend_backward, attend_math, attend_math_backward
from llamapipe.core.document_attention import (MIN_TILE, document_attention, flex_document_attention,
                                               same_document, tiles)

HEADS, GROUPS, D = 4, 2, 8
LENGTHS = [[300, 20, 30, 250, 10, 90], [5, 695]]     # two samples of 700 tokens


def _ids(lengths: list[int]) -> torch.Tensor:
    return torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))


def _qkv(s: int, dtype=torch.float64) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(11)
    q = torch.randn(len(LENGTHS), HEADS, s, D, generator=g, dtype=dtype)
    k, v = (torch.randn(len(LENGTHS), GROUPS, s, D, generator=g, dtype=dtype) for _ in range(2))
    return q, k, v


def test_tiles_cover_the_sample_with_long_documents_alone():
    spans = tiles(_ids(LENGTHS[0]))
    assert spans == [(0, 300, True), (300, 600, False), (600, 700, False)]
    assert tiles(_ids(LENGTHS[1])) == [(0, 5, True), (5, 700, True)]
    spans = tiles(_ids([3] * 200))            # many short documents: tiles of MIN_TILE tokens or a little more
    assert spans[0][0] == 0 and spans[-1][1] == 600 and all(a[1] == b[0] for a, b in zip(spans, spans[1:]))
    assert all(MIN_TILE <= end - start < 2 * MIN_TILE and not one for start, end, one in spans[:-1])


def _alone(q, k, v, dout) -> tuple[torch.Tensor, ...]:
    """Output and q/k/v gradients with every document of every sample attended on its own (causal SDPA)."""
    out = torch.zeros_like(q)
    grads = [torch.zeros_like(t) for t in (q, k, v)]
    for row, lengths in enumerate(LENGTHS):
        start = 0
        for n in lengths:
            piece = [t[row:row + 1, :, start:start + n].detach().requires_grad_() for t in (q, k, v)]
            o = F.scaled_dot_product_attention(*piece, is_causal=True, enable_gqa=True)
            o.backward(dout[row:row + 1, :, start:start + n])
            out[row:row + 1, :, start:start + n] = o.detach()
            for grad, p in zip(grads, piece):
                grad[row:row + 1, :, start:start + n] = p.grad
            start += n
    return out, *grads


def test_document_attention_equals_each_document_alone():
    q, k, v = (t.requires_grad_() for t in _qkv(700))
    documents = torch.stack([_ids(lengths) for lengths in LENGTHS])
    out = document_attention(q, k, v, documents)
    dout = torch.randn_like(out)
    got = (out.detach(), *torch.autograd.grad(out, (q, k, v), dout))
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, _alone(q, k, v, dout)):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12, msg=name)


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
def test_flex_block_mask_forward_equals_each_document_alone():
    q, k, v = _qkv(700, torch.float32)
    documents = torch.stack([_ids(lengths) for lengths in LENGTHS])
    out = flex_document_attention(q, k, v, documents, D ** -0.5, compiled=False)
    ref = _alone(q, k, v, torch.zeros_like(q))[0]
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


def test_cp_block_kernel_under_a_document_mask_equals_plain_matmuls():
    """Queries 0..63 against keys 40..103 of another split: sample 0 shares no document (every row empty),
    sample 1 shares some; the gradients use a global lse as the ring's backward does."""
    g = torch.Generator().manual_seed(2)
    q = torch.randn(2, HEADS, 64, D, generator=g)
    k, v = (torch.randn(2, GROUPS, 64, D, generator=g) for _ in range(2))
    positions_q, positions_k = torch.arange(64), torch.arange(40, 104)
    q_docs = torch.stack([positions_q // 10, positions_q // 40])
    k_docs = torch.stack([positions_k // 10 + 20, positions_k // 40])
    allowed = same_document(q_docs, k_docs, causal=False)
    assert not allowed[0].any() and allowed[1].any() and not allowed[1].any(-1).all()
    out, lse = attend(q, k, v, False, 0.3, allowed)
    ref_out, ref_lse = attend_math(q, k, v, False, 0.3, allowed)
    empty = ~allowed.any(-1).expand_as(lse)
    assert torch.isinf(lse[empty]).all() and (out[empty] == 0).all()
    torch.testing.assert_close(out, ref_out, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(lse[~empty], ref_lse[~empty], rtol=1e-5, atol=1e-6)
    global_lse = ref_lse.masked_fill(empty, 0.0) + 1.0      # finite: every row attends itself somewhere
    dout = torch.randn(out.shape, generator=g)
    got = attend_backward(dout, q, k, v, out, global_lse, False, 0.3, allowed)
    want = attend_math_backward(dout, q, k, v, out, global_lse, False, 0.3, allowed)
    for name, a, b in zip(("dq", "dk", "dv"), got, want):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=name)

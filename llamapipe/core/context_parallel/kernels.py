"""Attention on one block of queries and keys that also returns the log-sum-exp, and its backward.

Context-parallel attention (attention.py) computes causal attention over a sequence it holds in pieces: it
attends the local queries to one block of keys at a time and merges the partial results by their
log-sum-exp (FlashAttention's online softmax, arXiv 2205.14135; ring attention, arXiv 2310.01889). So each
block needs a kernel that returns the row-wise log-sum-exp of the scaled scores along with its output, and a
backward that takes the *global* output and log-sum-exp: then the block's probabilities are exp(S - lse_global),
already normalised over every key block, and the block gradients simply add up (ring-flash-attention's
backward). Packed documents (core/document_attention.py) restrict a block further by a boolean `allowed` mask
(b, 1, sq, sk); a query row that may attend no key of the block gets out 0 and lse -inf, so the merge by
log-sum-exp ignores it. On CPU that kernel is aten's FlashAttention for CPU (what `F.scaled_dot_product_attention` runs
there; grouped-query attention is native). Elsewhere a plain-matmul version computes the same quantities,
in fp32, with the block's scores materialised (it is checked against the CPU kernel in the tests).

q: (b, heads, sq, d); k, v: (b, groups, sk, d) with heads a multiple of groups. A causal block is a diagonal
block: query i attends keys 0..i (sq == sk). lse: (b, heads, sq) fp32.
"""
from __future__ import annotations

from typing import Optional

import torch

_ATEN = torch.ops.aten
# where the CPU flash kernel's ops run: the CPU, and meta tensors (shapes only: the dry run), which its meta
# implementations take in a few operations where the plain matmuls take dozens
_FLASH_DEVICES = ("cpu", "meta")


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float,
           allowed: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(out (b, heads, sq, d) in q's dtype, lse (b, heads, sq) fp32) of one block."""
    if q.device.type not in _FLASH_DEVICES:
        return attend_math(q, k, v, causal, scale, allowed)
    mask = None if allowed is None else _additive(allowed, q.dtype)
    out, lse = _ATEN._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, attn_mask=mask, scale=scale)
    if allowed is not None:   # the CPU kernel gives a row that attends nothing lse 0
        empty = ~allowed.any(dim=-1)                                   # (b, 1, sq)
        lse = lse.masked_fill(empty, float("-inf"))
        out = out.masked_fill(empty.unsqueeze(-1), 0.0)
    return out, lse


def attend_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                    lse: torch.Tensor, causal: bool, scale: float,
                    allowed: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv) of one block given the rows' global `out` and `lse` (the merged result over all blocks)."""
    if q.device.type not in _FLASH_DEVICES:
        return attend_math_backward(dout, q, k, v, out, lse, causal, scale, allowed)
    mask = None if allowed is None else _additive(allowed, q.dtype)
    return _ATEN._scaled_dot_product_flash_attention_for_cpu_backward(dout, q, k, v, out, lse, 0.0, causal,
                                                                     attn_mask=mask, scale=scale)


def _additive(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A boolean mask as the additive one the CPU kernel takes: 0 where allowed, -inf elsewhere."""
    return torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill_(~allowed, float("-inf"))


def _scores(q: torch.Tensor, k: torch.Tensor, causal: bool, scale: float,
            allowed: Optional[torch.Tensor]) -> torch.Tensor:
    """Scaled scores (b, heads, sq, sk) in fp32, -inf above the diagonal of a causal block and where not allowed."""
    rep = q.shape[1] // k.shape[1]
    scores = q.float() @ k.float().repeat_interleave(rep, dim=1).transpose(-1, -2) * scale
    if causal:
        above = torch.ones(scores.shape[-2:], dtype=torch.bool, device=q.device).triu_(1)
        scores.masked_fill_(above, float("-inf"))
    if allowed is not None:
        scores.masked_fill_(~allowed, float("-inf"))
    return scores


def attend_math(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float,
                allowed: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """`attend` with plain matmuls (any device)."""
    rep = q.shape[1] // k.shape[1]
    scores = _scores(q, k, causal, scale, allowed)
    lse = scores.logsumexp(dim=-1)
    finite = lse.masked_fill(lse == float("-inf"), 0.0)    # a row that attends nothing: probabilities 0, not NaN
    probs = (scores - finite.unsqueeze(-1)).exp_()
    out = probs @ v.float().repeat_interleave(rep, dim=1)
    return out.to(q.dtype), lse


def attend_math_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                         lse: torch.Tensor, causal: bool, scale: float,
                         allowed: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`attend_backward` with plain matmuls: dS = P * (dP - rowsum(dO * O)), P from the global lse."""
    b, groups, sk, d = k.shape
    rep = q.shape[1] // groups
    probs = (_scores(q, k, causal, scale, allowed) - lse.unsqueeze(-1)).exp_()  # (b, heads, sq, sk)
    dout = dout.float()
    dv = probs.transpose(-1, -2) @ dout  # (b, heads, sk, d)
    dprobs = dout @ v.float().repeat_interleave(rep, dim=1).transpose(-1, -2)
    delta = (dout * out.float()).sum(dim=-1, keepdim=True)
    dscores = probs.mul_(dprobs.sub_(delta)).mul_(scale)
    dq = dscores @ k.float().repeat_interleave(rep, dim=1)
    dk = dscores.transpose(-1, -2) @ q.float()  # (b, heads, sk, d)
    fold = (b, groups, rep, sk, d)   # the heads of a group share its key and value: sum their gradients
    return dq.to(q.dtype), dk.view(fold).sum(2).to(k.dtype), dv.view(fold).sum(2).to(v.dtype)

"""Vocabulary-parallel cross entropy (Megatron-LM, arXiv 1909.08053, section 3).

The logits stay split over TP ranks along the vocabulary: three all-reduces (max, target logit,
sum of exponentials) give the exact per-token loss without ever gathering (b, s, vocab) logits.
Computed in fp32 with max subtraction; columns at or past `vocab_size` (TP padding) are excluded.
"""
from __future__ import annotations

from typing import Any, Optional

import torch
import torch.distributed as dist

from llamapipe.core.tensor_parallel.graph_breaks import eager
from llamapipe.core.tensor_parallel.layers import tp_size_rank


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits: torch.Tensor, labels: torch.Tensor, tp_group: Any,
                vocab_size: Optional[int], inplace: bool) -> torch.Tensor:
        tp_size, tp_rank = tp_size_rank(tp_group)
        shard = logits.shape[-1]
        vocab_start = tp_rank * shard
        real = shard if vocab_size is None else min(max(vocab_size - vocab_start, 0), shard)  # non-padding columns
        if real > 0:
            logits_max = logits[..., :real].amax(dim=-1).float()  # (...)
        else:  # this shard is all padding
            logits_max = torch.full(logits.shape[:-1], float("-inf"), device=logits.device)
        if tp_size > 1:
            dist.all_reduce(logits_max, op=dist.ReduceOp.MAX, group=tp_group)
        if inplace and logits.dtype == torch.float32:  # the caller's logits buffer becomes exp(shifted)
            shifted = logits.sub_(logits_max.unsqueeze(-1))
        else:
            shifted = logits - logits_max.unsqueeze(-1)  # fp32 by type promotion; one pass, no clone
        if real < shard:
            shifted[..., real:] = float("-inf")

        outside = (labels < vocab_start) | (labels >= vocab_start + shard)
        local_labels = (labels - vocab_start).masked_fill(outside, 0)
        target_logit = shifted.gather(-1, local_labels.unsqueeze(-1)).squeeze(-1).masked_fill(outside, 0.0)
        exp_logits = shifted.exp_()
        sum_exp = exp_logits.sum(dim=-1)
        if tp_size > 1:
            both = torch.stack([target_logit, sum_exp])
            dist.all_reduce(both, group=tp_group)
            target_logit, sum_exp = both[0], both[1]
        loss = torch.log(sum_exp) - target_logit  # (...)

        ctx.save_for_backward(exp_logits, sum_exp, local_labels, outside)
        ctx.logits_dtype = logits.dtype
        return loss

    @staticmethod
    def backward(ctx, grad_loss: torch.Tensor):
        # d loss / d logit = softmax - onehot(target); softmax = exp / sum_exp is folded into one scaling pass
        exp_logits, sum_exp, local_labels, outside = ctx.saved_tensors
        grad = exp_logits.mul_((grad_loss / sum_exp).unsqueeze(-1))  # reused in place: needed only here
        target_grad = (grad_loss * (~outside).to(grad.dtype)).unsqueeze(-1)
        grad.scatter_add_(-1, local_labels.unsqueeze(-1), -target_grad)
        return grad.to(ctx.logits_dtype), None, None, None, None


@eager
def vocab_parallel_cross_entropy(logits_shard: torch.Tensor, labels: torch.Tensor, tp_group: Optional[Any],
                                 vocab_size: Optional[int] = None, *, inplace: bool = False) -> torch.Tensor:
    """Per-token losses (same shape as `labels`, fp32) from logits split along the last dimension.

    `vocab_size` excludes the padded columns (global index >= vocab_size); None keeps every column.
    The caller does the token-weighted reduction. `inplace=True` lets fp32 logits be overwritten (the caller
    never reads them again), which saves allocating and page-faulting a second (tokens, vocab/tp) buffer.
    Under torch.compile it runs eagerly (a graph break): its collectives do not trace, and on CPU this
    in-place kernel measured faster than inductor's fused logsumexp (forward + backward at (256, 4, 8064) fp32,
    1 thread: about 35 ms against 50 ms).
    """
    return _VocabParallelCrossEntropy.apply(logits_shard, labels, tp_group, vocab_size, inplace)

"""The output layer and its softmax cross-entropy split by vocabulary over pipeline and tensor ranks
(vocabulary parallelism, Yeung et al., arXiv 2411.05288), as two passes per microbatch on every rank.

`PipelineVocabOutput` holds rows [shard * R, (shard + 1) * R) of the output weight padded for tp x pp, shard =
tp_rank * pp_size + pp_rank: a contiguous slice of the logical tensor, so initialisation and checkpoints see the
same logical `output.weight` as without the split, and the pp shards of one TP rank, in pp order, are that TP
rank's shard of the padded weight (how a checkpoint stores it). `forward_stats` (the plan's S) computes this
shard's logits of the last stage's normed hidden state and, per token, their maximum, their sum of
exponentials relative to it and the target logit, reduced over TP; the pipeline ranks all-gather these three
numbers per token, the only synchronisation, and `backward` (the plan's T) combines them into the exact loss
and computes the softmax gradient, the shard's weight gradient and its partial input gradient (the last stage
sums the partials of every rank). `PipelineVocabEmbedding` splits the input embedding the same way: each rank
looks up the tokens in its rows (zeros elsewhere), and the partials summed over the pipeline are the embedding
output (`core.pipeline_parallel.vocab_runtime` runs it for the step's microbatches before the first action).
"""
from __future__ import annotations

from typing import Any, Callable, NamedTuple, Optional

import torch
import torch.distributed as dist
from torch import nn

import torch.nn.functional as F

from llamapipe.core.tensor_parallel import mappings
from llamapipe.core.tensor_parallel.layers import (INPUT_COPY, INPUT_GATHER, parallel_linear,
                                                   set_tensor_model_parallel_attributes, tp_size_rank)


class VocabTargets(NamedTuple):
    """What `forward_step` returns in place of its loss function on the last stage of a vocabulary-parallel
    model: the microbatch's labels and loss mask, (b, s) each (the chunk's s/cp tokens under context
    parallelism), which every rank's S and T need, and the loss
    function, called on the combined per-token losses (b, s) for the (loss_sum, num_tokens, log) it reports.
    T's gradient assumes the executor's convention: loss_sum is the mask-weighted sum of token losses."""
    labels: torch.Tensor
    loss_mask: torch.Tensor
    loss_func: Callable[[torch.Tensor], tuple]


class PipelineVocabEmbedding(nn.Module):
    """One (pipeline rank, TP rank)'s shard of the input embedding's vocabulary rows (same layout as the output's).
    It takes the token ids of the whole sequence and looks up the tokens its chunk keeps: `sequence_shard` (the
    holding chunk's, under context parallelism) cuts them, None keeps them all.

    Its weight gradient is computed after the plan's last action (`grad_after_plan`: an overlapped DP gradient
    sync reduces it at the step's end), and the runtime calls it outside its chunk's forward
    (`runs_outside_chunk`: ZeRO-2/3 make it an FSDP unit of its own, gathered by its own forward hooks)."""
    runs_outside_chunk = True

    def __init__(self, padded_vocab_size: int, hidden_size: int, tp_group: Optional[Any], pp_rank: int,
                 pp_size: int, *, sequence_parallel: bool = False, params_dtype: torch.dtype = torch.float32,
                 sequence_shard: Optional[Callable[[torch.Tensor], torch.Tensor]] = None) -> None:
        super().__init__()
        tp_size, tp_rank = tp_size_rank(tp_group)
        shards = tp_size * pp_size
        assert padded_vocab_size % shards == 0, f"vocabulary {padded_vocab_size} does not split over {shards}"
        rows = padded_vocab_size // shards
        self.tp_group, self.sequence_parallel = tp_group, sequence_parallel and tp_size > 1
        self.sequence_shard = sequence_shard
        self.vocab_start = (tp_rank * pp_size + pp_rank) * rows
        self.weight = nn.Parameter(torch.empty(rows, hidden_size, dtype=params_dtype))
        set_tensor_model_parallel_attributes(self.weight, 0, vocab_padded=True,
                                             vocab_shard=tp_rank * pp_size + pp_rank, vocab_shards=shards)
        self.weight.grad_after_plan = True

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """This shard's part of the embedding of `input_ids` (b, s): (s, b, h), or (s/tp, b, h) under sequence
        parallelism, summed over TP; the sum over the pipeline ranks is the embedding output. Under context
        parallelism s is the chunk's s/cp tokens."""
        if self.sequence_shard is not None:
            input_ids = self.sequence_shard(input_ids)
        ids = input_ids.t()
        outside = (ids < self.vocab_start) | (ids >= self.vocab_start + self.weight.shape[0])
        partial = F.embedding((ids - self.vocab_start).masked_fill(outside, 0), self.weight)
        partial = partial.masked_fill(outside.unsqueeze(-1), 0.0)                       # (s, b, h)
        if self.tp_group is None:
            return partial
        if self.sequence_parallel:
            return mappings.reduce_scatter_to_sequence_parallel_region(partial, self.tp_group)
        return mappings.reduce_from_tensor_model_parallel_region(partial, self.tp_group)


class EmbeddingPrepass(nn.Module):
    """The embedding shard as a first-stage chunk for `forward_step(data_iterator, model)`: it reads the batch
    (pre_process) and returns the shard's partial embedding. Holds the shard without registering it again."""
    pre_process, post_process, vocab_parallel = True, False, False

    def __init__(self, shard: PipelineVocabEmbedding) -> None:
        super().__init__()
        self._shard = [shard]

    def parameters(self, recurse: bool = True):
        return self._shard[0].parameters(recurse)

    def forward(self, input_ids: torch.Tensor, labels: Optional[torch.Tensor] = None,
                position_ids: Optional[torch.Tensor] = None,
                document_ids: Optional[torch.Tensor] = None) -> torch.Tensor:
        """The partial embedding of `input_ids`; a packed sample's position and document ids concern the layers."""
        return self._shard[0](input_ids)


class PipelineVocabOutput(nn.Module):
    """One (pipeline rank, TP rank)'s shard of the output layer's vocabulary rows. The plan's S/T call it outside
    its chunk's forward (`runs_outside_chunk`, as for the embedding)."""
    runs_outside_chunk = True

    def __init__(self, padded_vocab_size: int, hidden_size: int, vocab_size: int, tp_group: Optional[Any],
                 pp_rank: int, pp_size: int, *, sequence_parallel: bool = False,
                 params_dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        tp_size, tp_rank = tp_size_rank(tp_group)
        shards = tp_size * pp_size
        assert padded_vocab_size % shards == 0, f"vocabulary {padded_vocab_size} does not split over {shards}"
        rows = padded_vocab_size // shards
        self.tp_group, self.sequence_parallel, self.vocab_size = tp_group, sequence_parallel, vocab_size
        self.vocab_start = (tp_rank * pp_size + pp_rank) * rows
        self.weight = nn.Parameter(torch.empty(rows, hidden_size, dtype=params_dtype))
        # a TP-style shard over tp x pp ranks: `vocab_shard` of `vocab_shards` along dim 0
        set_tensor_model_parallel_attributes(self.weight, 0, vocab_padded=True,
                                             vocab_shard=tp_rank * pp_size + pp_rank, vocab_shards=shards)

    def forward(self, hidden: torch.Tensor, labels: torch.Tensor) -> tuple[dict, torch.Tensor]:
        """The plan's S (`forward_stats`), through `__call__` so module hooks see it."""
        return self.forward_stats(hidden, labels)

    def forward_stats(self, hidden: torch.Tensor, labels: torch.Tensor) -> tuple[dict, torch.Tensor]:
        """S: from the last stage's normed hidden state (s, b, h) (or (s/tp, b, h) under sequence parallelism)
        and labels (s, b), this shard's (max, sum of exp, target logit) per token, (3, s, b) fp32, reduced
        over TP; the returned state keeps what `backward` needs (the logits and the input)."""
        x = hidden.detach().requires_grad_(True)
        mode = INPUT_GATHER if self.sequence_parallel else INPUT_COPY
        logits = parallel_linear(x, [self.weight], self.tp_group, mode)[0]     # (s, b, rows)
        real = min(max(self.vocab_size - self.vocab_start, 0), logits.shape[-1])  # non-padding columns
        with torch.no_grad():
            if real > 0:
                local_max = logits[..., :real].amax(-1).float()
            else:
                local_max = torch.full(logits.shape[:-1], float("-inf"), device=logits.device)
            if self.tp_group is not None:
                dist.all_reduce(local_max, op=dist.ReduceOp.MAX, group=self.tp_group)
            shift = torch.where(torch.isinf(local_max), torch.zeros_like(local_max), local_max)
            sum_exp = (logits[..., :real].float() - shift.unsqueeze(-1)).exp().sum(-1)
            inside = (labels >= self.vocab_start) & (labels < self.vocab_start + real)
            local = (labels - self.vocab_start).masked_fill(~inside, 0)
            target = logits.gather(-1, local.unsqueeze(-1)).squeeze(-1).float().masked_fill(~inside, 0.0)
            both = torch.stack([sum_exp, target])
            if self.tp_group is not None:
                dist.all_reduce(both, group=self.tp_group)
        state = {"x": x, "logits": logits, "labels": labels, "real": real}
        return state, torch.stack([local_max, both[0], both[1]])

    @staticmethod
    def combine(stats: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(max, sum of exp relative to it, per-token loss) over every shard's stats, (pp, 3, s, b)."""
        top = stats[:, 0].amax(0)                                            # (s, b)
        total = (stats[:, 1] * (stats[:, 0] - top).exp()).sum(0)             # exp(-inf) = 0 for empty shards
        loss = total.log() + top - stats[:, 2].sum(0)
        return top, total, loss

    def backward(self, state: dict, stats: torch.Tensor, grad_loss: torch.Tensor) -> torch.Tensor:
        """T: d(sum_tokens grad_loss * loss)/d logits = grad_loss * (softmax - onehot), back through this
        shard's GEMM; the weight gradient lands in `.grad` and the partial input gradient is returned."""
        top, total, _ = self.combine(stats)
        logits, labels, real = state["logits"], state["labels"], state["real"]
        with torch.no_grad():
            grad = (logits.float() - top.unsqueeze(-1)).exp_().div_(total.unsqueeze(-1))
            grad[..., real:] = 0.0
            inside = (labels >= self.vocab_start) & (labels < self.vocab_start + real)
            local = (labels - self.vocab_start).masked_fill(~inside, 0)
            grad.scatter_add_(-1, local.unsqueeze(-1), -inside.to(grad.dtype).unsqueeze(-1))
            grad.mul_(grad_loss.unsqueeze(-1))
        torch.autograd.backward(logits, grad.to(logits.dtype))
        return state["x"].grad

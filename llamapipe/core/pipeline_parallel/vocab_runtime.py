"""The executor's S and T actions (vocabulary parallelism, arXiv 2411.05288) for one rank during one step.

The last stage's F hands its normed hidden state and the microbatch's targets (labels and loss mask) to every
pipeline rank's S (p2p messages the plan derives, `p2p_communication.vocab_messages`). S runs this rank's
`PipelineVocabOutput` shard and starts an asynchronous all-gather of its per-token (max, sum of exp, target)
statistics over the pipeline group: the one collective, issued by every rank in the plan's S order (the
simulator checks that order is the same everywhere), so it matches without any rank blocking in S. T waits for
that all-gather, combines the statistics into the exact per-token loss and runs the shard's backward; its
partial input gradient goes to the last stage, whose B sums the partials of every rank. The last-stage rank
reports the loss (loss_sum, num_tokens) at its T, or at the end of a forward-only step, which runs F and S only.

The input embedding is split the same way and runs outside the plan, as the paper allows for the input layer:
before the first action every rank looks up the step's microbatches in its rows (reading them from its own
copy of the data, the data iterator after the chunks' ones) and one reduce over the pipeline sums the
partials, which the first stage's F takes as its input; after the last action the first stage's input gradients
are broadcast over the pipeline and every rank runs its shard's backward (its weight gradient).
"""
from __future__ import annotations

import time
from contextlib import contextmanager
from typing import Any, Iterator, Optional

import torch
import torch.distributed as dist

from llamapipe.core.pipeline_parallel.position import waiting
from llamapipe.core.tensor_parallel.vocab_pipeline import (EmbeddingPrepass, PipelineVocabEmbedding,
                                                          PipelineVocabOutput, VocabTargets)


def vocab_output(model_chunks: list) -> Optional[PipelineVocabOutput]:
    """This rank's vocabulary shard (held by local chunk 0), or None when the model is not vocabulary-parallel."""
    output = getattr(model_chunks[0], "output", None) if model_chunks else None
    return output if isinstance(output, PipelineVocabOutput) else None


def vocab_embedding(model_chunks: list) -> Optional[Any]:
    """This rank's input-embedding shard (local chunk 0), or None."""
    embedding = getattr(model_chunks[0], "embedding", None) if model_chunks else None
    return embedding if isinstance(embedding, PipelineVocabEmbedding) else None


def pack_targets(targets: VocabTargets) -> torch.Tensor:
    """Labels and loss mask as one message, (2, b, s) float64 (exact for any token id below 2**53)."""
    return torch.stack([targets.labels.to(torch.float64), targets.loss_mask.to(targets.labels.device, torch.float64)])


class VocabStep:
    """S/T state of one rank during one step: S results waiting for their T, all-gathers in flight, and the
    last stage's loss functions (last-stage rank only)."""

    def __init__(self, output: PipelineVocabOutput, pp_group: Any, pp_size: int, *, last_rank: bool,
                 loss_scale: float, embedding: Optional[Any] = None, first_rank: bool = False,
                 first_rank_global: int = 0) -> None:
        # the statistics' own group when the model has one (setup.vocab_stats_group), else the pipeline group
        self.output, self.group, self.pp_size = output, getattr(output, "stats_group", None) or pp_group, pp_size
        self.last_rank, self.loss_scale = last_rank, loss_scale
        self.states: dict[int, dict] = {}
        self.gathers: dict[int, tuple] = {}            # mb -> (work, per-rank stats buffers)
        self.loss_funcs: dict[int, Any] = {}           # mb -> the last stage's loss function
        self.losses: dict[int, dict] = {}
        self.embedding, self.first_rank, self.first_rank_global = embedding, first_rank, first_rank_global
        self.partials: list = []                       # this rank's embedding partials (their graphs)
        self.embedded: Optional[torch.Tensor] = None   # the first stage: the embedding outputs, (m, s, b, h)
        self.grad_like: Optional[dict] = None         # the other ranks: their shape, dtype and device
        self.embedding_grads: dict[int, torch.Tensor] = {}
        self.wait_s = 0.0          # seconds blocked in this step's collectives (not compute: the timers' idle)

    def embed(self, forward_step_func: Any, data_iterator: Any, num_microbatches: int, keep_graph: bool) -> None:
        """Before the first action: every rank's partial embeddings of the step's microbatches, summed over the
        pipeline onto the first stage's rank (one reduce); the sum is what the first stage's F takes."""
        if self.embedding is None:
            return
        prepass = EmbeddingPrepass(self.embedding)
        self.partials = [forward_step_func(data_iterator, prepass)[0] for _ in range(num_microbatches)]
        total = torch.stack([p.detach() for p in self.partials])
        with self._collective("the vocabulary-parallel embedding's reduce"):
            dist.reduce(total, dst=self.first_rank_global, group=self.group)
        like = dict(size=total.shape, dtype=total.dtype, device=total.device)
        self.embedded, self.grad_like = (total, None) if self.first_rank else (None, like)
        if not keep_graph:
            self.partials, self.grad_like = [], None

    def embedding_backward(self) -> None:
        """After the last action: the first stage's input gradients to every rank, each shard's backward."""
        if self.embedding is None or not self.partials:
            return
        if self.first_rank:
            grads = torch.stack([self.embedding_grads.pop(mb) for mb in range(len(self.partials))])
        else:
            grads = torch.empty(**self.grad_like)
        with self._collective("the vocabulary-parallel embedding's gradient broadcast"):
            dist.broadcast(grads, src=self.first_rank_global, group=self.group)
        torch.autograd.backward(self.partials, list(grads.unbind(0)))
        self.partials, self.embedded, self.grad_like = [], None, None

    def stats(self, mb: int, hidden: torch.Tensor, targets: torch.Tensor) -> None:
        """S: this shard's statistics of microbatch `mb`; their all-gather over the pipeline starts here."""
        labels, mask = targets[0].long().t(), targets[1].float().t()       # (s, b)
        state, stats = self.output(hidden, labels)
        state["mask"] = mask
        self.states[mb] = state
        stats = stats.contiguous()
        parts = [torch.empty_like(stats) for _ in range(self.pp_size)]
        work = dist.all_gather(parts, stats, group=self.group, async_op=True)
        self.gathers[mb] = (work, parts)

    def _gathered(self, mb: int) -> torch.Tensor:
        work, parts = self.gathers.pop(mb)
        with self._collective(f"the vocabulary-parallel output layer's all-gather of mb {mb}"):
            work.wait()
        return torch.stack(parts)                                          # (pp, 3, s, b)

    @contextmanager
    def _collective(self, what: str) -> Iterator[None]:
        """Blocked in a collective over the group: the seconds count as waiting, and a hang report names the
        ranks that did not join it (`position.waiting`)."""
        start = time.perf_counter()
        with waiting(what, dist.get_process_group_ranks(self.group), collective=True):
            yield
        self.wait_s += time.perf_counter() - start

    def grad(self, mb: int) -> torch.Tensor:
        """T: the combined loss's gradient through this shard; returns the partial input gradient."""
        stats, state = self._gathered(mb), self.states.pop(mb)
        if self.last_rank:
            self._record_loss(mb, stats)
        grad_loss = state["mask"].to(stats.device) * self.loss_scale        # d loss_sum / d token loss
        return self.output.backward(state, stats, grad_loss)

    def _record_loss(self, mb: int, stats: torch.Tensor) -> None:
        loss = PipelineVocabOutput.combine(stats)[2]                        # (s, b)
        loss_sum, num_tokens, log = self.loss_funcs.pop(mb)(loss.t())
        self.losses[mb] = {"loss_sum": loss_sum.detach().float(), "num_tokens": num_tokens, "log": log}

    def finish(self) -> None:
        """End of step: a forward-only step's losses from the statistics its S gathered; nothing left over."""
        for mb in sorted(self.gathers):
            stats = self._gathered(mb)
            self.states.pop(mb)
            if self.last_rank:
                self._record_loss(mb, stats)
        assert not self.states and not self.loss_funcs, "vocabulary actions left unfinished at step end"

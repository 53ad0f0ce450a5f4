"""Tied input embedding and output layer across the pipeline: two copies kept equal (Megatron-LM's shared embedding).

With tied weights the embedding (first stage) and the output layer (last stage) are one matrix. When the two
stages are in one chunk the chunk uses one parameter; otherwise the last stage's chunk holds a copy, its output
layer's weight, marked here (`mark_tied`), and the copies stay equal as Megatron keeps them
(`finalize_model_grads` -> `_allreduce_embedding_grads`):

- they start equal: the copy is initialised, checkpointed and loaded under the embedding's logical name
  (`TIED_TO`, "embedding.weight"), so every layout reads and writes one tensor;
- after the step's DP reduction (after the last W: the output layer's weight gradient is deferred to W under the
  zero-bubble schedules) each copy's gradient becomes the sum of both (`grad_reduce.sum_tied_grads`): an all-reduce over the
  embedding group (first and last pipeline rank) when the two stages are on different ranks, a local sum when
  one rank holds both (the V placements: ZB-V, V-Half, V-Min, DualPipeV, two-chunk auto), so no message at all;
- the optimizer then applies the same update to the same values, so they stay equal bit for bit (AdamW is
  elementwise); the copy is `shared`, so the gradient norm and the parameter norm count the matrix once.

Under ZeRO-2/3 the sum runs on this rank's FSDP shards of the two gradients, which hold the same rows (both are
the padded vocabulary's TP shard, sharded over the same DP group). Under vocabulary parallelism there is no copy:
the output layer's vocabulary shard and the embedding's are one parameter per rank.
"""
from __future__ import annotations

import torch
from torch import nn

TIED = "tied_embedding"      # on both copies: their gradients are summed at the step's end
TIED_TO = "tied_to"          # on the copy: the logical name of the tensor it holds (init, checkpoints)
EMBEDDING = "embedding.weight"


def mark_tied(weight: nn.Parameter, *, copy: bool) -> None:
    """Mark one of the two copies; `copy`: the output layer's (not counted in norms, stored as the embedding)."""
    setattr(weight, TIED, True)
    if copy:
        weight.shared = True     # clip_grads.counts_for_norm: one copy counts
        setattr(weight, TIED_TO, EMBEDDING)


def logical_name(name: str, tensor: torch.Tensor) -> str:
    """The logical name a parameter's value is initialised, saved and loaded under."""
    return getattr(tensor, TIED_TO, name)


def is_copy(tensor: torch.Tensor) -> bool:
    return hasattr(tensor, TIED_TO)


def tied_params(model_chunks: list[nn.Module]) -> list[nn.Parameter]:
    """This rank's marked copies, in chunk order: none, one (the first or the last stage) or both (V placement)."""
    return [p for chunk in model_chunks for p in chunk.parameters() if getattr(p, TIED, False)]

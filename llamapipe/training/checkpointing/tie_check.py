"""Before a save: the tied embedding's two copies must be equal, since a checkpoint stores them once.

With tied embeddings across the pipeline the first stage's embedding and the last stage's output weight are two
copies kept equal by summing their gradients (core/distributed/tied_embeddings.py), and a checkpoint stores the
embedding alone, which both copies load on resume. So a copy that drifted (the bug other frameworks shipped: two
stages' embeddings apart after a resume) would be lost silently; `check_tie` compares them bit for bit first
(one all-gather of the copy between the first and the last stage, or a local comparison under the V placements,
where one rank holds both) and stops the save with one line when they differ.
"""
from __future__ import annotations

from torch import nn

from llamapipe.core.distributed.grad_reduce import tied_copies_equal
from llamapipe.core.logger import get_logger
from llamapipe.core.parallel_state import ParallelState
from llamapipe.training.checkpointing.writer import CheckpointSaveError


def check_tie(model_chunks: list[nn.Module], ps: ParallelState, iteration: int) -> None:
    """Raise CheckpointSaveError on every rank when the copies differ; log that they are equal when there are
    copies (collective over the world)."""
    equal = tied_copies_equal(model_chunks, ps)
    if equal is False:
        raise CheckpointSaveError(f"iteration {iteration}: the tied embedding's copies on the first and the last "
                                  "pipeline stage differ, so the checkpoint would not hold the trained model")
    if equal:
        get_logger().info(f"iteration {iteration}: the tied embedding's copies on the first and the last pipeline "
                          "stage are equal bit for bit")

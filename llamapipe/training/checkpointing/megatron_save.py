"""`--ckpt-format torch_dist` (Megatron-LM's flag): every save of a run also writes a Megatron-LM copy (issue 49).

Layout of `--save DIR`:
  DIR/latest_checkpointed_iteration.txt   Megatron's tracker
  DIR/iter_XXXXXXX/                       Megatron's torch_dist directory: .metadata, __0_*.distcp, common.pt
                                          (args, iteration), metadata.json; megatron-core's dist_checkpointing.load
                                          reads it into GPTModel's sharded state dict at any TP/PP
  DIR/llamapipe/                          our own checkpoints (--save is this directory for the rest of the run:
                                          lock, history, --keep-last-n, restart records), with the optimizer
                                          state, the LR schedule and the RNG states
Both cannot share one iter directory: each format names its manifest metadata.json (megatron-core builds its
CheckpointingConfig from its own), and the trackers share a name. `--load DIR` resumes from DIR/llamapipe
(megatron_resume.source), so nothing of ours is lost; Megatron-LM takes `--load DIR` with `--no-load-optim`
(the copy holds the weights, iteration and consumed samples, not its optimizer's state).

The copy is written after our checkpoint is committed (an --async-save is waited for first) by rank 0, which
reads the committed checkpoint whole (convert_megatron.export_megatron); every rank gets its error.
"""
from __future__ import annotations

import os
import shutil
from typing import Optional

from llamapipe.core.logger import get_logger
from llamapipe.training.checkpointing import catalog
from llamapipe.training.checkpointing.writer import CheckpointSaveError, finalize_async_save


def write_megatron_copy(megatron_dir: str, ours: str, rank: int, keep_last_n: Optional[int]) -> None:
    """Write the committed checkpoint `ours` as DIR/iter_X of Megatron save directory `megatron_dir`; collective."""
    from llamapipe.training.checkpointing.save_load import _barrier, _from_rank0
    finalize_async_save()           # the copy reads the committed checkpoint
    error = None
    if rank == 0:
        try:
            from llamapipe.training.checkpointing.megatron_write import export_megatron
            out = export_megatron(ours, megatron_dir, replace=True)
            if keep_last_n is not None:
                prune_copies(megatron_dir, os.path.dirname(ours))
            get_logger().info(f"--ckpt-format torch_dist: wrote Megatron-LM checkpoint {out}")
        except (ValueError, OSError) as exc:
            error = f"--ckpt-format torch_dist: writing the Megatron-LM copy of {ours} failed ({exc})"
    error = _from_rank0(error)
    if error is not None:
        raise CheckpointSaveError(error)
    _barrier()


def prune_copies(megatron_dir: str, ours_dir: str) -> list[int]:
    """Remove the Megatron copies this writer made whose checkpoint of ours --keep-last-n removed; a Megatron
    run's own iter_* directories (no `exported_from` in their args) stay."""
    from llamapipe.training.checkpointing.megatron_format import load_common
    kept = set(catalog.list_iterations(ours_dir))
    removed = []
    for iteration in catalog.list_iterations(megatron_dir):
        path = catalog.iter_dir(megatron_dir, iteration)
        common = os.path.join(path, "common.pt")
        if iteration in kept or not os.path.isfile(common):
            continue
        if getattr(load_common(common).get("args"), "exported_from", None) is None:
            continue
        shutil.rmtree(path)
        removed.append(iteration)
    return removed

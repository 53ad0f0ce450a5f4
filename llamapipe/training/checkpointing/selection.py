"""Which checkpoint of --load a run resumes from: the newest one whose every file passes its checksum.

Collective: rank 0 lists the candidates (newest first, with the defect of each that fails the cheap
completeness check) and every rank takes its word; then each candidate's files are verified in parallel,
every file by one rank (the rank that wrote it when the layout is unchanged, as it reads that file anyway),
so a large checkpoint costs no extra full read on any one rank. A defective candidate is skipped with a
warning naming the file; a directory that holds checkpoints of which none is usable is an error (one line
naming each and its defect), never a silent fresh start.
"""
from __future__ import annotations

import os
from typing import Optional

import torch

from llamapipe.core.logger import get_logger
from llamapipe.training.checkpointing import catalog
from llamapipe.training.checkpointing.integrity import assign_files, verify_files


def _dist() -> bool:
    return torch.distributed.is_available() and torch.distributed.is_initialized()


def _rank_world() -> tuple[int, int]:
    return (torch.distributed.get_rank(), torch.distributed.get_world_size()) if _dist() else (0, 1)


def scan(load_dir: str) -> list[tuple[int, Optional[str]]]:
    """Every committed checkpoint of `load_dir`, newest first, with its completeness defect (None: complete)."""
    return [(i, catalog.incomplete_reason(catalog.iter_dir(load_dir, i)))
            for i in reversed(catalog.list_iterations(load_dir))]


def _from_rank0(value: object) -> object:
    if _dist():
        box = [value]
        torch.distributed.broadcast_object_list(box, src=0)
        return box[0]
    return value


def _first_defect(local: Optional[str]) -> Optional[str]:
    if _dist():
        out: list[Optional[str]] = [None] * torch.distributed.get_world_size()
        torch.distributed.all_gather_object(out, local)
        return next((d for d in out if d is not None), None)
    return local


def same_layout(saved: Optional[dict], now: Optional[dict]) -> bool:
    """Whether a checkpoint's recorded layout is this run's: an axis it does not record (cp, before context
    parallelism) had size 1, and its order string gains that axis where full_order puts it (tp-dp-pp is
    tp-cp-dp-pp)."""
    from llamapipe.core.parallel_state import AXES, full_order

    def normal(layout: dict) -> dict:
        return {**{axis: 1 for axis in AXES}, **layout, "order": full_order(layout.get("order", "tp-dp-pp"))}
    return saved is not None and now is not None and normal(saved) == normal(now)


def verify_share(ckpt_dir: str, layout: Optional[dict]) -> Optional[str]:
    """This rank's part of verifying `ckpt_dir` (its files' sizes and checksums); the first defect or None."""
    rank, world = _rank_world()
    try:
        meta = catalog.read_metadata(ckpt_dir)
    except (OSError, ValueError):
        return f"metadata.json is unreadable on rank {rank}"
    owner = assign_files(meta["files"], world, same_layout=same_layout(meta.get("layout"), layout))
    return verify_files(ckpt_dir, meta["files"], {f for f, r in owner.items() if r == rank})


def choose_checkpoint(load_dir: str, layout: Optional[dict] = None, *, verify: bool = True) -> Optional[tuple[int, str]]:
    """(iteration, path) of the newest verified checkpoint; None when `load_dir` holds no checkpoint at all.

    Raises ValueError when it holds checkpoints but none is usable. `layout` (the run's tp/pp/vpp/dp/order)
    decides whether each file is verified by the rank that wrote it. `verify=False` (the dry run, which reads no
    tensor data) takes the newest complete one, its files' sizes checked but not their checksums.
    """
    rank, _ = _rank_world()
    candidates = _from_rank0(scan(load_dir) if rank == 0 else None)
    skipped: list[str] = []
    for iteration, defect in candidates:
        path = catalog.iter_dir(load_dir, iteration)
        if defect is None and verify:
            defect = _first_defect(verify_share(path, layout))
        if defect is None:
            if skipped and rank == 0:
                get_logger().warning(f"loading {path}, the newest checkpoint that verifies; skipped newer "
                                     f"checkpoints: {'; '.join(skipped)}")
            elif not skipped:
                _warn_tracker(load_dir, iteration, rank)
            return iteration, path
        skipped.append(f"{os.path.basename(path)} ({defect})")
    if not candidates:
        return None
    raise ValueError(unusable(load_dir, skipped))


def unusable(load_dir: str, skipped: list[str]) -> str:
    """The one line for a --load whose checkpoints are all unusable (`skipped`: 'iter_X (why)' each); a
    Megatron-LM save directory is named as one (training imports it as it loads, megatron_resume.py; what reads
    only our checkpoints, the dry run, says how to convert it)."""
    if is_megatron_save(load_dir):
        return (f"--load {load_dir} is a Megatron-LM save directory, which training imports as it loads but this "
                f"reads only llamapipe checkpoints; convert it with `llamapipe convert-megatron import --load "
                f"{load_dir} --save NEW_DIR` and give --load NEW_DIR (docs/megatron_checkpoints.md)")
    return (f"--load {load_dir} holds checkpoints but none is usable: {'; '.join(skipped)}; repair or remove them, "
            "or point --load elsewhere")


def is_megatron_save(load_dir: str) -> bool:
    """Whether an iter_* directory of `load_dir` holds a Megatron-LM checkpoint (torch_dist's .metadata and
    common.pt, or legacy mp_rank_* folders) rather than one of ours."""
    try:
        names = [n for n in os.listdir(load_dir) if n.startswith("iter_")]
        for name in names:
            inside = os.listdir(os.path.join(load_dir, name))
            if ".metadata" in inside or any(n.startswith("mp_rank_") for n in inside):
                return True
    except OSError:
        return False
    return False


def _warn_tracker(load_dir: str, iteration: int, rank: int) -> None:
    tracked = catalog.read_tracker(load_dir)
    if rank == 0 and tracked is not None and tracked != iteration:
        # issue 51: an import or a fresh run that moved the tracker back was silently undone by this choice
        why = (f"; to resume iteration {tracked}, move the newer iter_* directories away" if tracked < iteration
               else f" (there is no iteration {tracked})")
        get_logger().warning(f"warning: {load_dir}/{catalog.TRACKER} names iteration {tracked}, but loading "
                             f"iteration {iteration}: the newest checkpoint that verifies is the one resumed{why}")

"""One history per --save directory (issue 51): a writer that does not resume a directory's checkpoints does
not write among them.

A fresh run (no --load, or --load of another directory) into a --save that already holds an earlier run's
`iter_*` checkpoints overwrote some of them and left the newer ones beside its own, so a later `--load` resumed
the earlier run's stale iteration; `convert-hf import` into such a directory moved the tracker to 0 while the
loader still took the newest iteration. Both now refuse in one line naming --save, its newest iteration and the
ways out: resume it (`--load` the same directory), choose another `--save`, or give `--overwrite-save`, which
deletes the earlier checkpoints (and the tracker) first, with a warning naming them, so the histories do not mix.
Called with the --save lock held (`save_lock`), so no other writer is in the directory meanwhile.
"""
from __future__ import annotations

import contextlib
import os
import shutil
from typing import Optional

from llamapipe.core.logger import get_logger
from llamapipe.training.checkpointing import catalog

OVERWRITE_FLAG = "--overwrite-save"


def _same_dir(a: Optional[str], b: str) -> bool:
    """Whether --load `a` resumes --save `b`: the same directory, or `b` is `a`'s own checkpoints inside a
    --ckpt-format torch_dist directory."""
    return a is not None and os.path.realpath(b) in (os.path.realpath(a), os.path.realpath(os.path.join(a, catalog.OURS)))


def check_history(save_dir: str, load_dir: Optional[str], overwrite: bool, *, resume_hint: bool = True) -> None:
    """Raise ValueError (one line) when `save_dir` holds checkpoints that this writer would not continue (it does
    not --load `save_dir`); with `overwrite`, delete them instead, with a warning."""
    iterations = catalog.list_iterations(save_dir)
    if not iterations or _same_dir(load_dir, save_dir):
        return
    if overwrite:
        clear_history(save_dir, iterations)
        return
    resume = f"--load {save_dir} to resume it, " if resume_hint else ""
    loading = f" (--load is {load_dir})" if load_dir is not None else ""
    raise ValueError(f"--save {save_dir} already holds {len(iterations)} checkpoint(s) of an earlier run, the newest "
                     f"iteration {iterations[-1]}{loading}; give {resume}another --save, or {OVERWRITE_FLAG} to delete "
                     "them first (mixing two runs' checkpoints would make a later --load resume the wrong one)")


def clear_history(save_dir: str, iterations: list[int]) -> None:
    """Delete the earlier run's `iter_*` directories and its tracker (a link at either is removed, not followed)."""
    for iteration in iterations:
        path = catalog.iter_dir(save_dir, iteration)
        if os.path.islink(path):
            os.remove(path)
        else:
            shutil.rmtree(path)
    with contextlib.suppress(FileNotFoundError):
        os.remove(os.path.join(save_dir, catalog.TRACKER))
    get_logger().warning(f"warning: {OVERWRITE_FLAG}: deleted {len(iterations)} checkpoint(s) of an earlier run "
                         f"from --save {save_dir} (iterations {iterations[0]}-{iterations[-1]})")

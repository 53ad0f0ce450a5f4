"""The checkpoints of a directory: which exist, which are complete, the atomic commit and the tracker,
and pruning by --keep-last-n.

A checkpoint is committed by renaming `iter_XXXXXXX.tmp/` to `iter_XXXXXXX/` once metadata.json (with
every file's size and checksum) is fsynced; the tracker `latest_checkpointed_iteration.txt` is replaced
after that. Its new content is written to a side file *before* the rename, so a full disk fails the save
while the previous checkpoint is still the one the tracker names. Completeness here is the cheap check
(metadata readable, every file present with its recorded size); checksums are verified on load
(`selection.py`) and by `llamapipe verify-checkpoint`.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
from typing import Any, Optional

from llamapipe.core.logger import get_logger
from llamapipe.safe_files import UnsafePathError, check_target, clear_leftover, create_new, read_regular

FORMAT_VERSION = 2          # 2: files carry sha256 checksums; 1 (sizes only) still loads
READABLE_VERSIONS = (1, 2)
METADATA = "metadata.json"
TRACKER = "latest_checkpointed_iteration.txt"
OURS = "llamapipe"   # our checkpoints inside a --ckpt-format torch_dist save directory (megatron_save.py)
_ITER_DIR = re.compile(r"^iter_(\d{7,})$")
_TMP_DIR = re.compile(r"^iter_(\d{7,})\.tmp$")


def iter_dir(save_dir: str, iteration: int) -> str:
    return os.path.join(save_dir, f"iter_{iteration:07d}")


def fsync_path(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def read_metadata(ckpt_dir: str) -> dict:
    return json.loads(read_regular(os.path.join(ckpt_dir, METADATA)))


def _digest(meta: dict) -> str:
    body = {k: v for k, v in meta.items() if k != "metadata_sha256"}
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()


def seal(meta: dict) -> dict:
    """`meta` with its own checksum (over everything else in it), so a changed byte in metadata.json shows."""
    plain = json.loads(json.dumps(meta))     # what a reader will see (tuples as lists, keys as strings)
    return {**plain, "metadata_sha256": _digest(plain)}


# What the loader reads from metadata.json, by type (beyond "files" and "tensors", checked in detail).
_FIELDS = {"iteration": int, "consumed_samples": int, "model_config": dict, "layout": dict, "has_optimizer": bool,
           "scheduler": (dict, type(None))}


def checked_metadata(ckpt_dir: str) -> tuple[Optional[dict], Optional[str]]:
    """(metadata, None) when metadata.json is one the loader can use, else (None, why not: one phrase naming
    metadata.json). The one check of the metadata: loading and `llamapipe verify-checkpoint` both call it, so
    they cannot disagree about a checkpoint."""
    try:
        meta = read_metadata(ckpt_dir)
    except UnsafePathError as err:
        return None, f"metadata.json is {err.kind}, not a regular file"
    except (OSError, ValueError):
        return None, "metadata.json is missing or unreadable"
    if not isinstance(meta, dict) or meta.get("format_version") not in READABLE_VERSIONS:
        version = meta.get("format_version") if isinstance(meta, dict) else None
        return None, f"metadata.json has format version {version}, not one of {READABLE_VERSIONS}"
    if meta["format_version"] >= 2 and meta.get("metadata_sha256") != _digest(meta):
        return None, "metadata.json fails its sha256 checksum (its bytes changed after it was written)"
    defect = _structure_defect(meta)
    return (None, f"metadata.json {defect}") if defect else (meta, None)


def _structure_defect(meta: dict) -> Optional[str]:
    """What is missing or malformed in a sealed metadata.json (e.g. edited and re-sealed by hand), or None."""
    for key, kind in {**_FIELDS, "files": dict, "tensors": dict}.items():
        if not isinstance(meta.get(key), kind) or (kind is int and isinstance(meta[key], bool)):
            return f"has no valid '{key}'"
    for fname, record in meta["files"].items():
        if os.path.basename(fname) != fname or fname in ("", ".", "..", METADATA):
            return f"lists {fname!r}, which is not a file name inside the checkpoint"
        if not _record_ok(record, checksummed=meta["format_version"] >= 2):
            return f"has no valid size{' and sha256' if meta['format_version'] >= 2 else ''} for {fname}"
    for key, entry in meta["tensors"].items():
        shards = entry.get("shards") if isinstance(entry, dict) else None
        if not isinstance(shards, dict) or not shards or not isinstance(entry.get("shape"), list):
            return f"has no valid shards and shape for tensor {key}"
        unlisted = sorted(set(shards.values()) - set(meta["files"]))
        if unlisted:
            return f"names {unlisted[0]} for tensor {key} but does not list that file (so it was never verified)"
    return None


def _record_ok(record: Any, checksummed: bool) -> bool:
    """Format 2: {"size", "sha256", "rank"}; format 1: the size alone."""
    if checksummed:
        return isinstance(record, dict) and _is_count(record.get("size")) and isinstance(record.get("sha256"), str)
    return _is_count(record)


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def incomplete_reason(ckpt_dir: str) -> Optional[str]:
    """None when `ckpt_dir` is a complete checkpoint (sizes only, no checksums), else why not (one phrase)."""
    from llamapipe.training.checkpointing.integrity import file_defect
    meta, defect = checked_metadata(ckpt_dir)
    if meta is None:
        return defect
    for fname, record in sorted(meta["files"].items()):
        defect = file_defect(ckpt_dir, fname, record, checksum=False)
        if defect is not None:
            return defect
    return None


def list_iterations(save_dir: str) -> list[int]:
    """Iterations of all committed (renamed) checkpoint dirs, ascending; complete or not."""
    if not os.path.isdir(save_dir):
        return []
    found = (_ITER_DIR.match(name) for name in os.listdir(save_dir))
    return sorted(int(m.group(1)) for m in found if m)


def read_tracker(save_dir: str) -> Optional[int]:
    """The iteration the tracker names; None when there is none, or it is unreadable or not a regular file (a
    FIFO there must not hang the reader: it is named in a warning and ignored)."""
    try:
        return int(read_regular(os.path.join(save_dir, TRACKER)).decode().strip())
    except UnsafePathError as err:
        get_logger().warning(f"{err}; ignored (the newest complete checkpoint is used)")
    except (OSError, ValueError):
        pass
    return None


def commit(tmp_dir: str, save_dir: str, iteration: int) -> str:
    """Rename the finished tmp dir into place, then point the tracker at it (both atomic)."""
    final, tracker = iter_dir(save_dir, iteration), os.path.join(save_dir, TRACKER)
    side = tracker + ".tmp"
    check_target(final, directory=True)     # a link planted at either name is refused, its target untouched
    check_target(tracker)
    clear_leftover(side)
    try:
        with create_new(side, "w") as fh:   # the only write of the commit: a full disk fails here, before the rename
            fh.write(f"{iteration}\n")
            fh.flush()
            os.fsync(fh.fileno())
    except OSError:
        clear_leftover(side)
        raise
    if os.path.exists(final):  # re-saving an iteration: the old copy goes only once the new one is whole
        shutil.rmtree(final)
    os.replace(tmp_dir, final)
    fsync_path(save_dir)
    check_target(tracker)
    os.replace(side, tracker)
    fsync_path(save_dir)
    return final


def latest_checkpoint(load_dir: str) -> Optional[tuple[int, str]]:
    """Newest complete checkpoint as (iteration, path), by the cheap check; incomplete newer ones are skipped
    with a warning. Loading for training verifies checksums too (selection.choose_checkpoint)."""
    log = get_logger()
    for iteration in reversed(list_iterations(load_dir)):
        path = iter_dir(load_dir, iteration)
        reason = incomplete_reason(path)
        if reason is None:
            tracked = read_tracker(load_dir)
            if tracked is not None and tracked != iteration:
                log.warning(f"{load_dir}/{TRACKER} names iteration {tracked}; using the newest complete "
                            f"checkpoint {path}")
            return iteration, path
        log.warning(f"skipping incomplete checkpoint {path}: {reason}")
    return None


def prune(save_dir: str, keep_last_n: int, saved: int) -> list[int]:
    """Delete complete checkpoints older than `saved` (just committed and verified) beyond the newest
    `keep_last_n` (counting `saved`); returns the deleted iterations.

    Newer checkpoints (left by an earlier run) are never touched, so the newest valid checkpoint is either
    `saved` or newer than it, and survives in both cases.
    """
    older = [i for i in list_iterations(save_dir)
             if i < saved and incomplete_reason(iter_dir(save_dir, i)) is None]
    doomed = older[:len(older) - max(keep_last_n - 1, 0)]
    deleted = []
    for iteration in doomed:    # one entry that cannot go is named and kept; the rest are still pruned (issue 51)
        path = iter_dir(save_dir, iteration)
        try:
            if os.path.islink(path):
                raise OSError(f"{path} is a symbolic link, not a checkpoint directory of this run; pruning "
                              "removes neither it nor its target (remove the link yourself)")
            shutil.rmtree(path)
        except OSError as err:
            get_logger().warning(f"--keep-last-n {keep_last_n}: kept {path}: {err}")
            continue
        deleted.append(iteration)
    return deleted


def remove_stale_tmp(save_dir: str) -> None:
    """Leftovers of saves that crashed (no save runs while this is called)."""
    for name in os.listdir(save_dir) if os.path.isdir(save_dir) else ():
        if _TMP_DIR.match(name):
            remove_tmp_dir(os.path.join(save_dir, name))


def remove_tmp_dir(tmp: str) -> None:
    """Remove a save's temporary directory; a link planted at its name is removed, its target untouched."""
    if os.path.islink(tmp):
        os.remove(tmp)
    else:
        shutil.rmtree(tmp, ignore_errors=True)

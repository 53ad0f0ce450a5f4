"""The save job: each rank writes its files into `iter_XXXXXXX.tmp/`, reads every one back against the
checksum it had while writing, and leaves a marker holding its files' records; rank 0 commits once every
rank's marker is there. Runs inline (synchronous save) or on a background thread (--async-save, Megatron's
flag): the training loop then only pays for copying the state to CPU.

`finalize_async_save()` is the one collective: it waits for this process's job, agrees with the other ranks
on whether every rank succeeded, and raises `CheckpointSaveError` (one line) everywhere if one did not.
The loop calls it before the next save and on every exit path. A crash or SIGKILL before the commit leaves
`iter_XXXXXXX.tmp/` behind and the previous checkpoint as the one that loads.
"""
from __future__ import annotations

import errno
import json
import os
import shutil
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch

from llamapipe.fault_injection import kill_at
from llamapipe.core.logger import get_logger
from llamapipe.safe_files import create_new
from llamapipe.training.checkpointing import catalog
from llamapipe.training.checkpointing.integrity import HASH, file_digest, write_json

_POLL_S = 0.05


class CheckpointSaveError(RuntimeError):
    """A save failed on some rank (e.g. a full disk); the message is one line naming the file and the cause."""


@dataclass
class FileJob:
    """One file to write: `write(path, rank)` writes it and returns its checksum record."""
    name: str
    write: Callable[[str, int], dict]


@dataclass
class SaveJob:
    save_dir: str
    iteration: int
    rank: int
    world_size: int
    files: list[FileJob]
    meta: Optional[Callable[[dict], None]] = None     # rank 0: writes metadata.json from the merged records
    keep_last_n: Optional[int] = None
    background: bool = False
    write_error: Optional[str] = None
    commit_error: Optional[str] = None
    written: threading.Event = field(default_factory=threading.Event)
    committed: threading.Event = field(default_factory=threading.Event)
    abort: threading.Event = field(default_factory=threading.Event)

    @property
    def tmp(self) -> str:
        return catalog.iter_dir(self.save_dir, self.iteration) + ".tmp"

    def run(self) -> None:
        """Write and verify this rank's files; in the background, rank 0 goes on to commit."""
        try:
            self.write_error = self._write_own()
        finally:
            self.written.set()
        if self.rank == 0 and self.background:
            if self.write_error is None:
                self.commit()
            else:
                self.committed.set()

    def _write_own(self) -> Optional[str]:
        records: dict[str, dict] = {}
        current = "the rank marker"
        try:
            for job in self.files:
                current = job.name
                path = os.path.join(self.tmp, job.name)
                records[job.name] = job.write(path, self.rank)
                kill_at("save", self.iteration)     # a test's failure mid-save (fault_injection)
                if file_digest(path) != records[job.name][HASH]:
                    return self._failed(f"{job.name} reads back different bytes than were written")
            current = "the rank marker"
            _write_marker(self.tmp, self.rank, records)
        except Exception as exc:  # noqa: BLE001  (any failure must reach finalize, or the other ranks wait)
            return self._failed(f"writing {current} failed: {_os_error(exc)}")
        return None

    def _failed(self, what: str) -> str:
        previous = catalog.read_tracker(self.save_dir)
        kept = f"iteration {previous} is still the checkpoint that loads" if previous is not None else \
            "no earlier checkpoint was committed"
        message = (f"saving checkpoint {catalog.iter_dir(self.save_dir, self.iteration)} on rank {self.rank}: "
                   f"{what}; {kept}")
        try:  # tell rank 0's commit wait at once; on a full disk this may fail too, finalize then tells it
            with create_new(os.path.join(self.tmp, f".failed_rank{self.rank:05d}"), "w") as fh:
                fh.write(message)
        except OSError:
            pass
        return message

    def commit(self) -> None:
        """Rank 0: wait for every rank's marker, write metadata.json, rename, tracker, prune."""
        try:
            records = self._wait_for_markers()
            if records is None:
                return
            for rank in range(self.world_size):
                os.remove(_marker_path(self.tmp, rank))
            self.meta(records)
            final = catalog.commit(self.tmp, self.save_dir, self.iteration)
            get_logger().info(f"saved checkpoint {final} (iteration {self.iteration}, {len(records)} files verified)")
        except Exception as exc:  # noqa: BLE001  (any failure must reach finalize, or the other ranks wait)
            self.commit_error = self._failed(f"committing failed: {_os_error(exc)}")
            return
        finally:
            self.committed.set()
        if self.keep_last_n is not None:
            try:
                catalog.prune(self.save_dir, self.keep_last_n, self.iteration)
            except OSError as exc:
                get_logger().warning(f"--keep-last-n {self.keep_last_n}: pruning {self.save_dir} failed: {exc}")

    def _wait_for_markers(self) -> Optional[dict[str, dict]]:
        records: dict[str, dict] = {}
        for rank in range(self.world_size):
            path = _marker_path(self.tmp, rank)
            while not os.path.exists(path):
                if self.abort.is_set() or any(n.startswith(".failed_rank") for n in os.listdir(self.tmp)):
                    return None
                time.sleep(_POLL_S)
            with open(path) as fh:
                records.update(json.load(fh))
        return records


def _marker_path(tmp: str, rank: int) -> str:
    return os.path.join(tmp, f".done_rank{rank:05d}.json")


def _write_marker(tmp: str, rank: int, records: dict) -> None:
    """Atomically (`write_json`), so rank 0 never reads half a marker."""
    write_json(_marker_path(tmp, rank), records)


def _os_error(exc: Exception) -> str:
    if not isinstance(exc, OSError):
        return f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}"
    name = errno.errorcode.get(exc.errno, "") if exc.errno else ""
    return f"{exc.strerror or exc} ({name})" if name else str(exc)


_pending: Optional[SaveJob] = None


def start(job: SaveJob) -> None:
    """Run `job` inline and finalize it (synchronous save), or on a background thread. The thread is not a
    daemon, so a process that exits without finalizing still finishes writing first."""
    global _pending
    _pending = job
    if not job.background:
        job.run()
        finalize_async_save()
        return
    threading.Thread(target=job.run, name=f"checkpoint-save-{job.iteration}", daemon=False).start()


def _gather(value: Optional[str]) -> list[Optional[str]]:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        out: list[Optional[str]] = [None] * torch.distributed.get_world_size()
        torch.distributed.all_gather_object(out, value)
        return out
    return [value]


def finalize_async_save() -> None:
    """Wait for this process's pending save (if any), agree across ranks, raise CheckpointSaveError if any rank
    failed. Collective when a save is pending (every rank has one then); a no-op otherwise."""
    global _pending
    job, _pending = _pending, None
    if job is None:
        return
    job.written.wait()
    errors = [e for e in _gather(job.write_error) if e is not None]
    if errors:
        job.abort.set()
        if job.rank == 0:
            if job.background:
                job.committed.wait()
            shutil.rmtree(job.tmp, ignore_errors=True)   # free the space; the previous checkpoint stays
        raise CheckpointSaveError(errors[0])
    if job.rank == 0:
        if job.background:
            job.committed.wait()
        else:
            job.commit()
    commit_error = _gather(job.commit_error if job.rank == 0 else None)[0]
    if commit_error is not None:
        if job.rank == 0:
            shutil.rmtree(job.tmp, ignore_errors=True)
        raise CheckpointSaveError(commit_error)


def pending_iteration() -> Optional[int]:
    """Iteration of the save not yet finalized in this process, if any."""
    return _pending.iteration if _pending is not None else None

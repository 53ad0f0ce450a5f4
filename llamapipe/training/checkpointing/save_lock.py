"""One run per --save directory: rank 0 holds `DIR/llamapipe.lock` from before anything is loaded until exit.

Two runs saving into one directory overwrite each other's checkpoints and prune each other's files, so the
second refuses to start, in one line naming the first (host, pid, since when). The file holds that record
as JSON and is `flock`ed while held: the kernel drops the flock when its process dies, even by SIGKILL, so on
the same host a lock whose process is gone is recognised and taken over with a notice. A lock from another
host cannot be checked from here (flock is not reliable across hosts on network filesystems): the run
refuses and says which file to remove once that run is known to be gone. The lock is released (the file
removed) at every exit: the normal end, errors (atexit), and a signal that stops the run (`training/signals`
calls `release_all`; a process of its own that holds a lock releases it on SIGTERM, handler below). The file is opened without following a
link (`llamapipe/safe_files.open_existing`): a symbolic link, FIFO or directory planted at its name is refused in
one line and its target is untouched. Checkpoint listing, verification,
pruning and --load of the same directory ignore the file (they read only `iter_*` and the tracker).
"""
from __future__ import annotations

import atexit
import errno
import fcntl
import json
import os
import signal
import socket
import threading
import time
from typing import Any, Optional

from llamapipe.core.logger import get_logger
from llamapipe.safe_files import UnsafePathError, check_target, open_existing, pid_alive
from llamapipe.training.checkpointing.catalog import TRACKER

LOCK_FILE = "llamapipe.lock"
_held: dict[str, "SaveDirLock"] = {}     # realpath of the directory -> this process's lock on it


class SaveDirLock:
    """This process's hold on one directory; `release()` is idempotent."""

    def __init__(self, path: str, fd: Optional[int]) -> None:
        self.path, self._fd = path, fd

    def release(self) -> None:
        if self._fd is None:
            return
        try:
            if os.stat(self.path).st_ino == os.fstat(self._fd).st_ino:    # still our file, not a successor's
                os.remove(self.path)
        except OSError:
            pass
        os.close(self._fd)
        self._fd = None
        _held.pop(os.path.realpath(os.path.dirname(self.path)), None)


def hold_save_dir(save_dir: Optional[str], load_dir: Optional[str] = None, overwrite: bool = False) -> SaveDirLock:
    """Collective: rank 0 locks `save_dir` (nothing to lock without one); every rank raises the same
    one-line ValueError when the directory is in use, or holds another run's checkpoints (`save_history`)."""
    import torch.distributed as dist
    distributed = dist.is_available() and dist.is_initialized()
    lock, refusal = SaveDirLock("", None), None
    if save_dir and (not distributed or dist.get_rank() == 0):
        try:
            lock = acquire(save_dir)
            _check_tracker(save_dir, lock)
            _check_history(save_dir, load_dir, overwrite, lock)
        except ValueError as err:
            refusal = str(err)
        except UnsafePathError as err:
            refusal = f"--save {save_dir}: its lock file {err}"
        except OSError as err:
            refusal = f"--save {save_dir}: cannot create its lock file {LOCK_FILE} ({err.strerror or err})"
    if distributed:
        box = [refusal]
        dist.broadcast_object_list(box, src=0)
        refusal = box[0]
    if refusal is not None:
        raise ValueError(refusal)
    return lock


def _check_tracker(save_dir: str, lock: SaveDirLock) -> None:
    """A link, FIFO or directory at the tracker is refused now, like one at the lock, not at the first save after
    training (issue 51); the lock just taken is let go."""
    try:
        check_target(os.path.join(save_dir, TRACKER))
    except UnsafePathError as err:
        lock.release()
        raise ValueError(f"--save {save_dir}: its tracker {err}") from None


def _check_history(save_dir: str, load_dir: Optional[str], overwrite: bool, lock: SaveDirLock) -> None:
    """Another run's checkpoints in `save_dir` are refused (or, with --overwrite-save, deleted) now, before any
    work (issue 51); the lock just taken is let go on a refusal."""
    from llamapipe.training.checkpointing.save_history import OVERWRITE_FLAG, check_history
    try:
        check_history(save_dir, load_dir, overwrite)
    except ValueError:
        lock.release()
        raise
    except OSError as err:
        lock.release()
        raise ValueError(f"--save {save_dir}: {OVERWRITE_FLAG} could not delete the earlier checkpoints "
                         f"({err})") from None


def acquire(save_dir: str) -> SaveDirLock:
    """Lock `save_dir` for this process (creating it); ValueError naming the holder when another run has it."""
    key = os.path.realpath(save_dir)
    if key in _held:        # an earlier run in this process that ended without releasing (in-process callers)
        return _held[key]
    os.makedirs(save_dir, exist_ok=True)
    path = os.path.join(save_dir, LOCK_FILE)
    while True:
        fd = open_existing(path, os.O_RDWR | os.O_CREAT)    # never through a link (issue 40)
        try:
            lock = _try_lock(save_dir, path, fd)
        except BaseException:
            os.close(fd)
            raise
        if lock is not None:
            _held[key] = lock
            atexit.register(lock.release)
            _release_on_sigterm(lock)
            return lock
        os.close(fd)        # the file was replaced while we opened it: try the new one


def _try_lock(save_dir: str, path: str, fd: int) -> Optional[SaveDirLock]:
    flocked = _flock(fd)
    owner = _read(fd)
    if flocked is False:
        raise ValueError(f"--save {save_dir} is in use by another run ({_who(owner)}; lock file {path}); "
                         "wait for it to finish or save elsewhere")
    try:
        if os.stat(path).st_ino != os.fstat(fd).st_ino:
            return None
    except FileNotFoundError:
        return None
    if owner:
        _check_stale(save_dir, path, owner, flocked)
    record = {"host": socket.gethostname(), "pid": os.getpid(),
              "since": time.strftime("%Y-%m-%d %H:%M:%S %Z", time.localtime())}
    os.ftruncate(fd, 0)
    os.pwrite(fd, json.dumps(record).encode() + b"\n", 0)
    os.fsync(fd)
    return SaveDirLock(path, fd)


def _check_stale(save_dir: str, path: str, owner: dict, flocked: Optional[bool]) -> None:
    """A record left by a run that did not release it: take it over when that run is gone, else refuse."""
    if owner.get("host") != socket.gethostname():
        raise ValueError(f"--save {save_dir} is locked by a run on another host ({_who(owner)}), which cannot "
                         f"be checked from here; if that run is gone, remove {path}")
    pid = owner.get("pid")
    if flocked is None and isinstance(pid, int) and pid_alive(pid):    # no flock here: the pid is all we have
        raise ValueError(f"--save {save_dir} is in use by another run ({_who(owner)}; lock file {path}); "
                         "wait for it to finish or save elsewhere")
    get_logger().warning(f"taking over the lock on --save {save_dir} left by a run that is gone ({_who(owner)})")


def _flock(fd: int) -> Optional[bool]:
    """True: locked; False: another process holds it; None: this filesystem has no flock."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except OSError as err:
        if err.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
            return False
        return None


def _read(fd: int) -> dict:
    try:
        owner = json.loads(os.pread(fd, 4096, 0).decode() or "{}")
    except (ValueError, UnicodeDecodeError):
        return {}       # cut short by a crash while it was written: no record to honour
    return owner if isinstance(owner, dict) else {}


def _who(owner: dict) -> str:
    if not owner:
        return "its details are not written yet"
    return f"host {owner.get('host', '?')}, pid {owner.get('pid', '?')}, since {owner.get('since', '?')}"


def release_all() -> None:
    """Release every lock this process holds (a run stopped by a signal, `training/signals`)."""
    for lock in list(_held.values()):
        lock.release()


def _release_on_sigterm(lock: SaveDirLock) -> None:
    """Without --exit-signal-handler SIGTERM ends the process at once: release first, then end as it would.
    The flag's handler, installed later by the trainer, replaces this one (that path exits normally)."""
    if threading.current_thread() is not threading.main_thread():     # only the main thread may set handlers
        return
    if signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
        return

    def handler(signum: int, frame: Any) -> None:
        lock.release()
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)
    signal.signal(signal.SIGTERM, handler)

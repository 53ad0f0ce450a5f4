"""Files llamapipe creates in a user's directories are never written through a link (issue 40).

A run writes into directories other people may write too (a shared checkpoint or data directory). A symbolic
link planted where llamapipe writes (`CK/llamapipe.lock -> ~/victim.txt`) would make an ordinary `open(path,
"w")` overwrite the link's target, and a FIFO would block the writer forever. So every file the trainer and
the tools create is opened here, in one of three ways:

- `create_new`: a name that must not exist yet (O_CREAT|O_EXCL|O_NOFOLLOW): nothing there is followed or reused;
- `replace_with` / `replace_atomically`: the whole file under a temporary name beside it (created as above),
  renamed over the final name once complete, so a reader sees the old file or the new one, never half;
- `open_existing`: a file that is updated in place (the --save lock, the metrics JSONL): O_NOFOLLOW, O_NONBLOCK
  for the open (a FIFO cannot block it), then fstat: only a regular file with no other hard link is used.

Anything else at the path (a symbolic link, a FIFO, a directory, a socket) is refused with `UnsafePathError`,
one line naming the path and what is there, before a byte is written: its target is untouched. Directories
the user names (`--save DIR`, an output directory) are taken as given, links included: choosing them is the
user's decision, as is every directory above them.
"""
from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import stat
from typing import IO, Callable, Iterator, Optional, TypeVar

from llamapipe.core.logger import get_logger

T = TypeVar("T")
_KINDS = ((stat.S_ISLNK, "a symbolic link"), (stat.S_ISFIFO, "a FIFO (named pipe)"), (stat.S_ISDIR, "a directory"),
          (stat.S_ISSOCK, "a socket"), (stat.S_ISBLK, "a block device"), (stat.S_ISCHR, "a character device"))


class UnsafePathError(OSError):
    """A path llamapipe would write holds something other than a regular file; the message is one line."""


def _refusal(mode: int, devices: bool, directory: bool = False) -> Optional[str]:
    """What is at a path of this mode when llamapipe must not write it, else None."""
    if (stat.S_ISDIR(mode) if directory else stat.S_ISREG(mode)) or (devices and stat.S_ISCHR(mode)):
        return None
    return next((kind for test, kind in _KINDS if test(mode)), "not a regular file")


def _refuse(path: str, kind: str, directory: bool = False) -> UnsafePathError:
    what = "its own directories" if directory else "regular files"
    return UnsafePathError(f"{path} is {kind}; llamapipe writes only {what}, never through a link "
                           "(remove it or choose another path)")


def check_target(path: str, *, devices: bool = False, directory: bool = False) -> None:
    """Raise `UnsafePathError` when `path` exists and is not a regular file (a character device such as
    /dev/null too, when `devices`; a real directory instead, when `directory`). A link is not followed: it is
    what is refused."""
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return
    kind = _refusal(mode, devices, directory)
    if kind is not None:
        raise _refuse(path, kind, directory)


def kind_of(path: str) -> str:
    """What is at `path`, in words, following a link ("a FIFO (named pipe)", "a dangling symbolic link", ...),
    for a message that refuses it."""
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        return "a dangling symbolic link" if os.path.islink(path) else "missing"
    if stat.S_ISREG(mode):
        return "a regular file"
    return next((kind for test, kind in _KINDS if test(mode)), "not a regular file")


def create_new(path: str, mode: str = "wb") -> IO:
    """A new file at `path`, which must not exist (whatever is there is neither followed nor reused)."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o666)
    except FileExistsError:
        check_target(path)      # a link, FIFO or directory: say so
        raise
    return os.fdopen(fd, mode)


def open_existing(path: str, flags: int, *, devices: bool = False) -> int:
    """`os.open(path, flags)` (O_CREAT allowed, O_TRUNC not: a refused file must stay as it is) of a regular
    file that is updated in place: a link is not followed, a FIFO does not block the open, and anything but a
    regular file with no other hard link (or, when `devices`, a character device) is refused."""
    assert not flags & os.O_TRUNC, "truncate after the checks, not in the open"
    try:
        fd = os.open(path, flags | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, 0o644)
    except OSError as err:
        if err.errno in (errno.ELOOP, errno.ENXIO, errno.EISDIR, errno.EWOULDBLOCK):
            check_target(path, devices=devices)
        raise
    st = os.fstat(fd)
    kind = _refusal(st.st_mode, devices)
    if kind is None and stat.S_ISREG(st.st_mode) and st.st_nlink > 1:
        kind = f"a file with {st.st_nlink - 1} other hard link(s)"
    if kind is not None:
        os.close(fd)
        raise _refuse(path, kind)
    fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~os.O_NONBLOCK)
    return fd


def read_regular(path: str) -> bytes:
    """The bytes of the regular file at `path` (a link to one is followed): a FIFO there does not block the open
    (O_NONBLOCK), and anything but a regular file is refused with `UnsafePathError` naming it (issue 51: a FIFO
    at the tracker or at metadata.json hung every reader)."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        kind = _refusal(os.fstat(fd).st_mode, devices=False)
        if kind is not None:
            err = UnsafePathError(f"{path} is {kind}, not a regular file")
            err.kind = kind
            raise err
        chunks = []
        while chunk := os.read(fd, 1 << 20):
            chunks.append(chunk)
        return b"".join(chunks)
    finally:
        os.close(fd)


def temporary_name(path: str) -> str:
    """The name `path` is written under before it is renamed into place (the pid keeps two writers apart)."""
    return f"{path}.tmp{os.getpid()}"


def remove_dead_temporaries(path: str) -> None:
    """Remove the `temporary_name`s beside `path` that writers killed before their rename left (a corpus-sized
    `.bin.tmp<pid>` otherwise stays for good); a file whose process still runs on this host is kept."""
    directory, base = os.path.split(os.path.abspath(path))
    for name in os.listdir(directory) if os.path.isdir(directory) else ():
        pid = name[len(base) + 4:] if name.startswith(base + ".tmp") else ""
        if pid.isdigit() and not _running(int(pid)):
            clear_leftover(os.path.join(directory, name))
            get_logger().info(f"removed {os.path.join(directory, name)}, left by a writer that was stopped")


def pid_alive(pid: int) -> bool:
    """Whether a process `pid` runs on this host (one we may not signal runs too)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _running(pid: int) -> bool:
    # ours can only be a leftover of an earlier process with this pid
    return pid != os.getpid() and pid_alive(pid)


def clear_leftover(tmp: str) -> None:
    """Remove what a killed writer left at the temporary name `tmp` (a link is removed, not followed)."""
    with contextlib.suppress(FileNotFoundError):
        if not stat.S_ISDIR(os.lstat(tmp).st_mode):
            os.remove(tmp)


@contextlib.contextmanager
def _replacing(path: str) -> Iterator[str]:
    """The temporary name to write `path` under; renamed over `path` when the block ends normally, removed when
    it raises (then `path` is as it was). A link, FIFO or directory at `path` is refused, before and after."""
    check_target(path)
    tmp = temporary_name(path)
    clear_leftover(tmp)
    try:
        yield tmp
        check_target(path)      # again: something may have been put there while we wrote
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.remove(tmp)
        raise


def replace_with(path: str, write: Callable[[str], T]) -> T:
    """`write(tmp)` writes the whole file at a fresh temporary name beside `path`, which then replaces `path` in
    one rename. `write` should create its file with `create_new` (a library that writes by name gets a name
    cleared just before)."""
    with _replacing(path) as tmp:
        return write(tmp)


@contextlib.contextmanager
def replace_atomically(path: str, mode: str = "wb") -> Iterator[IO]:
    """`with replace_atomically(path, "w") as fh: ...` writes `path` whole (fsynced) or not at all."""
    with _replacing(path) as tmp, create_new(tmp, mode) as out:
        yield out
        out.flush()
        os.fsync(out.fileno())


def read_regular_named(path: str, what: str, max_bytes: Optional[int] = None) -> bytes:
    """`read_regular` for a tool's input, its errors `OSError`s naming `what` (e.g. "schedule file x.csv"): a FIFO
    cannot block the open (O_NONBLOCK), and a FIFO, device or directory, or a file over `max_bytes`, is refused
    before a byte is read, with an `OSError` whose strerror is one line naming `what`."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as err:
        raise OSError(err.errno, f"{what}: cannot read it ({err.strerror})") from None
    with os.fdopen(fd, "rb") as fh:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            kind = next((kind for test, kind in _KINDS if test(mode)), "not a regular file")
            raise OSError(errno.EINVAL, f"{what} is {kind}, not a regular file")
        size = os.fstat(fd).st_size
        if max_bytes is not None and size > max_bytes:
            raise OSError(errno.EFBIG, f"{what} is {size / 2 ** 20:.0f} MiB, over the limit of "
                                       f"{max_bytes / 2 ** 20:.0f} MiB")
        return fh.read()

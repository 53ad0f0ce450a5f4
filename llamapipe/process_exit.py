"""Leaving a finished process without the interpreter's teardown of its modules.

Python's own exit tears every module down one by one; with torch and torch._dynamo loaded (each optimizer's
construction imports dynamo), that alone takes 1.2-1.4 s of CPU here, paid by every rank of every run after its
work is done, for nothing: the operating system frees the memory anyway. `exit_process(code)` does what an orderly
exit does that matters (stops thread pools and waits for the threads that are not daemons, such as a checkpoint
writer; runs the atexit handlers: logging's, tensorboard's, wandb's, multiprocessing's; flushes stdout and stderr)
and then ends the process with `code` at once. Only a normal return goes this way: an exception or SystemExit exits as Python does.
"""
from __future__ import annotations

import atexit
import os
import sys
import threading
from typing import Callable, NoReturn, Optional


def exit_process(code: Optional[int]) -> NoReturn:
    """End the process with `code` (None: 0) after its threads, atexit handlers and output are done."""
    # What the interpreter's own exit does first: run the threading module's exit hooks (concurrent.futures stops
    # its pools there: torch.compile's workers) and join every thread that is not a daemon.
    shutdown = getattr(threading, "_shutdown", None)
    if shutdown is not None:
        shutdown()
    else:       # not CPython: join what would keep the process alive
        for thread in threading.enumerate():
            if thread is not threading.main_thread() and not thread.daemon:
                thread.join()
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):       # a closed or broken pipe: nothing more can be written there
            pass
    os._exit(code or 0)


def exit_from_watchdog(code: int, wait_for: tuple[str, ...] = ("checkpoint-save",), join_timeout_s: float = 120.0,
                       then: Optional[Callable[[], object]] = None) -> NoReturn:
    """End the process with `code` from a daemon thread while the main thread is blocked for good (a hung
    collective, training/hang_watch.py): the threads named `wait_for*` (the checkpoint writer) finish first, up to
    `join_timeout_s` each, then `then()` runs (releasing the --save lock) and the output is flushed; other threads
    and the atexit handlers are not waited for, as they may wait on what the main thread holds."""
    for thread in threading.enumerate():
        if thread.name.startswith(wait_for) and thread is not threading.current_thread():
            thread.join(join_timeout_s)
    if then is not None:
        try:
            then()
        except Exception:       # noqa: BLE001 - leaving must not fail; a stale lock is taken over with a notice
            pass
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)

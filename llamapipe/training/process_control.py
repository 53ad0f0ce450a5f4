"""Process-level controls of the training loop: Python's garbage collector (--manual-gc), as Megatron-LM
handles it, and what the other ranks do when one rank fails (`run_as_one_job`). Signals: training/signals."""
from __future__ import annotations

import contextlib
import gc
import sys
import time
from typing import Any, Callable, Iterator, Optional

import torch
import torch.distributed as dist

from llamapipe.training.flag_names import flag_message


@contextlib.contextmanager
def manual_gc(enabled: bool) -> Iterator[None]:
    """--manual-gc: Python's collector never runs by itself during training, because ranks that pause at
    different moments make every rank wait for the slowest in the next collective; the loop collects every
    --manual-gc-interval iterations and around evaluation instead (`collect_for_eval`)."""
    if not enabled:
        yield
        return
    gc.disable()
    gc.collect()
    try:
        yield
    finally:
        gc.enable()


@contextlib.contextmanager
def collect_for_eval(enabled: bool) -> Iterator[None]:
    """--manual-gc without --no-manual-gc-eval: a full collection before evaluation, and one of the youngest
    generation (what evaluation alone allocated) after it."""
    if enabled:
        gc.collect()
    yield
    if enabled:
        gc.collect(generation=0)


_ERROR_KEY = "llamapipe/failed/rank_{}"
_ONE_LINE_ERRORS = (ValueError, OSError, torch.OutOfMemoryError)   # user or resource errors: no traceback needed
_PEER_GONE = ("Connection closed by peer", "Connection reset by peer")   # gloo, when a peer process died


def run_as_one_job(body: Callable[[], int]) -> int:
    """`body()` (this rank's setup and training) or, when it raises, the exit status of a job that stops as one.

    A rank that fails publishes its error in the job's key-value store (torchrun's agent holds it), writes one
    line (the rank 0 line `pretrain_llama.py: error: ...`; another rank's line names it, unless rank 0 failed
    alike) and exits. Its exit closes its gloo connections, so the collective every other rank waits in fails
    at once; those ranks find the published error and write `rank N: stopping: rank K failed (its error is
    above)` instead of a gloo traceback (torchrun also SIGTERMs them 0.1 s after the first exit). Errors a
    person can fix (ValueError, OSError, out of memory) are one line; anything else keeps its traceback on the
    failed rank only. Not covered: NCCL collectives do not fail when a peer exits (torchrun's SIGTERM ends
    them), and without torchrun the store lives in rank 0, so when rank 0 fails the others say they lost it.
    """
    try:
        return body()
    except Exception as err:        # noqa: BLE001 - every failure must end the other ranks, not hang them
        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
            _destroy_single_group()
            if isinstance(err, _ONE_LINE_ERRORS):
                sys.stderr.write(f"pretrain_llama.py: error: {flag_message(err)}\n")
                return 2 if isinstance(err, ValueError) else 1
            raise
        return _stop_job(err)


def _destroy_single_group() -> None:
    """Tear down a one-rank process group before exiting on an error: a gloo group still alive at interpreter
    exit can abort the process ('terminate called without an active exception', exit -6 instead of 2)."""
    if dist.is_available() and dist.is_initialized():
        with contextlib.suppress(Exception):
            dist.destroy_process_group()


def _stop_job(err: Exception) -> int:
    rank, world = dist.get_rank(), dist.get_world_size()
    store = _store()
    lost = any(text in str(err) for text in _PEER_GONE)
    message = (f"lost contact with another rank (it failed or was killed: see its output and the launcher's): "
               f"{str(err).splitlines()[0]}" if lost else
               flag_message(err) if isinstance(err, _ONE_LINE_ERRORS) else f"{type(err).__name__}: {err}")
    peers = _peer_failures(store, rank, world)
    alike = [peer for peer, text in peers.items() if text == message.encode()]
    if peers and not alike:             # our error is the exit of a rank that failed first
        sys.stderr.write(f"rank {rank}: stopping: rank {min(peers)} failed (its error is above)\n")
        status = 1
    else:
        _store_call(store, "set", _ERROR_KEY.format(rank), message)
        # The same error on several ranks (a bad flag, a checkpoint that does not fit) is one line, rank 0's.
        quiet = rank != 0 and (alike or _store_get(store, _ERROR_KEY.format(0), 1.0) == message.encode())
        if not quiet:
            if not isinstance(err, _ONE_LINE_ERRORS) and not lost:
                import traceback
                traceback.print_exc()
            sys.stderr.write(f"pretrain_llama.py: error: {'' if rank == 0 else f'rank {rank}: '}{message}\n")
        status = 2 if isinstance(err, ValueError) else 1
    sys.stderr.flush()
    return status


def _store() -> Optional[Any]:
    with contextlib.suppress(Exception):
        return dist.distributed_c10d._get_default_store()
    return None


def _store_call(store: Optional[Any], method: str, *args: Any) -> Optional[Any]:
    """A store operation that gives None instead of raising: the store may live in a rank that is gone."""
    if store is None:
        return None
    with contextlib.suppress(Exception):
        return getattr(store, method)(*args)
    return None


def _store_get(store: Optional[Any], key: str, timeout_s: float) -> Optional[bytes]:
    """`key`'s value once it is set, or None after `timeout_s` (polled: a store wait that times out logs)."""
    deadline = time.monotonic() + timeout_s
    while store is not None and not _store_call(store, "check", [key]):
        if time.monotonic() > deadline:
            return None
        time.sleep(0.05)
    return _store_call(store, "get", key)


def _peer_failures(store: Optional[Any], rank: int, world: int) -> dict[int, bytes]:
    """Other ranks' published errors. A rank publishes before its exit breaks our collective, so a failure
    that caused ours is already there."""
    return {peer: _store_call(store, "get", _ERROR_KEY.format(peer)) for peer in range(world)
            if peer != rank and _store_call(store, "check", [_ERROR_KEY.format(peer)])}

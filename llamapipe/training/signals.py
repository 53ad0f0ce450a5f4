"""What a signal does to a training run: it saves first, or it stops at once in one line; it never hangs.

A person presses Ctrl-C (SIGINT to the foreground process group: the rank and its data-loader workers), a
scheduler sends SIGTERM (SLURM's preemption, torchrun passing on what it got) or the signal a job asked for
(SLURM's `--signal=USR1@120`). Two outcomes, nothing else:

- **Save, then exit 0** (`ExitSignal`): under --exit-signal-handler, Megatron's --exit-signal (SIGTERM by default)
  and Ctrl-C are remembered; the ranks agree on it at the end of an iteration (one all-reduce, so a signal that
  reached one rank is enough), save that iteration and exit 0.
- **Stop now** (`stop_on_signals`): any other of SIGINT, SIGTERM, SIGHUP, SIGUSR1, SIGUSR2 (or these two without
  the flag) ends the process within a moment: the data-loader workers are killed (they ignore these signals, so
  that the rank decides, and would otherwise keep the exit waiting for them), the --save lock is released, one
  line says what happened (`pretrain_llama.py: stopped by SIGINT at iteration 7; ...`), and the process ends by
  the signal as the shell expects. No KeyboardInterrupt traceback, no hang in multiprocessing's exit handler.

A signal ignored when the run starts (`nohup`) stays ignored. Both handlers are the main thread's (Python's
rule) and are restored when the run returns, so a caller in the same process keeps its own.
"""
from __future__ import annotations

import contextlib
import multiprocessing
import os
import signal
import sys
import threading
from typing import Any, Iterator, Optional

import torch
import torch.distributed as dist

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2)
# --exit-signal's choices: what people and schedulers send to end a job (SIGKILL and SIGSTOP cannot be caught)
EXIT_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1, signal.SIGUSR2, signal.SIGHUP, signal.SIGQUIT,
                signal.SIGXCPU)


class ExitSignal:
    """Remembers --exit-signal and Ctrl-C (SIGINT) under --exit-signal-handler, so all ranks agree to save and
    exit (Megatron's DistributedSignalHandler, with SIGINT added: Ctrl-C on an interactive run saves too)."""

    def __init__(self, enabled: bool, exit_signal: str = "SIGTERM") -> None:
        self.received: Optional[str] = None        # the name of the first signal this rank got
        self._in_flight: Optional[tuple] = None
        if not enabled:
            return
        signal.signal(signal.Signals[exit_signal], self._handle)
        if signal.getsignal(signal.SIGINT) is not signal.SIG_IGN:    # a background job's stays ignored
            signal.signal(signal.SIGINT, self._handle)

    def _handle(self, signum: int, frame: Any) -> None:
        self.received = self.received or signal.Signals(signum).name

    def agreed_flags(self, elapsed_s: float, collective: bool, overlapped: bool = False) -> torch.Tensor:
        """[signal seen, seconds elapsed], as MAX over all ranks when `collective`. `overlapped` (iterations
        that overlap under post-validation) reads the agreement started one iteration earlier and starts the
        next without blocking: a signal is then acted on one iteration later, on every rank alike."""
        flags = torch.tensor([float(self.received is not None), elapsed_s])
        if not collective:
            return flags
        if not overlapped:
            dist.all_reduce(flags, op=dist.ReduceOp.MAX)
            return flags
        previous, self._in_flight = self._in_flight, (flags, dist.all_reduce(flags, op=dist.ReduceOp.MAX,
                                                                             async_op=True))
        if previous is None:
            return torch.zeros_like(flags)
        previous[1].wait()
        return previous[0]

    def settle(self) -> None:
        """Wait for the agreement still in flight (every rank started the same ones): a gloo work left
        pending at process exit can abort the process."""
        if self._in_flight is not None:
            self._in_flight[1].wait()
            self._in_flight = None


class StopReport:
    """What the stop line says: the iteration reached (the loop's state, once there is one) and how to save."""

    def __init__(self, saving: str) -> None:
        self.saving, self.state = saving, None

    def line(self, name: str) -> str:
        rank = int(os.environ.get("RANK", "0"))
        where = f" at iteration {self.state.iteration}" if self.state is not None else " before training"
        if name == "SIGTERM" and "TORCHELASTIC_RUN_ID" in os.environ:
            where += " (from torchrun: another rank failed or exited, or torchrun itself was signalled)"
        return (f"pretrain_llama.py: {f'rank {rank}: ' if rank else ''}stopped by {name}{where}; the work since "
                f"the last checkpoint is not saved ({self.saving})\n")


@contextlib.contextmanager
def stop_on_signals(exit_signal: str, handler_enabled: bool) -> Iterator[StopReport]:
    """Within the block, each of STOP_SIGNALS (and --exit-signal) stops the process at once (module docstring);
    `ExitSignal`, installed later, takes over the ones that save. At the end the previous handlers come back and
    any data-loader worker still alive (an error ended the run before its loaders were shut down) is ended."""
    saving = (f"--exit-signal-handler saves on {exit_signal} and SIGINT" if handler_enabled else
              "--exit-signal-handler saves before stopping")
    report = StopReport(saving)
    main = threading.current_thread() is threading.main_thread()
    previous = {}
    for sig in dict.fromkeys(STOP_SIGNALS + (signal.Signals[exit_signal],)) if main else ():
        if signal.getsignal(sig) is not signal.SIG_IGN:
            previous[sig] = signal.signal(sig, lambda signum, frame: _stop(signum, report))
    try:
        yield report
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        end_loader_workers()


def _stop(signum: int, report: StopReport) -> None:
    for sig in STOP_SIGNALS:     # nothing interrupts the stop
        signal.signal(sig, signal.SIG_IGN)
    end_loader_workers()
    from llamapipe.training.checkpointing.save_lock import release_all
    release_all()
    with contextlib.suppress(Exception):     # a terminal gone (SIGHUP) must not keep the process alive
        sys.stdout.flush()
    with contextlib.suppress(OSError):
        os.write(2, report.line(signal.Signals(signum).name).encode())
    signal.signal(signum, signal.SIG_DFL)
    os.kill(os.getpid(), signum)        # end as the signal ends a process, so a calling shell sees it
    os._exit(128 + signum)


def end_loader_workers() -> None:
    """Kill this process's daemonic children still alive, the data-loader workers: they ignore the stop signals,
    so multiprocessing's exit handler, which ends daemonic children with SIGTERM and then joins them, would wait
    forever; this is that handler's job done with SIGKILL. SIGCHLD is ignored meanwhile: torch's handler would
    take their end for a crash and raise."""
    workers = [p for p in multiprocessing.active_children() if p.daemon]
    if not workers:
        return
    main = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGCHLD, signal.SIG_DFL) if main else None
    for worker in workers:
        with contextlib.suppress(Exception):
            worker.kill()
            worker.join(timeout=5)
    if main:
        signal.signal(signal.SIGCHLD, previous)

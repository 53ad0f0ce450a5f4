"""What `llamapipe profile` needs to know of the machine to measure what a training rank will see.

A training rank launched by torchrun computes with one thread (torchrun sets OMP_NUM_THREADS=1 unless the
environment already sets it), so the profile times its passes with that many threads
(`profile_schema.run_threads`). With one thread a pass is timed in its thread's CPU time, which other
processes sharing the cores do not inflate; with several, only wall time counts them all, and other
processes' work lands in it. So before timing with more than one thread the profile measures how many cores
other processes keep busy (`busy_cores`, from /proc/stat while this process sleeps) and refuses, naming the
load, when fewer idle cores remain than it has threads (`load_refusal`).
"""
from __future__ import annotations

import os
import time
from typing import Optional

MEASURE_S = 0.5     # long enough to span several scheduler time slices of the other processes
SLACK_CORES = 0.25  # the kernel's own threads and this process's wake-ups keep a quiet machine this busy


def _cpu_times() -> Optional[tuple[float, float]]:
    """(busy, total) jiffies of all cores from /proc/stat's first line; None where there is no /proc/stat."""
    try:
        with open("/proc/stat") as f:
            fields = [float(x) for x in f.readline().split()[1:9]]
    except (OSError, ValueError):
        return None
    idle = fields[3] + fields[4]        # idle and iowait
    return sum(fields) - idle, sum(fields)


def busy_cores(seconds: float = MEASURE_S) -> Optional[float]:
    """Cores other processes keep busy, measured over `seconds` while this process sleeps; None where the
    kernel does not say (no /proc/stat)."""
    before = _cpu_times()
    time.sleep(seconds)
    after = _cpu_times()
    if before is None or after is None or after[1] <= before[1]:
        return None
    return (after[0] - before[0]) / (after[1] - before[1]) * (os.cpu_count() or 1)


def load_refusal(threads: int, busy: Optional[float], cores: Optional[int] = None) -> Optional[str]:
    """The sentence refusing to time `threads` threads in wall time when other processes keep `busy` of the
    `cores` busy and fewer than `threads` idle ones remain; None when the timing is sound (one thread: CPU time)."""
    cores = cores or os.cpu_count() or 1
    if threads <= 1 or busy is None or busy + threads <= cores + SLACK_CORES:
        return None
    loadavg = f", load average {os.getloadavg()[0]:.1f}" if hasattr(os, "getloadavg") else ""
    return (f"other processes keep {busy:.1f} of this machine's {cores} cores busy (/proc/stat over {MEASURE_S:g} s"
            f"{loadavg}), so timing with --threads {threads} in wall time would measure them too; profile with "
            f"--threads 1, as a torchrun rank computes (timed in CPU time, which other processes do not inflate), "
            f"or on a machine with {threads} idle cores")

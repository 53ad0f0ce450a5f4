"""--pipeline-memory-limit's value: a number of activation units (microbatch-chunks, the simulator's unit) or a
byte size such as 24GiB, which `auto` turns into units once it has measured one (core/pipeline_parallel/
activation_memory.py). Also the zero-bubble fork's --zero-bubble-max-pending-backward (zb_fork_flags).
"""
from __future__ import annotations

import argparse
import math
import re
from typing import Optional

_SIZE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([KMGT]i?B)\s*$", re.IGNORECASE)
_SCALE = {"KB": 10 ** 3, "MB": 10 ** 6, "GB": 10 ** 9, "TB": 10 ** 12,
          "KIB": 2 ** 10, "MIB": 2 ** 20, "GIB": 2 ** 30, "TIB": 2 ** 40}


def parse_size(text: str) -> Optional[int]:
    """Bytes of a size such as "512MiB", "1.5GB" or "24 GiB"; None when `text` has no size unit."""
    match = _SIZE.match(text)
    if match is None:
        return None
    return int(float(match[1]) * _SCALE[match[2].upper()])


class MemoryBytes(int):
    """--pipeline-memory-limit given as a size (bytes) rather than a number of activation units."""


def memory_limit(text: str) -> float:
    """argparse type of --pipeline-memory-limit: "6" (units) -> 6.0, "24GiB" -> MemoryBytes(24 * 2**30)."""
    nbytes = parse_size(text)
    if nbytes is not None:
        return MemoryBytes(nbytes)
    try:
        units = float(text)
    except ValueError:
        units = math.nan
    if not math.isfinite(units):
        raise argparse.ArgumentTypeError(f"{text!r} is neither a number of activation units (e.g. 6) nor a size "
                                         "such as 24GiB or 512MB")
    return units

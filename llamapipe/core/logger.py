"""The one rank-0 logger used by all library code (other ranks log warnings and errors only)."""
from __future__ import annotations

import logging
import os
import sys

_NAME = "llamapipe"


def _rank() -> int:
    try:
        import torch.distributed as dist
        if dist.is_available() and dist.is_initialized():
            return dist.get_rank()
    except ImportError:
        pass
    return int(os.environ.get("RANK", "0"))


class _RankZeroFilter(logging.Filter):
    """Rank 0 logs everything; other ranks only errors (their own failures), so warnings that every rank
    reaches together (a skipped iteration, an incomplete checkpoint) are printed once."""

    def filter(self, record: logging.LogRecord) -> bool:
        return _rank() == 0 or record.levelno >= logging.ERROR


def get_logger() -> logging.Logger:
    logger = logging.getLogger(_NAME)
    if not logger.handlers:
        handler = logging.StreamHandler(sys.stdout)
        handler.setFormatter(logging.Formatter("[%(asctime)s] %(message)s", "%Y-%m-%d %H:%M:%S"))
        handler.addFilter(_RankZeroFilter())
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)
        logger.propagate = False
    return logger

"""Joining the process group: torchrun's environment (or a one-process group), NCCL or gloo, elastic restarts."""
from __future__ import annotations

import os
import socket
from datetime import timedelta
from typing import Optional

import torch
import torch.distributed as dist

from llamapipe.core.config import ParallelConfig


def init_distributed(par: ParallelConfig) -> torch.device:
    """Join the process group torchrun describes (or a one-process group when run directly)."""
    if "RANK" not in os.environ or "MASTER_ADDR" not in os.environ:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=str(port))
    device = torch.device("cpu")
    if par.distributed_backend == "nccl":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        timeout = timedelta(minutes=par.distributed_timeout_minutes)
        # With NCCL, small CPU tensors (loss totals, exit flags, the auto plan) still need a backend: gloo.
        backend = "cpu:gloo,cuda:nccl" if par.distributed_backend == "nccl" else par.distributed_backend
        dist.init_process_group(backend, timeout=timeout, store=_elastic_store(timeout),
                                rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"]))
    return device


def first_to_report() -> bool:
    """Whether this rank writes the error every rank of the job meets alike (a bad flag), before any process
    group exists: the first rank to get there, so that the line is written even when torchrun ends the other
    ranks at the first exit (rank 0 alone used to write it, and a slower rank 0 was killed first). Under torchrun
    the agent's store counts the ranks that got there; elsewhere (one process, or a launcher without that store)
    rank 0 writes it."""
    try:
        store = _elastic_store(timedelta(seconds=10))
        if store is not None:
            return store.add("llamapipe/errors_reported", 1) == 1
    except Exception:   # noqa: BLE001 - a store that cannot be reached: fall back to rank 0
        pass
    return int(os.environ.get("RANK", "0")) == 0


def _elastic_store(timeout: timedelta) -> Optional[dist.Store]:
    """Under torchrun, the agent's store with a prefix per restart attempt.

    Workers of a restarted attempt share the agent's TCPStore with the dead attempt; without a prefix
    gloo/NCCL can read a dead peer's address left over from the previous attempt and fail to connect.
    """
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT")
    if attempt is None or os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                          int(os.environ["WORLD_SIZE"]), is_master=False, timeout=timeout)
    return dist.PrefixStore(f"llamapipe/attempt_{attempt}", store)

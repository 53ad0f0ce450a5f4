"""The communication part of `llamapipe profile`: p2p latency and bandwidth and all-reduce bandwidth between
the ranks of a torchrun job, in the form `profile_schema` stores and `llamapipe plan --profile` reads.

Each is fitted to the usual linear model, time = latency + bytes / bandwidth, from a small and a large
message: p2p by ping-pong between every neighbouring pair of ranks (`p2p_communication.measure_latency`, the
probe `auto` uses, slowest pair), the all-reduce over all ranks, whose bandwidth is the bus bandwidth
(NCCL-tests' convention: bytes x 2 (n - 1) / n / time), so a ring all-reduce over any n ranks takes
latency + 2 (n - 1) / n x bytes / bandwidth.
"""
from __future__ import annotations

import os
import statistics
import time
from typing import Optional

import torch
import torch.distributed as dist

from llamapipe.core.pipeline_parallel.p2p_communication import measure_latency

SMALL_BYTES = 8


def init_if_launched() -> bool:
    """Join the torchrun job when launched with several ranks (gloo on CPU, NCCL on CUDA); True if so."""
    if int(os.environ.get("WORLD_SIZE", "1")) < 2:
        return False
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    return True


def _fit(small_s: float, large_s: float, large_bytes: int) -> tuple[float, float]:
    """(latency s, bandwidth B/s) of time = latency + bytes / bandwidth through two measured points; when noise
    makes the large message no slower than the small one, both are latency (their mean) and bandwidth is
    taken as unbounded (1 TB/s)."""
    if large_s <= small_s:
        return (small_s + large_s) / 2, 1e12
    slope = (large_s - small_s) / max(large_bytes - SMALL_BYTES, 1)
    return max(small_s - SMALL_BYTES * slope, 0.0), 1.0 / slope


def _allreduce_s(nbytes: int, device: torch.device, rounds: int) -> float:
    buf = torch.zeros(max(nbytes // 4, 1), dtype=torch.float32, device=device)
    dist.all_reduce(buf)
    times = []
    for _ in range(rounds):
        dist.barrier()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        dist.all_reduce(buf)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - start)
    result = torch.tensor([statistics.median(times)], dtype=torch.float64, device=device)
    dist.all_reduce(result, op=dist.ReduceOp.MAX)
    return float(result)


def measure(device: torch.device, message_bytes: int, rounds: int = 10) -> Optional[dict]:
    """p2p and all-reduce figures between all ranks, or None without torch.distributed or with one rank.
    `message_bytes`: a typical activation message (the large p2p point; the all-reduce's is 4x it, at least
    4 MiB, since gradients are larger)."""
    if not dist.is_initialized() or dist.get_world_size() < 2:
        return None
    world, rank = dist.get_world_size(), dist.get_rank()
    ranks = tuple(range(world))
    large = max(int(message_bytes), 1 << 16)
    p2p = [measure_latency(rank, ranks, None, nbytes=n, device=device, rounds=rounds) for n in (SMALL_BYTES, large)]
    ar_large = max(4 * large, 4 << 20)
    ar = [_allreduce_s(n, device, rounds) for n in (SMALL_BYTES, ar_large)]
    p2p_latency, p2p_bw = _fit(p2p[0], p2p[1], large)
    ar_latency, ar_algbw = _fit(ar[0], ar[1], ar_large)
    return {"world_size": world, "p2p_latency_s": p2p_latency, "p2p_bandwidth_Bps": p2p_bw,
            "p2p_bytes": large, "allreduce_latency_s": ar_latency,
            "allreduce_bus_bandwidth_Bps": ar_algbw * 2 * (world - 1) / world, "allreduce_bytes": ar_large}

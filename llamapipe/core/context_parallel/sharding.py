"""Causal load balance for context parallelism: which tokens of the sequence each CP rank holds.

Under a causal mask, token i attends to i + 1 keys, so cutting the sequence into cp contiguous pieces would
give the last rank cp times the first rank's attention work. As Megatron-LM (and the ring-attention "zigzag"
layout) do, the sequence of length s is cut into 2 * cp chunks of s / (2 * cp) tokens, and CP rank r holds
chunk r (its head) and chunk 2 * cp - 1 - r (its tail), concatenated head then tail: every rank then has the
same number of (query, key) pairs. The local tokens stay in increasing global order, so a causal mask over the
local sequence is the global causal mask restricted to it. RoPE needs each local token's global position
(`local_positions`); the data path hands each rank its chunks with `shard_batch`.
"""
from __future__ import annotations

from typing import Sequence

import torch

from llamapipe.core.config import ConfigError

BATCH_KEYS = ("tokens", "labels", "loss_mask", "position_ids")   # the (b, s) tensors of a microbatch


def chunk_ids(cp_size: int, cp_rank: int) -> tuple[int, int]:
    """Global chunk indices (head, tail) of CP rank `cp_rank`, out of 2 * cp_size chunks."""
    assert 0 <= cp_rank < cp_size, f"cp_rank {cp_rank} outside [0, {cp_size})"
    return cp_rank, 2 * cp_size - 1 - cp_rank


def check_seq_length(seq_len: int, cp_size: int) -> None:
    """One sentence naming the config fields when the sequence does not split into 2 * cp equal chunks."""
    if seq_len % (2 * cp_size):
        raise ConfigError(f"seq_length {seq_len} is not divisible by 2 x cp_size ({2 * cp_size}): context "
                          "parallelism splits the sequence into 2 chunks per rank", "seq_length", "cp_size")


def shard_sequence(t: torch.Tensor, dim: int, cp_size: int, cp_rank: int) -> torch.Tensor:
    """This rank's head and tail chunks of `t` along `dim`, concatenated (a new tensor; `t` when cp_size is 1)."""
    if cp_size == 1:
        return t
    check_seq_length(t.shape[dim], cp_size)
    chunks = t.chunk(2 * cp_size, dim=dim)
    head, tail = chunk_ids(cp_size, cp_rank)
    return torch.cat([chunks[head], chunks[tail]], dim=dim)


def unshard_sequence(parts: Sequence[torch.Tensor], dim: int) -> torch.Tensor:
    """Inverse of `shard_sequence`: the full sequence from every rank's local part, in CP rank order."""
    cp_size = len(parts)
    chunks: list = [None] * (2 * cp_size)
    for rank, part in enumerate(parts):
        head, tail = chunk_ids(cp_size, rank)
        chunks[head], chunks[tail] = part.chunk(2, dim=dim)
    return torch.cat(chunks, dim=dim)


def local_positions(seq_len: int, cp_size: int, cp_rank: int) -> torch.Tensor:
    """Global positions (s_local,) long of this rank's tokens, in local order."""
    check_seq_length(seq_len, cp_size)
    return shard_sequence(torch.arange(seq_len), 0, cp_size, cp_rank)


def shard_batch(batch: dict, cp_size: int, cp_rank: int) -> dict:
    """A microbatch {tokens, labels, loss_mask[, position_ids]} of (b, s) tensors cut to this rank's chunks.

    Returns a new dict (other keys kept as they are) with "position_ids" (b, s_local) long holding the global
    positions, for RoPE; cp_size 1 returns `batch` itself.
    """
    if cp_size == 1:
        return batch
    present = [key for key in BATCH_KEYS if batch.get(key) is not None]
    if not present:
        raise ValueError(f"a microbatch needs one of {', '.join(BATCH_KEYS)} to shard over context parallelism")
    b, seq_len = batch[present[0]].shape[:2]
    check_seq_length(seq_len, cp_size)
    out = dict(batch)
    for key in present:
        assert batch[key].shape[:2] == (b, seq_len), f"{key} is {tuple(batch[key].shape)}, not (b, s) = {(b, seq_len)}"
        out[key] = shard_sequence(batch[key], 1, cp_size, cp_rank)
    if "position_ids" not in present:
        device = batch[present[0]].device
        out["position_ids"] = local_positions(seq_len, cp_size, cp_rank).to(device).expand(b, -1).contiguous()
    return out

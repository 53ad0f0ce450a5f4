"""Causal load balance for context parallelism: which tokens of the sequence each CP rank holds.

Under a causal mask, token i attends to i + 1 keys, so cutting the sequence into cp contiguous pieces would
give the last rank cp times the first rank's attention work. As Megatron-LM (and the ring-attention "zigzag"
layout) do, the sequence of length s is cut into 2 * cp chunks of s / (2 * cp) tokens, and CP rank r holds
chunk r (its head) and chunk 2 * cp - 1 - r (its tail), concatenated head then tail: every rank then has the
same number of (query, key) pairs. The local tokens stay in increasing global order, so a causal mask over the
local sequence is the global causal mask restricted to it. RoPE needs each local token's global position
(`local_positions`). A model chunk takes the whole sequence and cuts its own inputs with its `SequenceShard`;
the loss side cuts the loss mask with the same one, so it meets the chunk's per-token losses.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from llamapipe.core.config import ConfigError


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


@dataclass(frozen=True)
class SequenceShard:
    """CP rank `cp_rank`'s share of every sequence: what a model chunk cuts its full-sequence inputs to."""

    cp_size: int = 1
    cp_rank: int = 0

    def __call__(self, t: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
        """This rank's tokens of a (b, s, ...) per-token tensor of the whole sequence, (b, s/cp, ...): a new tensor
        (`t` itself at cp 1; None stays None)."""
        return None if t is None else shard_sequence(t, 1, self.cp_size, self.cp_rank)

    def positions(self, local_len: int, batch: int, device: torch.device) -> torch.Tensor:
        """Global positions (b, local_len) long of this rank's `local_len` tokens of each of `batch` sequences
        (expanded: one row in memory)."""
        return local_positions(local_len * self.cp_size, self.cp_size, self.cp_rank).to(device).expand(batch, -1)

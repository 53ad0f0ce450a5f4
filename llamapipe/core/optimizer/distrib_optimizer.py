"""ZeRO-1 layout: which contiguous range of the flattened parameters each data-parallel rank owns.

All trainable parameters of a rank's chunks are laid end to end in one logical flat index space (padded to
a multiple of dp_size); DP rank r owns elements [r * shard_size, (r + 1) * shard_size). The optimizer keeps
fp32 master weights and Adam state only for its range (a list of `Segment`s, one per parameter the range
touches), steps them, and all-gathers the updated range so every DP rank ends with full parameters
(Rajbhandari et al., "ZeRO", stage 1). With dp_size 1 the one shard covers everything: the plain optimizer.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from llamapipe.core.distributed.grad_reduce import group_size


@dataclass(frozen=True)
class Segment:
    """Elements [start, end) of the flattened parameter `param_index`, at `shard_offset` in this rank's shard."""
    param_index: int
    start: int
    end: int
    shard_offset: int

    @property
    def numel(self) -> int:
        return self.end - self.start


@dataclass(frozen=True)
class ShardLayout:
    numels: tuple[int, ...]
    dp_size: int = 1
    dp_rank: int = 0

    @property
    def param_offsets(self) -> list[int]:
        offsets, total = [], 0
        for n in self.numels:
            offsets.append(total)
            total += n
        return offsets

    @property
    def total(self) -> int:
        return sum(self.numels)

    @property
    def shard_size(self) -> int:
        return max(-(-self.total // self.dp_size), 1)

    @property
    def padded_total(self) -> int:
        return self.shard_size * self.dp_size

    def segments(self) -> list[Segment]:
        """The parts of parameters that fall into this DP rank's range, in parameter order."""
        lo = self.dp_rank * self.shard_size
        hi = lo + self.shard_size
        out = []
        for index, (offset, numel) in enumerate(zip(self.param_offsets, self.numels)):
            start, end = max(lo, offset), min(hi, offset + numel)
            if start < end:
                out.append(Segment(index, start - offset, end - offset, start - lo))
        return out


def pack_shard(layout: ShardLayout, segments: list[Segment], values: list[torch.Tensor],
               dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """This rank's shard as one flat tensor (padding zero), from one value per segment."""
    shard = torch.zeros(layout.shard_size, dtype=dtype, device=device)
    for seg, value in zip(segments, values):
        shard[seg.shard_offset:seg.shard_offset + seg.numel].copy_(value.reshape(-1))
    return shard


def gather_shards(shard: torch.Tensor, layout: ShardLayout, dp_group: Any) -> torch.Tensor:
    """All-gather every DP rank's shard into the full padded flat tensor (collective over `dp_group`)."""
    if layout.dp_size == 1:
        return shard
    assert group_size(dp_group) == layout.dp_size, "dp_group does not match the shard layout"
    full = torch.empty(layout.padded_total, dtype=shard.dtype, device=shard.device)
    dist.all_gather(list(full.chunk(layout.dp_size)), shard, group=dp_group)
    return full


def unflatten(full: torch.Tensor, layout: ShardLayout, shapes: list[torch.Size]) -> list[torch.Tensor]:
    """Per-parameter views of a full flat tensor."""
    return [full[offset:offset + numel].view(shape)
            for offset, numel, shape in zip(layout.param_offsets, layout.numels, shapes)]

"""All-to-all context parallelism (DeepSpeed-Ulysses, arXiv 2309.14509; Megatron's --cp-comm-type a2a) and its
hierarchical form a2a+p2p (Megatron's --hierarchical-context-parallel-sizes A P, TransformerEngine's order).

Each CP rank holds s/cp tokens of the sequence (the load-balanced layout of sharding.py) for all of its heads.
`a2a`: one all-to-all over the CP group before attention scatters the heads and gathers the sequence, so each
rank holds the whole sequence for heads/cp of its heads (and groups/cp of its query groups: GQA needs the
query groups divisible by the a2a size); the gathered parts are put back in global token order
(`unshard_sequence`), so the causal mask and the document mask of --reset-attention-mask are the single-rank
ones; attention runs on the full sequence, and a second all-to-all returns each rank its own tokens for all
heads. Each all-to-all is a custom autograd Function whose backward is the reverse all-to-all.

`a2a+p2p` with sizes (A, P), A * P = cp: as Megatron builds the levels (parallel_state.create_hierarchical_groups),
CP rank c = p * A + i is rank i of the a2a level (consecutive CP ranks) and rank p of the p2p level (stride A).
The all-to-all runs within the a2a level; what it gathers, in the load-balanced order of A ranks, is exactly
chunks p and 2P - 1 - p of 2P chunks of the sequence: the load-balanced layout of a CP group of P ranks. Ring
attention (attention.py, p2p) then runs over the p2p level for heads/A heads, and the reverse all-to-all follows
(TransformerEngine's AttnFuncWithCPAndKVP2P does the same with cp_group = [a2a group, p2p group]).

No process group is created: the all-to-all runs over the whole CP group with zero-sized parts for the ranks
outside this rank's a2a level (every CP rank takes part at once, each level exchanging among itself), and the
ring's messages go over the CP group to the global ranks of the p2p level (`SubGroup`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from llamapipe.core.config import ConfigError
from llamapipe.core.context_parallel.sharding import shard_sequence, unshard_sequence
from llamapipe.core.pipeline_parallel.position import waiting

A2A_TYPES = ("a2a", "a2a+p2p")


@dataclass(frozen=True)
class SubGroup:
    """Ranks `members` (global, in order) of the process group `group`: what the ring of attention.py needs of a
    level it has no process group for (its size, my rank in it, its global ranks)."""

    group: Any
    members: tuple[int, ...]

    def size(self) -> int:
        return len(self.members)

    def rank(self) -> int:
        return self.members.index(dist.get_rank())

    def global_rank(self, index: int) -> int:
        return self.members[index]


@dataclass(frozen=True)
class UlyssesGroup:
    """The CP group of a2a or a2a+p2p attention: `a2a_size` consecutive CP ranks exchange heads; the a2a size
    is the whole CP size for `a2a`, Megatron's first --hierarchical-context-parallel-sizes for `a2a+p2p`."""

    group: Any
    a2a_size: int

    def levels(self) -> tuple[SubGroup, SubGroup]:
        """(my a2a level, my p2p level) as members of the CP group."""
        ranks = tuple(dist.get_process_group_ranks(self.group))
        c, a = ranks.index(dist.get_rank()), self.a2a_size
        start = c - c % a
        return SubGroup(self.group, ranks[start:start + a]), SubGroup(self.group, ranks[c % a::a])


def check_query_groups(groups: int, level: SubGroup) -> None:
    """The query groups of this TP rank must split over the a2a level (each rank keeps groups / A of them)."""
    if groups % level.size():
        raise ConfigError(f"num_query_groups per TP rank ({groups}) is not divisible by the a2a size "
                          f"{level.size()} (cp_comm_type a2a)", "num_query_groups", "cp_comm_type")


class _AllToAll(torch.autograd.Function):
    """x (n, ...) on each rank of `members`' CP group: part j goes to members[j], part i of the result came from
    members[i]; ranks of the group outside `members` exchange nothing with this one. The backward is the same
    exchange of the gradients (the reverse all-to-all: part j came from members[j], returns there)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, level: SubGroup) -> torch.Tensor:
        ctx.level = level
        return _exchange(x, level)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _exchange(grad, ctx.level), None


def _exchange(x: torch.Tensor, level: SubGroup) -> torch.Tensor:
    if level.size() == 1:
        return x.clone()
    ranks = dist.get_process_group_ranks(level.group)
    x = x.contiguous()
    per_part = x.shape[0] // level.size()
    splits = [per_part if r in level.members else 0 for r in ranks]
    out = torch.empty_like(x)
    with waiting("the context-parallel all-to-all", ranks, collective=True):    # every CP rank takes part
        dist.all_to_all_single(out, x, splits, splits, group=level.group)
    return out


def scatter_heads(t: torch.Tensor, level: SubGroup) -> torch.Tensor:
    """(b, n, s_local, d), all heads of my tokens -> (b, n / A, A * s_local, d): my heads' tokens of the a2a
    level, in the load-balanced order of its A ranks (global order when the level is the whole CP group)."""
    a = level.size()
    b, n, s, d = t.shape
    parts = t.reshape(b, a, n // a, s, d).transpose(0, 1)            # (A, b, n/A, s, d): part j to rank j
    received = _AllToAll.apply(parts, level)                          # part i: rank i's tokens, my heads
    return unshard_sequence(list(received.unbind(0)), dim=2)


def gather_heads(t: torch.Tensor, level: SubGroup) -> torch.Tensor:
    """The inverse of `scatter_heads`: (b, n / A, A * s_local, d) -> (b, n, s_local, d)."""
    a = level.size()
    parts = torch.stack([shard_sequence(t, 2, a, i) for i in range(a)]) if a > 1 else t.unsqueeze(0)
    received = _AllToAll.apply(parts, level)                          # (A, b, n/A, s, d): part j, heads block j
    _, b, n, s, d = received.shape
    return received.transpose(0, 1).reshape(b, a * n, s, d)

"""The job's process groups: a frozen `ParallelState` that says where a rank sits in the grid.

The axes and groups are described, and ranks laid out, in `rank_grid` (re-exported here).
`initialize_model_parallel` creates every group of `GROUPS` once and returns a frozen `ParallelState` that
model, schedules and optimizer receive explicitly; they read an axis by name (`ps.size("cp")`,
`ps.group("dp", "cp")`) or through its typed members (`ps.cp_size`, `ps.dp_cp_group`: one property per axis
and group, written out so that an editor finds them). There are no Megatron-style accessors over a module
global (they silently return the wrong group once a process holds two layouts); the global only refuses a
second `initialize_model_parallel` before `destroy_model_parallel`.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Mapping, Optional

from llamapipe.core.rank_grid import AXES, DEFAULT_ORDER, GROUPS, RankGrid, full_order

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

__all__ = ["AXES", "DEFAULT_ORDER", "GROUPS", "ParallelState", "RankGrid", "destroy_model_parallel",
           "full_order", "initialize_model_parallel"]

_FIRST_AXES = ("tp", "dp", "pp")    # the axes every job has; a later one (cp, ep one day) may be of size 1
_SUFFIXES = ("size", "rank", "ranks", "group")


@dataclass(frozen=True, init=False, eq=False)
class ParallelState:
    """Everything a rank needs to know about its place in the grid. Groups are None on one process.

    Read by name: `size(*axes)`, `rank_in(*axes)`, `group(*axes)`, or the typed properties `<name>_size`,
    `<name>_rank`, `<name>_ranks`, `<name>_group` for an axis or a group of GROUPS (`ps.cp_rank`,
    `ps.dp_cp_group`; `ps.embedding_ranks`, `ps.embedding_group`). Built by `initialize_model_parallel`, or by
    hand with the same keywords: `ParallelState(rank=1, world_size=2, cp_size=2, cp_rank=1, cp_group=g)`.
    """
    rank: int = 0
    world_size: int = 1
    vpp_size: int = 1
    order: str = DEFAULT_ORDER
    sizes: Mapping[str, int] = field(default_factory=dict)
    coords: Mapping[str, int] = field(default_factory=dict)
    ranks: Mapping[str, tuple[int, ...]] = field(default_factory=dict)
    groups: Mapping[str, ProcessGroup] = field(default_factory=dict)

    def __init__(self, rank: int = 0, world_size: int = 1, vpp_size: int = 1, order: str = DEFAULT_ORDER,
                 sizes: Optional[Mapping] = None, coords: Optional[Mapping] = None,
                 ranks: Optional[Mapping] = None, groups: Optional[Mapping] = None, **named: Any) -> None:
        parts = {"size": dict(sizes or {}), "rank": dict(coords or {}), "ranks": dict(ranks or {}),
                 "group": dict(groups or {})}
        for key, value in named.items():
            name, _, kind = key.rpartition("_")
            known = AXES if kind in ("size", "rank") else (*GROUPS, "embedding")
            if kind not in _SUFFIXES or name not in known:
                raise TypeError(f"ParallelState got an unexpected keyword argument {key!r}")
            parts[kind][name] = value
        _alias_groups(parts["size"], parts["group"], parts["ranks"])
        for name, value in (("rank", rank), ("world_size", world_size), ("vpp_size", vpp_size),
                            ("order", full_order(order)), ("sizes", parts["size"]), ("coords", parts["rank"]),
                            ("ranks", {k: tuple(v) for k, v in parts["ranks"].items()}),
                            ("groups", parts["group"])):
            object.__setattr__(self, name, value)

    def size(self, *axes: str) -> int:
        return math.prod(self.sizes.get(_axis(a), 1) for a in axes)

    def rank_in(self, *axes: str) -> int:
        """My rank within the group over `axes` (its position in the sorted member list, as torch numbers it)."""
        if len(axes) == 1:
            return self.coords.get(_axis(axes[0]), 0)
        members = self.ranks.get(_group_name(axes))
        if members is not None:
            return members.index(self.rank)
        rank, stride = 0, 1     # no member list (a state built by hand): mixed radix in the rank order
        for axis in self.order.split("-"):
            if axis in axes:
                rank += self.coords.get(axis, 0) * stride
                stride *= self.sizes.get(axis, 1)
        return rank

    def group(self, *axes: str) -> Optional[ProcessGroup]:
        return self._group(_group_name(axes))

    def _group(self, name: str) -> Optional[ProcessGroup]:
        """The process group `name`, or None: on one process, or in a state built by hand without it (the HF
        converter builds tensor-parallel shards that way, one process and no group)."""
        return self.groups.get(name)

    def _ranks(self, name: str) -> tuple[int, ...]:
        """The members of my group `name`, sorted; only myself in a state built by hand without them."""
        return self.ranks.get(name, (self.rank,))

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp_size - 1

    # The typed members: <name>_size, _rank, _ranks, _group for every group of GROUPS (each axis is one), and
    # _ranks, _group for the embedding group. tests/unit/test_parallel_state.py checks them against GROUPS.

    @property
    def tp_size(self) -> int:
        return self.size("tp")

    @property
    def tp_rank(self) -> int:
        return self.rank_in("tp")

    @property
    def tp_ranks(self) -> tuple[int, ...]:
        return self._ranks("tp")

    @property
    def tp_group(self) -> Optional[ProcessGroup]:
        return self._group("tp")

    @property
    def cp_size(self) -> int:
        return self.size("cp")

    @property
    def cp_rank(self) -> int:
        return self.rank_in("cp")

    @property
    def cp_ranks(self) -> tuple[int, ...]:
        return self._ranks("cp")

    @property
    def cp_group(self) -> Optional[ProcessGroup]:
        return self._group("cp")

    @property
    def dp_size(self) -> int:
        return self.size("dp")

    @property
    def dp_rank(self) -> int:
        return self.rank_in("dp")

    @property
    def dp_ranks(self) -> tuple[int, ...]:
        return self._ranks("dp")

    @property
    def dp_group(self) -> Optional[ProcessGroup]:
        return self._group("dp")

    @property
    def pp_size(self) -> int:
        return self.size("pp")

    @property
    def pp_rank(self) -> int:
        return self.rank_in("pp")

    @property
    def pp_ranks(self) -> tuple[int, ...]:
        return self._ranks("pp")

    @property
    def pp_group(self) -> Optional[ProcessGroup]:
        return self._group("pp")

    @property
    def dp_cp_size(self) -> int:
        return self.size("dp", "cp")

    @property
    def dp_cp_rank(self) -> int:
        return self.rank_in("dp", "cp")

    @property
    def dp_cp_ranks(self) -> tuple[int, ...]:
        return self._ranks("dp_cp")

    @property
    def dp_cp_group(self) -> Optional[ProcessGroup]:
        return self._group("dp_cp")

    @property
    def tp_cp_size(self) -> int:
        return self.size("tp", "cp")

    @property
    def tp_cp_rank(self) -> int:
        return self.rank_in("tp", "cp")

    @property
    def tp_cp_ranks(self) -> tuple[int, ...]:
        return self._ranks("tp_cp")

    @property
    def tp_cp_group(self) -> Optional[ProcessGroup]:
        return self._group("tp_cp")

    @property
    def mp_size(self) -> int:
        return self.size("tp", "pp")

    @property
    def mp_rank(self) -> int:
        return self.rank_in("tp", "pp")

    @property
    def mp_ranks(self) -> tuple[int, ...]:
        return self._ranks("mp")

    @property
    def mp_group(self) -> Optional[ProcessGroup]:
        return self._group("mp")

    @property
    def embedding_ranks(self) -> tuple[int, ...]:
        return self._ranks("embedding")

    @property
    def embedding_group(self) -> Optional[ProcessGroup]:
        return self._group("embedding")


def _alias_groups(sizes: Mapping[str, int], groups: dict, ranks: dict) -> None:
    """Fill in, for a state built by hand, each group of GROUPS not given whose axes wider than one rank are
    those of a given one (dp_cp is the dp group at cp 1, the cp group at dp 1): the same members."""
    def wide(name: str) -> frozenset:
        return frozenset(a for a in GROUPS[name] if sizes.get(a, 1) > 1)
    for name in GROUPS:
        same = [other for other in GROUPS if other in groups and wide(other) == wide(name)]
        if name not in groups and wide(name) and same:
            groups[name] = groups[same[0]]
            if same[0] in ranks:
                ranks[name] = ranks[same[0]]


def _axis(axis: str) -> str:
    if axis not in AXES:
        raise KeyError(f"unknown parallel axis {axis!r}; the axes are {', '.join(AXES)}")
    return axis


def _group_name(axes: tuple[str, ...]) -> str:
    for name, members in GROUPS.items():
        if set(members) == set(axes) and len(members) == len(axes):
            return name
    raise KeyError(f"no process group over {'+'.join(axes)}; the groups are {', '.join(GROUPS)}")


_STATE: Optional[ParallelState] = None


def initialize_model_parallel(tp: int = 1, pp: int = 1, vpp: int = 1, order: str = DEFAULT_ORDER,
                              **sizes: int) -> ParallelState:
    """Create the groups of GROUPS and the embedding group (collective: every rank calls it). `sizes` are the
    other axes by name (cp=2); the data-parallel size is what the world leaves. Two group names with the same
    members share one process group when they differ only by an added axis of size 1 (dp_cp is dp at cp 1)."""
    import torch.distributed as dist

    global _STATE
    if _STATE is not None:
        raise RuntimeError("initialize_model_parallel was already called; call destroy_model_parallel first")
    if not dist.is_initialized():
        raise RuntimeError("torch.distributed must be initialised before initialize_model_parallel")
    world, rank = dist.get_world_size(), dist.get_rank()
    grid = RankGrid(world, tp, pp, order, **sizes)
    made: dict[tuple, Any] = {}
    groups, ranks = {}, {}
    for name in (*GROUPS, "embedding"):
        # an added axis of size 1 adds nothing: dp_cp is the dp communicator at cp 1. The others stay apart as
        # they always were (mp and pp at tp 1, the embedding group and pp at pp 2): separate communicators
        axes = GROUPS.get(name, (name,))
        key_axes = tuple(a for a in axes if a in _FIRST_AXES or a not in AXES or grid.sizes[a] > 1)
        for members in grid.named_groups(name):
            key = (key_axes, tuple(members)) if len(members) > 1 else tuple(members)
            if key not in made:
                made[key] = dist.new_group(members)  # every rank creates every group, in the same order
            if rank in members:
                groups[name], ranks[name] = made[key], tuple(members)
    _STATE = ParallelState(rank=rank, world_size=world, vpp_size=vpp, order=grid.order, sizes=dict(grid.sizes),
                           coords=grid.coords(rank), ranks=ranks, groups=groups)
    return _STATE


def destroy_model_parallel() -> None:
    global _STATE
    _STATE = None


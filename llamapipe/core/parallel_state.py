"""The job's parallel dimensions, by name: the rank grid and the process groups.

`AXES` is the one description of the axes a job may have (docs/design.md section 2 says how to add one).
The rank math is pure (`RankGrid`: any axes, any order, fastest-varying first), so it is testable without
processes. `initialize_model_parallel` creates every group of `GROUPS` once and returns a frozen
`ParallelState` that model, schedules and optimizer receive explicitly; they read an axis by name
(`ps.size("cp")`, `ps.group("dp", "cp")`, or the spelled-out `ps.cp_size`, `ps.dp_cp_group`). There are no
Megatron-style accessors over a module global (they silently return the wrong group once a process holds two
layouts); the global only refuses a second `initialize_model_parallel` before `destroy_model_parallel`.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Mapping, Optional

# name -> what it splits. Megatron's default rank order is this order, fastest-varying first (tp-cp-dp-pp).
AXES = {
    "tp": "tensor: heads and feature dimensions of every layer",
    "cp": "context: the sequence, two of 2N causal-balanced chunks per rank",
    "dp": "data: the global batch (and, with ZeRO, optimizer state, gradients and weights)",
    "pp": "pipeline: the layers, in stages",
}
DEFAULT_ORDER = "-".join(AXES)
_FIRST_AXES = ("tp", "dp", "pp")    # the axes every job has; a later one (cp, ep one day) may be of size 1

# group name -> the axes its members differ along
GROUPS = {
    "tp": ("tp",),
    "cp": ("cp",),
    "dp": ("dp",),            # ranks that read different samples
    "pp": ("pp",),
    "dp_cp": ("dp", "cp"),    # replicas of the same weights: gradient reduction, optimizer shards, ZeRO
    "tp_cp": ("tp", "cp"),    # ranks that hold parts of the same tokens' activations
    "mp": ("tp", "pp"),       # the shards of one model: norms, overflow checks
}


def full_order(order: str) -> str:
    """`order` with every axis of AXES; an axis it leaves out (an older order string without cp) goes right
    after the axis that precedes it in DEFAULT_ORDER, as Megatron places cp after tp."""
    axes = order.split("-")
    if len(set(axes)) != len(axes) or not set(axes) <= set(AXES):
        raise ValueError(f"rank order {order} must name each of {', '.join(AXES)} at most once")
    for i, axis in enumerate(AXES):
        if axis not in axes:
            before = [a for a in list(AXES)[:i] if a in axes]
            axes.insert(axes.index(before[-1]) + 1 if before else 0, axis)
    return "-".join(axes)


class RankGrid:
    """Mixed-radix rank layout over the named axes; `order` lists them fastest-varying first. The data-parallel
    size is what the world leaves: world_size / (product of the other sizes)."""

    def __init__(self, world_size: int, tp: int = 1, pp: int = 1, order: str = DEFAULT_ORDER, **sizes: int):
        unknown = set(sizes) - set(AXES)
        assert not unknown and "dp" not in sizes, f"unknown axes {sorted(unknown)} (dp is derived)"
        sizes.update(tp=tp, pp=pp)
        given = math.prod(sizes.values())
        assert world_size % given == 0, f"world size {world_size} must be divisible by {given} ({sizes})"
        self.world_size, self.order = world_size, full_order(order)
        self.sizes = {axis: sizes.get(axis, 1) for axis in AXES}
        self.sizes["dp"] = world_size // given

    def __getattr__(self, name: str) -> int:
        if name in AXES:        # grid.tp, grid.dp, ...
            return self.__dict__["sizes"][name]
        raise AttributeError(name)

    def _radix(self) -> list[tuple[str, int]]:
        return [(axis, self.sizes[axis]) for axis in self.order.split("-")]

    def coords(self, rank: int) -> dict[str, int]:
        """Rank -> {axis: coordinate} for every axis."""
        out = {}
        for axis, size in self._radix():
            out[axis] = rank % size
            rank //= size
        return out

    def rank(self, **coords: int) -> int:
        """{axis: coordinate} (missing axes at 0) -> rank."""
        rank, stride = 0, 1
        for axis, size in self._radix():
            rank += coords.get(axis, 0) * stride
            stride *= size
        return rank

    def groups(self, axes: tuple[str, ...]) -> list[list[int]]:
        """Rank lists whose members differ only along `axes`, each sorted (so a one-axis group is ordered by
        that axis: element i of a pp group holds stage i), the lists in a deterministic order."""
        found: dict[tuple, list[int]] = {}
        for rank in range(self.world_size):
            c = self.coords(rank)
            found.setdefault(tuple(c[a] for a in AXES if a not in axes), []).append(rank)
        return sorted(sorted(v) for v in found.values())

    def named_groups(self, name: str) -> list[list[int]]:
        """The rank lists of a group of GROUPS, or "embedding": the first and last stage of every pipeline."""
        if name == "embedding":
            return [sorted({g[0], g[-1]}) for g in self.groups(("pp",))]
        return self.groups(GROUPS[name])


_SUFFIXES = ("size", "rank", "ranks", "group")


@dataclass(frozen=True, init=False, eq=False)
class ParallelState:
    """Everything a rank needs to know about its place in the grid. Groups are None on one process.

    Read by name: `size(*axes)`, `rank_in(*axes)`, `group(*axes)`, or the attribute spellings
    `<name>_size`, `<name>_rank`, `<name>_ranks`, `<name>_group` for an axis or a group of GROUPS
    (`ps.cp_rank`, `ps.dp_cp_group`, `ps.embedding_group`). Built by `initialize_model_parallel`, or by hand
    with the same keywords: `ParallelState(rank=1, world_size=2, cp_size=2, cp_rank=1, cp_group=g)`.
    """
    rank: int = 0
    world_size: int = 1
    vpp_size: int = 1
    order: str = DEFAULT_ORDER
    sizes: Mapping[str, int] = field(default_factory=dict)
    coords: Mapping[str, int] = field(default_factory=dict)
    ranks: Mapping[str, tuple] = field(default_factory=dict)
    groups: Mapping[str, Any] = field(default_factory=dict)

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

    def group(self, *axes: str) -> Any:
        return self._group(_group_name(axes))

    def _group(self, name: str) -> Any:
        """The process group `name`, or None: on one process, or in a state built by hand without it (the HF
        converter builds tensor-parallel shards that way, one process and no group)."""
        return self.groups.get(name)

    def __getattr__(self, key: str) -> Any:
        name, _, kind = key.rpartition("_")
        per_rank = kind in ("size", "rank")     # sizes and ranks exist for axes and groups, not "embedding"
        if kind not in _SUFFIXES or not (name in AXES or name in GROUPS or (name == "embedding" and not per_rank)):
            raise AttributeError(f"{type(self).__name__} has no attribute {key!r}")
        axes = GROUPS.get(name, (name,))
        if kind == "size":
            return self.size(*axes)
        if kind == "rank":
            return self.rank_in(*axes)
        if kind == "ranks":
            return self.ranks.get(name, (self.rank,))
        return self._group(name)

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp_size - 1


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


"""The job's parallel axes and process groups by name, and the pure rank math over them.

`AXES` and `GROUPS` are the one description of the axes a job may have and of the groups over them
(docs/design.md section 2 says how to add one). `RankGrid` lays ranks out over any axes in any order,
fastest-varying first, without processes, so the layout is testable on its own; `parallel_state` creates the
process groups from it.
"""
from __future__ import annotations

import functools
import math

# name -> what it splits. Megatron's default rank order is this order, fastest-varying first (tp-cp-dp-pp).
AXES = {
    "tp": "tensor: heads and feature dimensions of every layer",
    "cp": "context: the sequence, two of 2N causal-balanced chunks per rank",
    "dp": "data: the global batch (and, with ZeRO, optimizer state, gradients and weights)",
    "pp": "pipeline: the layers, in stages",
}
DEFAULT_ORDER = "-".join(AXES)

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

    @property
    def tp(self) -> int:
        return self.sizes["tp"]

    @property
    def cp(self) -> int:
        return self.sizes["cp"]

    @property
    def dp(self) -> int:
        return self.sizes["dp"]

    @property
    def pp(self) -> int:
        return self.sizes["pp"]

    @functools.cached_property
    def _all_coords(self) -> list[dict[str, int]]:
        """Every rank's coordinates, computed once: each group name walks them all."""
        return [self.coords(rank) for rank in range(self.world_size)]

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
        for rank, c in enumerate(self._all_coords):
            found.setdefault(tuple(c[a] for a in AXES if a not in axes), []).append(rank)
        return sorted(sorted(v) for v in found.values())

    def named_groups(self, name: str) -> list[list[int]]:
        """The rank lists of a group of GROUPS, or "embedding": the first and last stage of every pipeline."""
        if name == "embedding":
            return [sorted({g[0], g[-1]}) for g in self.groups(("pp",))]
        return self.groups(GROUPS[name])

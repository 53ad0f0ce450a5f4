"""Rank grid and process groups for tensor, pipeline, data and virtual-pipeline parallelism.

The rank math is pure (`RankGrid`), so it is testable without processes. `initialize_model_parallel`
creates every group once and returns a frozen `ParallelState` that model, schedules and optimizer receive
explicitly (docs/design.md section 2). There are no Megatron-style accessors over a module global (they
silently return the wrong group once a process holds two layouts); the global only refuses a second
`initialize_model_parallel` before `destroy_model_parallel`.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

_AXES = ("tp", "dp", "pp")


@dataclass(frozen=True)
class RankGrid:
    """Mixed-radix rank layout; `order` lists axes fastest-varying first (Megatron default tp-dp-pp)."""
    world_size: int
    tp: int
    pp: int
    order: str = "tp-dp-pp"

    def __post_init__(self) -> None:
        assert self.world_size % (self.tp * self.pp) == 0, "world size must be divisible by tp*pp"
        assert sorted(self.order.split("-")) == sorted(_AXES), f"bad order {self.order}"

    @property
    def dp(self) -> int:
        return self.world_size // (self.tp * self.pp)

    def _sizes(self) -> list[tuple[str, int]]:
        size = {"tp": self.tp, "dp": self.dp, "pp": self.pp}
        return [(axis, size[axis]) for axis in self.order.split("-")]

    def coords(self, rank: int) -> dict[str, int]:
        """Rank -> {"tp": tp_rank, "dp": dp_rank, "pp": pp_rank}."""
        out = {}
        for axis, size in self._sizes():
            out[axis] = rank % size
            rank //= size
        return out

    def rank(self, tp: int, dp: int, pp: int) -> int:
        coords = {"tp": tp, "dp": dp, "pp": pp}
        rank, stride = 0, 1
        for axis, size in self._sizes():
            rank += coords[axis] * stride
            stride *= size
        return rank

    def groups(self, axes: tuple[str, ...]) -> list[list[int]]:
        """Rank lists whose members differ only along `axes` (sorted, deterministic order)."""
        found: dict[tuple, list[int]] = {}
        for rank in range(self.world_size):
            c = self.coords(rank)
            key = tuple(c[a] for a in _AXES if a not in axes)
            found.setdefault(key, []).append(rank)
        return sorted(sorted(v) for v in found.values())

    def embedding_groups(self) -> list[list[int]]:
        """First and last pipeline rank of every pipeline group (one rank when pp == 1)."""
        return [sorted({g[0], g[-1]}) for g in self.pp_groups()]

    def tp_groups(self) -> list[list[int]]:
        return self.groups(("tp",))

    def pp_groups(self) -> list[list[int]]:
        """Ordered by pipeline stage: element i is the rank holding stage i."""
        out = []
        for group in self.groups(("pp",)):
            out.append(sorted(group, key=lambda r: self.coords(r)["pp"]))
        return sorted(out)

    def dp_groups(self) -> list[list[int]]:
        return self.groups(("dp",))

    def mp_groups(self) -> list[list[int]]:
        return self.groups(("tp", "pp"))


@dataclass(frozen=True)
class ParallelState:
    """Everything a rank needs to know about its place in the grid. Groups are None on one process."""
    rank: int = 0
    world_size: int = 1
    tp_size: int = 1
    pp_size: int = 1
    dp_size: int = 1
    vpp_size: int = 1
    tp_rank: int = 0
    pp_rank: int = 0
    dp_rank: int = 0
    order: str = "tp-dp-pp"
    pp_ranks: tuple = (0,)              # global rank of each pipeline stage in my pipeline group
    tp_ranks: tuple = (0,)
    dp_ranks: tuple = (0,)
    tp_group: Any = None
    pp_group: Any = None
    dp_group: Any = None
    mp_group: Any = None
    embedding_group: Any = None

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp_size - 1


_STATE: Optional[ParallelState] = None


def initialize_model_parallel(tp: int = 1, pp: int = 1, vpp: int = 1, order: str = "tp-dp-pp") -> ParallelState:
    """Create TP, PP, DP, model-parallel and embedding groups (collective: every rank calls it)."""
    import torch.distributed as dist

    global _STATE
    if _STATE is not None:
        raise RuntimeError("initialize_model_parallel was already called; call destroy_model_parallel first")
    if not dist.is_initialized():
        raise RuntimeError("torch.distributed must be initialised before initialize_model_parallel")
    world, rank = dist.get_world_size(), dist.get_rank()
    grid = RankGrid(world, tp, pp, order)
    mine: dict[str, Any] = {}
    for name, lists in (("tp", grid.tp_groups()), ("pp", grid.pp_groups()), ("dp", grid.dp_groups()),
                        ("mp", grid.mp_groups()), ("embedding", grid.embedding_groups())):
        for ranks in lists:
            group = dist.new_group(ranks)  # every rank creates every group, in the same order
            if rank in ranks:
                mine[name], mine[name + "_ranks"] = group, tuple(ranks)
    c = grid.coords(rank)
    _STATE = ParallelState(rank=rank, world_size=world, tp_size=tp, pp_size=pp, dp_size=grid.dp, vpp_size=vpp,
                           tp_rank=c["tp"], pp_rank=c["pp"], dp_rank=c["dp"], order=order,
                           pp_ranks=mine["pp_ranks"], tp_ranks=mine["tp_ranks"], dp_ranks=mine["dp_ranks"],
                           tp_group=mine["tp"], pp_group=mine["pp"], dp_group=mine["dp"], mp_group=mine["mp"],
                           embedding_group=mine.get("embedding"))
    return _STATE


def destroy_model_parallel() -> None:
    global _STATE
    _STATE = None

"""The job's ranks without the machines: its distinct roles, and one fake process group per role.

torch's fake backend (`torch.testing._internal.distributed.fake_pg`) takes any rank of any world size in one
process; its collectives return at once. torch registers it for cpu, cuda, hpu and xpu; with the meta device
added to that list (`Backend.backend_capability`) it also takes meta tensors in `batch_isend_irecv` (context
parallelism's ring), which otherwise finds no backend for them. One process group holds one rank, so
the dry run joins the world once per role, as that role's rank, and leaves it before the next
(`role_world`); the real `initialize_model_parallel` then builds every group, and `check_groups` holds each
group's members against the pure rank math (`RankGrid`).

A role is a (tp, cp, pp) position: ranks that differ only in their data-parallel index hold the same shards
and run the same code on different samples, so one of them (dp index 0) stands for all (`roles`).
"""
from __future__ import annotations

import contextlib
import sys
from dataclasses import dataclass
from typing import Iterator

import torch.distributed as dist

from llamapipe.core.config import ParallelConfig
from llamapipe.core.parallel_state import GROUPS, ParallelState, RankGrid, destroy_model_parallel, \
    initialize_model_parallel



@dataclass(frozen=True)
class Role:
    """One distinct rank of the job: the rank that stands for it (dp index 0) and every rank it stands for."""
    rank: int
    coords: dict
    ranks: tuple[int, ...]

    def name(self) -> str:
        where = ", ".join(f"{axis} {self.coords[axis]}" for axis in ("tp", "cp", "pp") if axis in self.coords)
        return f"rank {self.rank} ({where})"


def grid_of(par: ParallelConfig) -> RankGrid:
    """The job's rank grid, as `initialize_model_parallel` lays it out."""
    return RankGrid(par.world_size, par.tp_size, par.pp_size, par.order, **_other_axes(par.sizes))


def _other_axes(sizes: dict) -> dict:
    return {axis: n for axis, n in sizes.items() if axis not in ("tp", "pp", "dp")}   # dp: what is left


def roles(par: ParallelConfig) -> list[Role]:
    """Every distinct role, in rank order of the ranks that stand for them."""
    grid = grid_of(par)
    found: dict[tuple, list[int]] = {}
    for rank in range(par.world_size):
        coords = grid.coords(rank)
        found.setdefault(tuple(coords[a] for a in ("tp", "cp", "pp")), []).append(rank)
    out = [Role(ranks[0], {a: c for a, c in grid.coords(ranks[0]).items() if a != "dp"}, tuple(ranks))
           for ranks in found.values()]
    return sorted(out, key=lambda role: role.rank)


@contextlib.contextmanager
def role_world(role: Role, par: ParallelConfig) -> Iterator[ParallelState]:
    """This role's rank in a fake world of the job's size, and its parallel state (every group created);
    both are torn down on exit."""
    hook = sys.excepthook      # joining a world wraps it to prefix "[rank N]:"; one prefix per role would pile up
    dist.init_process_group("fake", store=_fake_store(), rank=role.rank, world_size=par.world_size)
    try:
        yield initialize_model_parallel(par.tp_size, par.pp_size, par.vpp_size, par.order, **_other_axes(par.sizes))
    finally:
        destroy_model_parallel()
        dist.destroy_process_group()
        sys.excepthook = hook


def _fake_store() -> dist.Store:
    from torch.testing._internal.distributed.fake_pg import FakeStore    # registers the fake backend
    devices = dist.Backend.backend_capability[dist.Backend.FAKE]
    if "meta" not in devices:
        devices.append("meta")
    return FakeStore()


class GridGroups:
    """Every group of the rank grid by name, and the one holding each rank (computed once for all roles)."""

    def __init__(self, grid: RankGrid) -> None:
        self.of: dict[str, dict[int, tuple[int, ...]]] = {}
        for name in (*GROUPS, "embedding"):     # one tuple per group, shared by its ranks: linear in the world
            self.of[name] = {rank: members for members in map(tuple, grid.named_groups(name)) for rank in members}
        self.coords = grid.coords


def check_groups(ps: ParallelState, grid: GridGroups) -> None:
    """Every group of this rank against the rank grid: its members, its size and this rank's place in it."""
    for name in (*GROUPS, "embedding"):
        expected = grid.of[name].get(ps.rank)         # None: not a member (the embedding group's middle stages)
        members = ps.ranks.get(name)
        assert members == expected, f"rank {ps.rank}: group {name} holds {members}, the rank grid says {expected}"
        group = ps.groups.get(name)         # None in a state built by hand (no process group)
        if expected is not None and group is not None:
            size, rank = dist.get_world_size(group), dist.get_rank(group)
            assert (size, rank) == (len(expected), expected.index(ps.rank)), \
                f"rank {ps.rank}: group {name} has size {size} and rank {rank}, members {expected}"
    assert dict(ps.coords) == grid.coords(ps.rank), f"rank {ps.rank}: coordinates {dict(ps.coords)}"

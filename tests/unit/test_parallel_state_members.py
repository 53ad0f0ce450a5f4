"""ParallelState's and RankGrid's typed members follow AXES and GROUPS: each is a written-out property (no
__getattr__) and reads what size(), rank_in() and group() read, on a state built by hand and on one built from
a RankGrid as initialize_model_parallel builds it."""
import inspect

import pytest

from llamapipe.core.parallel_state import AXES, GROUPS, ParallelState, RankGrid

RETURNS = {"size": "int", "rank": "int", "ranks": "tuple[int, ...]", "group": "Optional[ProcessGroup]"}


def members() -> dict[str, tuple[str, ...]]:
    """Every name with typed members -> the suffixes it must have, read from AXES and GROUPS (not a fixed list)."""
    names = {name: tuple(RETURNS) for name in (*AXES, *GROUPS)}
    names["embedding"] = ("ranks", "group")
    return names


def missing_members(cls: type) -> list[str]:
    """The members of `members()` that `cls` does not define as a property with the expected return type."""
    missing = []
    for name, suffixes in members().items():
        for suffix in suffixes:
            attr = inspect.getattr_static(cls, f"{name}_{suffix}", None)
            if not isinstance(attr, property) or attr.fget.__annotations__.get("return") != RETURNS[suffix]:
                missing.append(f"{name}_{suffix}")
    return missing


def expected(ps: ParallelState, name: str) -> dict:
    """What the members of `name` must read, through the by-axes readers."""
    if name == "embedding":
        return {"ranks": ps.ranks.get("embedding", (ps.rank,)), "group": ps.groups.get("embedding")}
    axes = GROUPS.get(name, (name,))
    return {"size": ps.size(*axes), "rank": ps.rank_in(*axes), "ranks": ps.ranks.get(name, (ps.rank,)),
            "group": ps.group(*axes)}


def test_every_axis_and_group_has_its_typed_properties():
    assert missing_members(ParallelState) == []
    assert not hasattr(ParallelState, "__getattr__") and not hasattr(RankGrid, "__getattr__")
    for axis in AXES:
        prop = inspect.getattr_static(RankGrid, axis, None)
        assert isinstance(prop, property) and prop.fget.__annotations__["return"] == "int", axis
    for absent in ("embedding_size", "embedding_rank"):     # the embedding group has no axis of its own
        assert inspect.getattr_static(ParallelState, absent, None) is None


def test_a_new_group_without_its_properties_is_reported(monkeypatch):
    monkeypatch.setitem(GROUPS, "ep_dp", ("dp",))
    assert missing_members(ParallelState) == ["ep_dp_size", "ep_dp_rank", "ep_dp_ranks", "ep_dp_group"]


def test_members_read_what_the_by_axes_readers_read_on_a_hand_built_state():
    ps = ParallelState(rank=5, world_size=8, order="tp-cp-dp-pp", sizes={"tp": 2, "cp": 2, "dp": 2},
                       coords={"tp": 1, "cp": 0, "dp": 1}, groups={"tp": "t", "dp_cp": "r"}, ranks={"tp": (4, 5)})
    for name, suffixes in members().items():
        want = expected(ps, name)
        assert {s: getattr(ps, f"{name}_{s}") for s in suffixes} == want, name
    # an independent reference for a few: mixed radix cp 0 + 2 * dp 1, and what was given or nothing
    assert (ps.dp_cp_size, ps.dp_cp_rank, ps.mp_size, ps.pp_rank) == (4, 2, 2, 0)
    assert (ps.tp_ranks, ps.tp_group, ps.dp_cp_group, ps.cp_group, ps.embedding_ranks) == ((4, 5), "t", "r", None,
                                                                                             (5,))


@pytest.mark.parametrize("rank", [0, 6, 13])
def test_members_read_what_the_by_axes_readers_read_on_a_grid_built_state(rank):
    grid = RankGrid(16, tp=2, pp=2, cp=2)
    groups, ranks = {}, {}
    for name in (*GROUPS, "embedding"):     # as initialize_model_parallel does, a named stand-in per group
        mine = [m for m in grid.named_groups(name) if rank in m]
        if mine:
            groups[name], ranks[name] = f"{name} {mine[0]}", tuple(mine[0])
    ps = ParallelState(rank=rank, world_size=16, order=grid.order, sizes=dict(grid.sizes),
                       coords=grid.coords(rank), ranks=ranks, groups=groups)
    assert (grid.tp, grid.cp, grid.dp, grid.pp) == tuple(grid.sizes[a] for a in AXES) == (2, 2, 2, 2)
    for name, suffixes in members().items():
        assert {s: getattr(ps, f"{name}_{s}") for s in suffixes} == expected(ps, name), name
        mine = [m for m in grid.named_groups(name) if rank in m][0]    # the reference: the grid's member list
        assert getattr(ps, f"{name}_ranks") == tuple(mine) and getattr(ps, f"{name}_group") == f"{name} {mine}"
        if name != "embedding":
            assert (getattr(ps, f"{name}_size"), getattr(ps, f"{name}_rank")) == (len(mine), mine.index(rank))


def test_unknown_members_are_attribute_errors():
    ps, grid = ParallelState(tp_size=2), RankGrid(4, tp=2)
    for bad in ("xp_size", "embedding_size", "embedding_rank", "tp_sizes", "dp_cp", "size_tp"):
        with pytest.raises(AttributeError):
            getattr(ps, bad)
    with pytest.raises(AttributeError):
        grid.xp
    assert not hasattr(grid, "dp_cp")

"""Rank grid math (pure) and real process groups (8 gloo ranks) agree with each other."""
import itertools

import pytest
import torch
import torch.distributed as dist

from llamapipe.core.parallel_state import RankGrid, destroy_model_parallel, initialize_model_parallel
from tests.harness import RankFailure, run_distributed

LAYOUTS = [(w, tp, pp) for w in (1, 2, 4, 6, 8, 12, 16) for tp in (1, 2, 4) for pp in (1, 2, 3, 4)
           if w % (tp * pp) == 0]
ORDERS = ["tp-dp-pp", "tp-pp-dp", "dp-tp-pp", "pp-tp-dp"]


@pytest.mark.parametrize("world,tp,pp", LAYOUTS)
@pytest.mark.parametrize("order", ORDERS)
def test_coords_round_trip_and_groups_partition(world, tp, pp, order):
    grid = RankGrid(world, tp, pp, order)
    for rank in range(world):
        c = grid.coords(rank)
        assert grid.rank(c["tp"], c["dp"], c["pp"]) == rank
    for groups, size in ((grid.tp_groups(), tp), (grid.pp_groups(), pp), (grid.dp_groups(), grid.dp),
                         (grid.mp_groups(), tp * pp)):
        assert sorted(itertools.chain(*groups)) == list(range(world))   # a partition of all ranks
        assert all(len(g) == size for g in groups)


def test_megatron_default_order_matches_megatron_layout():
    # Megatron, world 8, tp 2, pp 2: TP groups [0,1],[2,3]..; PP groups [0,4],[1,5]..; DP [0,2],[1,3],[4,6],[5,7]
    grid = RankGrid(8, 2, 2)
    assert grid.tp_groups() == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert grid.pp_groups() == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert grid.dp_groups() == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert grid.embedding_groups() == [[0, 4], [1, 5], [2, 6], [3, 7]]


def test_pp_groups_are_ordered_by_stage():
    grid = RankGrid(8, 1, 4, "pp-tp-dp")    # pp fastest here
    assert grid.pp_groups() == [[0, 1, 2, 3], [4, 5, 6, 7]]
    for group in RankGrid(12, 2, 3, "tp-dp-pp").pp_groups():
        assert [RankGrid(12, 2, 3).coords(r)["pp"] for r in group] == [0, 1, 2]


def _group_sums(rank, world, tp, pp, order):
    state = initialize_model_parallel(tp, pp, 1, order)
    sums = {}
    for name in ("tp", "pp", "dp", "mp", "embedding"):
        group = getattr(state, f"{name}_group")
        t = torch.tensor([float(rank)])
        if group is not None:
            dist.all_reduce(t, group=group)
        sums[name] = t.item()
    with pytest.raises(RuntimeError):
        initialize_model_parallel(tp, pp, 1, order)
    destroy_model_parallel()
    return sums, (state.tp_rank, state.dp_rank, state.pp_rank)


@pytest.mark.slow
@pytest.mark.parametrize("tp,pp,order", [(2, 2, "tp-dp-pp"), (2, 4, "tp-pp-dp"), (4, 1, "dp-tp-pp")])
def test_allreduce_in_every_group_sums_predicted_ranks(tp, pp, order):
    world = 8
    grid = RankGrid(world, tp, pp, order)
    results = run_distributed(_group_sums, world, tp, pp, order)
    expected = {"tp": grid.tp_groups(), "pp": grid.pp_groups(), "dp": grid.dp_groups(),
                "mp": grid.mp_groups(), "embedding": grid.embedding_groups()}
    for rank, (sums, coords) in enumerate(results):
        c = grid.coords(rank)
        assert coords == (c["tp"], c["dp"], c["pp"])
        for name, groups in expected.items():
            mine = [g for g in groups if rank in g]
            want = float(sum(mine[0])) if mine else float(rank)
            assert sums[name] == want, (rank, name)


def _fail_on_rank_one(rank, world):
    if rank == 1:
        raise ValueError("deliberate failure on rank 1")
    dist.barrier()  # the others would wait forever without the harness's fail-fast
    return rank


@pytest.mark.slow
def test_harness_fails_fast_with_the_failing_ranks_traceback():
    with pytest.raises(RankFailure) as info:
        run_distributed(_fail_on_rank_one, 4, timeout=60)
    assert "rank 1 failed" in str(info.value)
    assert "deliberate failure on rank 1" in str(info.value)


def test_a_second_initialisation_is_refused_until_destroyed(monkeypatch):
    """The one use of the module global (there are no accessors over it): groups are created once."""
    from llamapipe.core import parallel_state
    monkeypatch.setattr(parallel_state, "_STATE", object())     # as after an initialize_model_parallel
    with pytest.raises(RuntimeError, match="already called; call destroy_model_parallel first"):
        parallel_state.initialize_model_parallel(1, 1)
    destroy_model_parallel()
    assert parallel_state._STATE is None

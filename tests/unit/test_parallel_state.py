"""Rank grid math (pure) over named axes and real process groups (8 gloo ranks) agree with each other."""
import itertools

import pytest
import torch
import torch.distributed as dist

from llamapipe.core.parallel_state import (GROUPS, ParallelState, RankGrid, destroy_model_parallel, full_order,
                                           initialize_model_parallel)
from tests.harness import RankFailure, run_distributed

LAYOUTS = [(w, tp, pp) for w in (1, 2, 4, 6, 8, 12, 16) for tp in (1, 2, 4) for pp in (1, 2, 3, 4)
           if w % (tp * pp) == 0]
ORDERS = ["tp-dp-pp", "tp-pp-dp", "dp-tp-pp", "pp-tp-dp", "tp-cp-dp-pp", "cp-pp-tp-dp"]


@pytest.mark.parametrize("world,tp,pp", LAYOUTS)
@pytest.mark.parametrize("order", ORDERS)
def test_coords_round_trip_and_groups_partition(world, tp, pp, order):
    grid = RankGrid(world, tp, pp, order)
    for rank in range(world):
        c = grid.coords(rank)
        assert grid.rank(**c) == rank
    for groups, size in ((grid.named_groups("tp"), tp), (grid.named_groups("pp"), pp),
                         (grid.named_groups("dp"), grid.dp), (grid.named_groups("mp"), tp * pp)):
        assert sorted(itertools.chain(*groups)) == list(range(world))   # a partition of all ranks
        assert all(len(g) == size for g in groups)


def test_megatron_default_order_matches_megatron_layout():
    # Megatron, world 8, tp 2, pp 2: TP groups [0,1],[2,3]..; PP groups [0,4],[1,5]..; DP [0,2],[1,3],[4,6],[5,7]
    grid = RankGrid(8, 2, 2)
    assert grid.named_groups("tp") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert grid.named_groups("pp") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert grid.named_groups("dp") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert grid.named_groups("embedding") == [[0, 4], [1, 5], [2, 6], [3, 7]]


def test_megatron_order_with_context_parallelism():
    # Megatron's RankGenerator, world 16, tp 2, cp 2, pp 2 (order tp-cp-ep-dp-pp): tp [0,1]..; cp [0,2],[1,3]..;
    # dp [0,4],[1,5]..; pp [0,8]..; the dp-cp group (gradients) [0,2,4,6],[1,3,5,7]..
    grid = RankGrid(16, tp=2, pp=2, cp=2)
    assert (grid.tp, grid.cp, grid.dp, grid.pp) == (2, 2, 2, 2)
    assert grid.named_groups("cp")[:2] == [[0, 2], [1, 3]]
    assert grid.named_groups("dp")[:2] == [[0, 4], [1, 5]]
    assert grid.named_groups("pp")[:2] == [[0, 8], [1, 9]]
    assert grid.named_groups("dp_cp")[:2] == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert grid.named_groups("tp_cp")[:2] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert grid.coords(6) == {"tp": 0, "cp": 1, "dp": 1, "pp": 0}


def test_an_order_without_cp_places_it_after_tp_and_bad_orders_are_refused():
    assert full_order("tp-dp-pp") == "tp-cp-dp-pp"
    assert full_order("pp-tp-dp") == "pp-tp-cp-dp"
    assert full_order("dp-pp") == "tp-cp-dp-pp"
    for bad in ("tp-tp-dp-pp", "tp-xp-dp-pp"):
        with pytest.raises(ValueError, match="must name each of tp, cp, dp, pp at most once"):
            full_order(bad)


def test_state_reads_axes_and_groups_by_name():
    ps = ParallelState(rank=5, world_size=8, order="tp-cp-dp-pp", sizes={"tp": 2, "cp": 2, "dp": 2},
                       coords={"tp": 1, "cp": 0, "dp": 1})
    assert (ps.tp_size, ps.cp_size, ps.dp_size, ps.pp_size) == (2, 2, 2, 1)
    assert ps.size("dp", "cp") == ps.dp_cp_size == 4
    assert ps.rank_in("dp", "cp") == ps.dp_cp_rank == 2      # mixed radix: cp 0 + 2 * dp 1
    assert ps.dp_ranks == (5,)
    assert ps.cp_group is None and ps.group("cp", "dp") is None     # built by hand without groups
    one = ParallelState(rank=1, world_size=2, cp_size=2, cp_rank=1, cp_group="g", cp_ranks=(0, 1))
    assert one.dp_cp_group == "g" and one.dp_cp_ranks == (0, 1) and one.dp_cp_rank == 1   # dp 1: dp_cp is cp
    assert ParallelState(tp_size=2, tp_group="t").tp_cp_group == "t" and ParallelState().dp_cp_group is None
    for bad in ("embedding_size", "embedding_rank"):
        assert not hasattr(ps, bad)
    legacy = ParallelState(tp_size=2, world_size=2, pp_rank=0)   # the keyword spelling
    assert legacy.tp_size == 2 and legacy.cp_size == 1 and legacy.is_last_stage
    with pytest.raises(TypeError, match="unexpected keyword argument 'xp_size'"):
        ParallelState(xp_size=2)
    with pytest.raises(AttributeError):
        ps.xp_size
    with pytest.raises(KeyError, match=r"no process group over pp\+cp"):
        ps.group("pp", "cp")
    assert set(GROUPS) >= {"tp", "cp", "dp", "pp", "dp_cp"}


def test_pp_groups_are_ordered_by_stage():
    grid = RankGrid(8, 1, 4, "pp-tp-dp")    # pp fastest here
    assert grid.named_groups("pp") == [[0, 1, 2, 3], [4, 5, 6, 7]]
    for group in RankGrid(12, 2, 3, "tp-dp-pp").named_groups("pp"):
        assert [RankGrid(12, 2, 3).coords(r)["pp"] for r in group] == [0, 1, 2]


def _group_sums(rank, world, tp, pp, order, cp=1):
    state = initialize_model_parallel(tp, pp, 1, order, cp=cp)
    sums = {}
    for name in (*GROUPS, "embedding"):
        group = getattr(state, f"{name}_group")
        t = torch.tensor([float(rank)])
        if group is not None:
            dist.all_reduce(t, group=group)
        sums[name] = t.item()
    with pytest.raises(RuntimeError):
        initialize_model_parallel(tp, pp, 1, order)
    destroy_model_parallel()
    return sums, (state.tp_rank, state.cp_rank, state.dp_rank, state.pp_rank)


@pytest.mark.slow
@pytest.mark.parametrize("tp,pp,cp,order", [(2, 2, 1, "tp-dp-pp"), (2, 4, 1, "tp-pp-dp"), (4, 1, 1, "dp-tp-pp"),
                                            (2, 1, 2, "tp-cp-dp-pp")])
def test_allreduce_in_every_group_sums_predicted_ranks(tp, pp, cp, order):
    world = 8
    grid = RankGrid(world, tp, pp, order, cp=cp)
    results = run_distributed(_group_sums, world, tp, pp, order, cp)
    expected = {name: grid.named_groups(name) for name in (*GROUPS, "embedding")}
    for rank, (sums, coords) in enumerate(results):
        c = grid.coords(rank)
        assert coords == (c["tp"], c["cp"], c["dp"], c["pp"])
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

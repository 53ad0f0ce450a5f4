"""The layer balancer and its cost models (core/pipeline_parallel/stage_balance.py): the split it picks against
an exhaustive search over every split, where measured costs and the analytic FLOP model move layers, and the
tensor-parallel collectives it charges, counted by hand."""
from __future__ import annotations

import itertools

import pytest

from llamapipe.core.pipeline_parallel.layout import layout_layer_counts
from llamapipe.core.pipeline_parallel.profile_costs import PassCosts
from llamapipe.core.pipeline_parallel.stage_balance import (allgather_s, allreduce_s, analytic_parts,
                                                            balanced_counts, layout_string, rank_work, stage_ranks,
                                                            tp_comm_parts, tp_parts)
from llamapipe.training.flag_names import worded_as_flags


def parts(layer=3.0, embedding=0.0, head=3.0) -> dict[str, PassCosts]:
    """F + B + W per component as given (split F:B:W 1:1:1)."""
    return {name: PassCosts(x / 3, x / 3, x / 3) for name, x in
            (("layer", layer), ("embedding", embedding), ("head", head))}


def best_by_search(costs, num_layers, ranks, vocab_parallel=False) -> float:
    """The lowest busiest-rank work over every split with at least one layer per stage (the reference)."""
    stages, best = len(ranks), float("inf")
    for cuts in itertools.combinations(range(1, num_layers), stages - 1):
        bounds = (0, *cuts, num_layers)
        counts = [bounds[i + 1] - bounds[i] for i in range(stages)]
        best = min(best, max(rank_work(costs, counts, ranks, vocab_parallel)))
    return best


def test_placements_put_stages_on_the_ranks_the_schedules_use():
    assert stage_ranks(4, 1, "interleaved") == [0, 1, 2, 3]
    assert stage_ranks(2, 3, "interleaved") == [0, 1, 0, 1, 0, 1]
    assert stage_ranks(3, 2, "v") == [0, 1, 2, 2, 1, 0]


def test_a_heavy_head_moves_layers_off_the_last_stage():
    """Head = 4 layers at pp 2, 8 layers: the even 4/4 gives 4 vs 8 layers' work, 6/2 gives 6 and 6."""
    costs = parts(head=12.0)
    assert rank_work(costs, [4, 4], [0, 1]) == pytest.approx([12.0, 24.0])
    counts = balanced_counts(costs, 8, [0, 1])
    assert counts == [6, 2]
    assert rank_work(costs, counts, [0, 1]) == pytest.approx([18.0, 18.0])


@pytest.mark.parametrize("pp,vpp,placement,layers", [(2, 1, "interleaved", 8), (4, 1, "interleaved", 12),
                                                     (2, 2, "v", 10), (2, 2, "interleaved", 9),
                                                     (3, 2, "v", 12)])
@pytest.mark.parametrize("embedding,head", [(0.0, 9.0), (2.0, 5.0), (6.0, 1.0), (0.5, 0.5)])
def test_balanced_split_is_as_good_as_an_exhaustive_search(pp, vpp, placement, layers, embedding, head):
    ranks = stage_ranks(pp, vpp, placement)
    costs = parts(layer=3.0, embedding=embedding, head=head)
    counts = balanced_counts(costs, layers, ranks)
    assert sum(counts) == layers and min(counts) >= 1
    assert max(rank_work(costs, counts, ranks)) == pytest.approx(best_by_search(costs, layers, ranks), rel=1e-9)


def test_vocabulary_parallelism_spreads_the_head_so_the_split_stays_even():
    costs = parts(embedding=2.0, head=9.0)
    assert balanced_counts(costs, 8, [0, 1], vocab_parallel=True) == [4, 4]
    assert rank_work(costs, [4, 4], [0, 1], vocab_parallel=True) == pytest.approx([12 + 5.5, 12 + 5.5])


def test_too_few_layers_for_the_stages_is_refused():
    with pytest.raises(ValueError, match="--num-layers 3 is fewer than the 4 virtual stages"), worded_as_flags():
        balanced_counts(parts(), 3, [0, 1, 1, 0])


def test_layout_string_round_trips_through_the_layout_parser():
    for counts in ([6, 2], [1, 3, 2, 2], [1, 1]):
        text = layout_string(counts)
        assert layout_layer_counts(text, sum(counts), 2) == counts
    assert layout_string([3, 5]) == "Et*3|t*5L"


def llama_8b_parts(**kw) -> dict[str, PassCosts]:
    return analytic_parts(hidden=4096, ffn_hidden=14336, heads=32, kv_heads=8, head_dim=128, vocab=128256,
                          seq_length=8192, micro_batch=1, **kw)


def test_analytic_model_counts_the_flops_by_hand():
    """hidden 4, ffn 8, 2 heads of 2, 1 kv head, vocab 10, seq 3, mbs 2 (6 tokens); element cost 1."""
    p = analytic_parts(hidden=4, ffn_hidden=8, heads=2, kv_heads=1, head_dim=2, vocab=10, seq_length=3,
                       micro_batch=2, element_flops=1.0)
    matmul = 4 * (2 + 2) * 2 + 2 * 2 * 4 + 3 * 4 * 8      # q,k,v 32 + o 16 + gate/up/down 96 = 144
    attention = 4 * 3 * 2 * 2
    assert p["layer"].f == 6 * (2 * matmul + attention)
    assert p["layer"].b == 6 * (2 * matmul + 2 * attention)
    assert p["layer"].w == 6 * 2 * matmul
    assert p["head"].w == 6 * 2 * 10 * 4
    assert p["head"].f == 6 * 2 * 10 * 4 + 2 * 6 * 10
    assert p["embedding"].b == 10 * 4 + 6 * 4
    full = analytic_parts(hidden=4, ffn_hidden=8, heads=2, kv_heads=1, head_dim=2, vocab=10, seq_length=3,
                          micro_batch=2, recompute="full", element_flops=1.0)
    assert full["layer"].b == p["layer"].b + p["layer"].f


def test_analytic_model_gives_the_stages_with_a_big_vocabulary_fewer_layers():
    """LLaMA 3 8B (vocabulary 128,256) at pp 4: its head is about 2.3 layers' work, so the last stage gets
    fewer layers than the middle ones; with the embedding's dense gradient on a GPU the first one does too."""
    costs = llama_8b_parts(element_flops=2000.0)
    counts = balanced_counts(costs, 32, stage_ranks(4, 1, "interleaved"))
    assert sum(counts) == 32
    assert counts[-1] < counts[1] and counts[-1] < counts[2]
    assert counts[0] < counts[1]
    head_in_layers = sum(vars(costs["head"]).values()) / sum(vars(costs["layer"]).values())
    assert 2.0 < head_in_layers < 3.0
    small_vocab = analytic_parts(hidden=4096, ffn_hidden=14336, heads=32, kv_heads=8, head_dim=128, vocab=512,
                                 seq_length=8192, micro_batch=1)
    assert balanced_counts(small_vocab, 32, stage_ranks(4, 1, "interleaved")) == [8, 8, 8, 8]


COMM = {"allreduce_latency_s": 1e-3, "allreduce_bus_bandwidth_Bps": 1e6}


def test_collectives_of_a_sequence_parallel_layer_on_gloo_are_counted_one_by_one():
    """message 1 MB over tp 2: an all-reduce is 1 ms + 2 x 1/2 x 1 s, an all-gather 1 ms + 1/2 s; gloo's
    reduce-scatter is an all-reduce. F: 2 gathers + 2 reduce-scatters; B: 4 gathers + 2 reduce-scatters."""
    reduce, gather = 1e-3 + 1.0, 1e-3 + 0.5
    assert allreduce_s(COMM, 1e6, 2) == pytest.approx(reduce)
    assert allgather_s(COMM, 1e6, 2) == pytest.approx(gather)
    sp = tp_comm_parts(COMM, 1e6, 2, sequence_parallel=True)
    assert sp["layer"].f == pytest.approx(2 * gather + 2 * reduce)
    assert sp["layer"].b == pytest.approx(4 * gather + 2 * reduce)
    nccl = tp_comm_parts(COMM, 1e6, 2, sequence_parallel=True, gloo=False)
    assert nccl["layer"].f == pytest.approx(4 * gather)
    plain = tp_comm_parts(COMM, 1e6, 2, sequence_parallel=False, recompute="full")
    assert plain["layer"].f == pytest.approx(2 * reduce) and plain["layer"].b == pytest.approx(4 * reduce)
    assert tp_comm_parts(COMM, 1e6, 1, sequence_parallel=True)["layer"] == PassCosts(0.0, 0.0)


def test_tp_parts_divide_compute_and_memory_and_add_the_collectives():
    measured = {name: PassCosts(2.0, 4.0, 6.0, 100.0, 50.0) for name in ("layer", "embedding", "head")}
    one = tp_parts(measured, 2, slowdown=1.5, comm=COMM, message=1e6, sequence_parallel=False)
    comm = tp_comm_parts(COMM, 1e6, 2, sequence_parallel=False)
    assert one["layer"] == PassCosts(1.5 + comm["layer"].f, 3.0 + comm["layer"].b, 4.5, 50.0, 25.0)
    assert tp_parts(measured, 1, slowdown=2.0)["head"] == PassCosts(4.0, 8.0, 12.0, 100.0, 50.0)

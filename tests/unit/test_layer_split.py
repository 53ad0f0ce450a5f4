"""Which layers each pipeline stage builds: the even split and Megatron's uneven first/last stage split."""
import pytest

from llamapipe.core.pipeline_parallel.layout import stage_layer_ranges
from llamapipe.training.checkpointing.resharding import pp_rank_of
from llamapipe.training.flag_names import worded_as_flags


def test_even_split_follows_stage_order():
    assert stage_layer_ranges(8, 2) == [(0, 4), (4, 8)]
    assert stage_layer_ranges(8, 2, 2) == [(0, 2), (2, 4), (4, 6), (6, 8)]


@pytest.mark.parametrize("num_layers,pp,first,last,counts", [
    (8, 2, 5, None, [5, 3]),
    (8, 2, None, 3, [5, 3]),
    (8, 2, 6, 2, [6, 2]),
    (10, 4, 1, 3, [1, 3, 3, 3]),
    (9, 4, 3, None, [3, 2, 2, 2]),
    (7, 4, None, 1, [2, 2, 2, 1]),
])
def test_uneven_split_gives_first_and_last_their_counts_and_the_rest_evenly(num_layers, pp, first, last, counts):
    ranges = stage_layer_ranges(num_layers, pp, 1, first, last)
    assert [end - start for start, end in ranges] == counts
    assert ranges[0][0] == 0 and ranges[-1][1] == num_layers
    assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))          # contiguous


def test_pp_rank_of_follows_the_uneven_split():
    owner = {name: pp_rank_of(name, 8, 2, first=None, last=3)
             for name in ("embedding.weight", "layers.4.mlp.w", "layers.5.mlp.w", "final_norm.weight")}
    assert owner == {"embedding.weight": 0, "layers.4.mlp.w": 0, "layers.5.mlp.w": 1, "final_norm.weight": 1}
    assert pp_rank_of("layers.3.x", 8, 2) == 0 and pp_rank_of("layers.4.x", 8, 2) == 1
    with pytest.raises(ValueError, match="layers.8.x is layer 8, but the model has 8 layers"):
        pp_rank_of("layers.8.x", 8, 2)


@pytest.mark.parametrize("args,fragment", [
    ((8, 2, 1, 5, 2), "add up to --num-layers 8"),
    ((8, 3, 1, None, 3), "leaves 5 of --num-layers 8 for the other 2"),
    ((8, 2, 1, 0, None), "--decoder-first-pipeline-num-layers 0 must be at least 1"),
    ((8, 2, 1, 9, None), "--decoder-first-pipeline-num-layers 9 is more than --num-layers 8"),
    ((8, 3, 1, 4, 4), "leave 0 of --num-layers 8 for the other pipeline stage, which needs at least 1"),
    ((8, 2, 2, 3, None), "one model chunk per rank"),
    ((8, 1, 1, None, 3), "--pipeline-model-parallel-size > 1"),
    ((9, 2, 1, None, None), "--num-layers 9 is not divisible"),
])
def test_impossible_splits_name_the_flags_and_numbers(args, fragment):
    with pytest.raises(ValueError, match=fragment.replace("(", r"\(")), worded_as_flags():
        stage_layer_ranges(*args)


@pytest.mark.parametrize("num_layers,pp,vpp,embedding,loss,counts", [
    (6, 2, 2, True, True, [1, 2, 2, 1]),          # ZB-V: rank 0 holds stages 0 and 3, with embedding and head
    (7, 2, 1, False, True, [4, 3]),
    (7, 2, 1, True, False, [3, 4]),
    (30, 4, 2, True, True, [3, 4, 4, 4, 4, 4, 4, 3]),
])
def test_accounting_for_embedding_and_loss_counts_them_as_layers(num_layers, pp, vpp, embedding, loss, counts):
    ranges = stage_layer_ranges(num_layers, pp, vpp, embedding=embedding, loss=loss)
    assert [end - start for start, end in ranges] == counts
    assert ranges[0][0] == 0 and ranges[-1][1] == num_layers
    assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))
    assert pp_rank_of(f"layers.{num_layers - 1}.x", num_layers, pp, vpp, "v" if vpp == 2 else "interleaved",
                      embedding=embedding, loss=loss) == (0 if vpp == 2 else pp - 1)


@pytest.mark.parametrize("kwargs,fragment", [
    (dict(num_layers=8, pp_size=2, vpp_size=2, embedding=True, loss=True),
     "--num-layers 8 plus --account-for-embedding-in-pipeline-split and --account-for-loss-in-pipeline-split "
     "(10 layers) is not divisible"),
    (dict(num_layers=2, pp_size=2, vpp_size=2, embedding=True, loss=True), "leaves a stage without a transformer"),
    (dict(num_layers=7, pp_size=2, last=3, loss=True), "cannot be combined with --decoder-first/last"),
])
def test_impossible_accounted_splits_name_the_flags(kwargs, fragment):
    with pytest.raises(ValueError, match=fragment.replace("(", r"\(").replace(")", r"\)")), worded_as_flags():
        stage_layer_ranges(**kwargs)

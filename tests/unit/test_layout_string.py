"""--pipeline-model-parallel-layout: Megatron-LM's grammar (E embedding, t decoder layer, L loss, | between virtual
stages, *N repeats; megatron/core/transformer/pipeline_parallel_layer_layout.py, parse_str_to_list), the split it
gives, the chunks per rank it implies, and one-sentence errors for what contradicts it."""
import pytest

from llamapipe.core.pipeline_parallel.layout import layout_layer_counts, parse_layout, stage_layer_ranges
from llamapipe.training.arguments.parser import ArgumentError, build_parser, config_from_args
from llamapipe.training.flag_names import worded_as_flags

FLAG = "--pipeline-model-parallel-layout"


@pytest.mark.parametrize("text,stages", [
    ("Et*3|(tt|)*2,tL", ["Ettt", "tt", "tt", "tL"]),         # Megatron's docs' style: groups, cosmetic comma
    ("E|(t|)*4L", ["E", "t", "t", "t", "t", "L"]),            # embedding and loss on stages of their own
    ("Et*2|t*2L", ["Ett", "ttL"]),
    ("E t t | t t L", ["Ett", "ttL"]),
    ("((t|)*2)*2", ["t", "t", "t", "t", ""]),
])
def test_grammar_expands_like_megatrons(text, stages):
    assert parse_layout(text) == stages


def test_uneven_split_over_virtual_stages():
    assert layout_layer_counts("Et*3|(tt|)*2,tL", 8, 2) == [3, 2, 2, 1]
    assert stage_layer_ranges(8, 2, 2, layout="Et*3|(tt|)*2,tL") == [(0, 3), (3, 5), (5, 7), (7, 8)]
    assert stage_layer_ranges(4, 2, 1, layout="E|ttttL") == [(0, 0), (0, 4)]


@pytest.mark.parametrize("text,num_layers,pp,words", [
    ("Et*4|t*4X", 8, 2, "contains X; it knows E (embedding)"),
    ("Et*4|t*3|tL", 8, 2, "has 3 virtual stages, which is not a multiple of --pipeline-model-parallel-size 2"),
    ("t*4|Et*4L", 8, 2, "must place the embedding E once, at the start of the first virtual stage"),
    ("Et*4|t*4", 8, 2, "must place the loss L once, at the end of the last virtual stage"),
    ("Et*4||t*4|L", 8, 2, "leaves virtual stage 1 empty"),
    ("Et*4|t*3L", 8, 2, "places 7 decoder layers (t), but --num-layers is 8"),
])
def test_malformed_layouts_are_one_sentence(text, num_layers, pp, words):
    with pytest.raises(ValueError, match=None) as info, worded_as_flags():
        layout_layer_counts(text, num_layers, pp)
    assert words in str(info.value) and FLAG in str(info.value) and "\n" not in str(info.value)


def _cfg(argv, world=2):
    return config_from_args(build_parser().parse_args(["--mock-data", "--model", "tiny", "--global-batch-size", "4"]
                                                      + argv), world)


def test_layout_sets_the_chunks_per_rank_and_any_schedule_checks_them():
    c = _cfg(["--pipeline-model-parallel-size", "2", FLAG, "Et*3|(tt|)*2,tL"])
    assert (c.parallel.vpp_size, c.parallel.pipeline_schedule) == (2, "interleaved")
    c = _cfg(["--pipeline-model-parallel-size", "2", FLAG, "Ettttt|tttL", "--pipeline-schedule", "zb-h1"])
    assert c.parallel.vpp_size == 1
    c = _cfg(["--pipeline-model-parallel-size", "2", FLAG, "Et|ttt|ttt|tL", "--pipeline-schedule", "v-half"])
    assert c.parallel.vpp_size == 2
    with pytest.raises(ArgumentError, match="--pipeline-schedule zbv needs exactly 2 model chunks per pipeline rank"):
        _cfg(["--pipeline-model-parallel-size", "2", FLAG, "Et*4|t*4L", "--pipeline-schedule", "zbv"])


@pytest.mark.parametrize("extra,words", [
    (["--num-virtual-stages-per-pipeline-rank", "1"],
     "(4 virtual stages) gives 2 model chunks per pipeline rank with --pipeline-model-parallel-size 2, but "
     "--num-virtual-stages-per-pipeline-rank is 1"),
    (["--num-layers-per-virtual-pipeline-stage", "2"],
     "puts 3, 2, 2, 1 layers on its stages, but --num-layers-per-virtual-pipeline-stage is 2"),
    (["--account-for-loss-in-pipeline-split"],
     "--account-for-loss-in-pipeline-split cannot be combined with --pipeline-model-parallel-layout"),
    (["--decoder-first-pipeline-num-layers", "2"],
     "--decoder-first-pipeline-num-layers 2 contradicts --pipeline-model-parallel-layout 'Et*3|(tt|)*2,tL', "
     "which gives the first stage 3 layers"),
])
def test_contradicting_split_flags_name_both_flags_and_the_numbers(extra, words):
    with pytest.raises(ArgumentError) as info:
        _cfg(["--pipeline-model-parallel-size", "2", FLAG, "Et*3|(tt|)*2,tL"] + extra)
    assert words in str(info.value) and "\n" not in str(info.value), str(info.value)


def test_layout_with_the_wrong_layer_count_names_num_layers():
    with pytest.raises(ArgumentError, match=r"places 6 decoder layers \(t\), but --num-layers is 8"):
        _cfg(["--pipeline-model-parallel-size", "2", FLAG, "Ettt|tttL"])
    with pytest.raises(ArgumentError, match="needs --pipeline-model-parallel-size > 1, got 1"):
        _cfg([FLAG, "Etttt|ttttL"], world=1)

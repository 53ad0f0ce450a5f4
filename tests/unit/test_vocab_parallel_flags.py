"""--enable-vocab-parallel in the flags: on at pp > 1, a one-line notice and off at pp 1, refused in one sentence
where it cannot work (tied embeddings need the embedding and the output layer in one chunk; ZeRO-2/3 keep the
output layer's shard only as data-parallel pieces, which S/T, running outside the chunk's forward, cannot use;
--overlap-grad-reduce would reduce the split embedding's gradient before it is computed, after the last action)."""
import pytest

from llamapipe.training.arguments.parser import ArgumentError, build_parser, config_from_args


def cfg(argv, world=1):
    return config_from_args(build_parser().parse_args(["--mock-data", "--model", "tiny", "--enable-vocab-parallel"]
                                                      + argv), world)


def test_on_with_a_pipeline():
    c = cfg(["--pipeline-model-parallel-size", "2", "--global-batch-size", "2"], world=2)
    assert c.parallel.vocab_parallel is True


def test_pp1_is_a_notice_and_turns_off(llamapipe_log):
    assert cfg([]).parallel.vocab_parallel is False
    assert [line for line in llamapipe_log if "--enable-vocab-parallel" in line] == [
        "notice: --enable-vocab-parallel has no effect with --pipeline-model-parallel-size 1: the one rank holds "
        "the whole output layer (turned off)"]


@pytest.mark.parametrize("argv,words", [
    (["--tie-embeddings-and-output-weights"], "--tie-embeddings-and-output-weights is supported only with"),
    (["--data-parallel-sharding-strategy", "optim_grads"], "--enable-vocab-parallel is not supported with "
                                                           "--data-parallel-sharding-strategy optim_grads"),
    (["--overlap-grad-reduce"], "--overlap-grad-reduce is not supported with --enable-vocab-parallel"),
], ids=["tied", "zero2", "overlap-grad-reduce"])
def test_refused_in_one_sentence(argv, words):
    with pytest.raises(ArgumentError) as info:
        cfg(["--pipeline-model-parallel-size", "2", "--global-batch-size", "4", *argv], world=4)
    assert words in str(info.value) and "\n" not in str(info.value)

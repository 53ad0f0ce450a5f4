"""--enable-vocab-parallel in the flags: on at pp > 1, a one-line notice and off at pp 1, accepted with tied embeddings,
ZeRO-2/3 (the vocabulary shards are FSDP units of their own) and --overlap-grad-reduce at dp > 1 (the
embedding's late gradient has a bucket of its own, reduced at the step's end)."""
import pytest

from llamapipe.training.arguments.parser import build_parser, config_from_args


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


def test_tied_embeddings_accepted():
    """Tied, a rank's output-layer and embedding shards are one parameter (tests/e2e/test_tied_embeddings_cli.py)."""
    c = cfg(["--pipeline-model-parallel-size", "2", "--global-batch-size", "4", "--tie-embeddings-and-output-weights"],
            world=4)
    assert c.parallel.vocab_parallel and c.model.tie_word_embeddings


@pytest.mark.parametrize("argv,strategy", [
    (["--data-parallel-sharding-strategy", "optim_grads"], "optim_grads"),
    (["--use-torch-fsdp2"], "optim_grads_params"),
    (["--overlap-grad-reduce"], "no_shard"),
], ids=["zero2", "zero3", "overlap-grad-reduce"])
def test_accepted_with_zero2_zero3_and_overlap_at_dp2(argv, strategy):
    c = cfg(["--pipeline-model-parallel-size", "2", "--global-batch-size", "4", *argv], world=4)
    assert c.parallel.vocab_parallel and c.parallel.dp_size == 2
    assert c.parallel.data_parallel_sharding_strategy == strategy

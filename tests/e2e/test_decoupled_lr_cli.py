"""--decoupled-lr through the command line (issue 39, item 7): pp 2 (the embedding and the output layer on
different ranks) and dp 2 under ZeRO-1 (their optimizer state sharded) give the single-rank losses (fp32,
rel 1e-5), which differ from the run without the flag."""
from __future__ import annotations

import pytest

from tests.cli import train

FLAGS = ["--train-iters", "5", "--global-batch-size", "4", "--lr", "1e-3", "--decoupled-lr", "2e-2",
         "--decoupled-min-lr", "1e-3", "--lr-decay-style", "cosine"]
LAYOUTS = {"pp2": ["--pipeline-model-parallel-size", "2"], "dp2-zero1": ["--use-distributed-optimizer"]}


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("ref")
    with_flag = [r["lm_loss"] for r in train(1, FLAGS, str(tmp / "with.jsonl"))]
    without = [r["lm_loss"] for r in train(1, FLAGS[:6] + FLAGS[10:], str(tmp / "without.jsonl"))]
    return with_flag, without


def test_the_decoupled_rate_changes_training(reference):
    with_flag, without = reference
    assert with_flag[0] == without[0]                       # the same first step's loss: the same weights
    assert abs(with_flag[-1] - without[-1]) > 1e-3, (with_flag, without)


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_layouts_give_the_single_rank_losses(reference, layout, tmp_path):
    losses = [r["lm_loss"] for r in train(2, FLAGS + LAYOUTS[layout], str(tmp_path / "m.jsonl"))]
    assert losses == pytest.approx(reference[0], rel=1e-5), (losses, reference[0])

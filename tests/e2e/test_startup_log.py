"""Under torchrun the start-up notices and the "run:" block come once (rank 0), before training, and the
validation result line carries the pass's time (issue 33)."""
import re

from tests.cli import TINY, torchrun


def test_two_ranks_log_the_block_once_and_how_long_validation_took():
    proc = torchrun(2, TINY + ["--pipeline-model-parallel-size", "2", "--global-batch-size", "2", "--train-iters", "1",
                               "--eval-iters", "2", "--use-distributed-optimizer"], timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [re.sub(r"^\[[^]]*\] ", "", line) for line in proc.stdout.splitlines()]
    notices = [line for line in lines if line.startswith("notice: --use-distributed-optimizer")]
    assert notices == ["notice: --use-distributed-optimizer has no effect at data-parallel size 1 (world size 2 = "
                       "tp 1 x pp 2): there is no other data-parallel rank to shard with; every rank keeps its whole "
                       "optimizer state, gradients and parameters"]
    block = [line for line in lines if line.startswith("run: ")]
    assert len(block) == 5 and block[0] == "run: 2 ranks = tp 1 x pp 2 x dp 1 (order tp-cp-dp-pp), sequence parallel " \
                                           "off, gloo"
    assert lines.index(block[-1]) < lines.index("training 1 iteration (--train-iters 1)")
    result = [line for line in lines if line.startswith("validation loss at iteration 1:")]
    assert len(result) == 1 and re.search(r"\| 2 iterations in \d+\.\d s$", result[0]), result

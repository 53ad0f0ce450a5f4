"""The start line names the training length in the flag the user gave (issue 50, item 5): --train-samples 640
at global batch 16 said "(--train-iters 40)", a flag the user never typed, and on a rerun "--train-iters 40 is
the last iteration"."""
import pytest

from llamapipe.training.arguments.parser import build_parser, config_from_args
from llamapipe.training.progress import start_line

SAMPLES = dict(train_samples=640, global_batch_size=16)
SAID_640 = "training 40 iterations (--train-samples 640 = 40 iterations at global batch 16)"


@pytest.mark.parametrize("start, samples, said", [
    (0, None, "training 40 iterations (--train-iters 40)"),
    (0, SAMPLES, SAID_640),
    (20, None, "training 20 iterations, 21 to 40 (resumed at iteration 20; --train-iters is the last iteration)"),
    (20, SAMPLES, "training 20 iterations, 21 to 40 (resumed at iteration 20; --train-samples 640 ends at "
                  "iteration 40)"),
    (40, None, "nothing to train: resumed at iteration 40, and --train-iters 40 is the last iteration"),
    (40, SAMPLES, "nothing to train: resumed at iteration 40, and --train-samples 640 (40 iterations) is the last "
                  "iteration"),
])
def test_the_start_line_names_the_length_flag_given(start, samples, said):
    assert start_line(40, start, **(samples or {})) == said


def test_a_sample_based_runs_config_carries_what_the_start_line_says():
    """What the loop passes (the training config of --train-samples 640 --global-batch-size 16) gives the line;
    with --rampup-batch-size the iterations are counted through the ramp, not at the final batch."""
    flags = ["--model", "tiny", "--mock-data", "--global-batch-size", "16", "--train-samples", "640"]
    cfg = config_from_args(build_parser().parse_args(flags), 1).training
    assert (cfg.train_iters, cfg.train_samples, cfg.rampup_batch_size) == (40, 640, None)
    assert start_line(cfg.train_iters, 0, cfg.train_samples, cfg.global_batch_size) == SAID_640
    ramp = config_from_args(build_parser().parse_args(flags + ["--rampup-batch-size", "4", "4", "64"]), 1).training
    assert ramp.train_iters > 40
    assert start_line(ramp.train_iters, 0, ramp.train_samples, ramp.global_batch_size, rampup=True) == (
        f"training {ramp.train_iters} iterations (--train-samples 640 = {ramp.train_iters} iterations through "
        "--rampup-batch-size)")


"""--data-parallel-sharding-strategy and its aliases resolve as Megatron's flags do, and refused combinations
fail in one sentence naming both flags (no process group)."""
import pytest

from llamapipe.core.config import ArgumentError
from llamapipe.training.arguments.parser import build_parser, config_from_args

BASE = ["--mock-data", "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
        "--max-position-embeddings", "32", "--micro-batch-size", "1", "--global-batch-size", "4",
        "--train-iters", "1", "--vocab-size", "256"]


def _config(*flags: str):
    return config_from_args(build_parser().parse_args(BASE + list(flags)), world_size=4)


@pytest.mark.parametrize("flags, strategy, zero1", [
    ((), "no_shard", False),
    (("--use-distributed-optimizer",), "optim", True),
    (("--data-parallel-sharding-strategy", "optim"), "optim", True),
    (("--data-parallel-sharding-strategy", "optim_grads"), "optim_grads", False),
    (("--use-torch-fsdp2",), "optim_grads_params", False),
])
def test_strategy_resolution(flags, strategy, zero1):
    config = _config(*flags)
    assert config.parallel.data_parallel_sharding_strategy == strategy
    assert config.optimizer.use_distributed_optimizer is zero1


@pytest.mark.parametrize("flags, other", [
    (("--use-torch-fsdp2", "--data-parallel-sharding-strategy", "optim"), "--use-torch-fsdp2"),
    (("--data-parallel-sharding-strategy", "optim_grads", "--use-distributed-optimizer"),
     "--use-distributed-optimizer"),
    (("--use-torch-fsdp2", "--log-num-zeros-in-grad"), "--log-num-zeros-in-grad"),
    (("--use-torch-fsdp2", "--enable-optimizer-post-validation"), "--enable-optimizer-post-validation"),
])
def test_refused_combinations_name_both_flags(flags, other):
    with pytest.raises(ArgumentError) as err:
        _config(*flags)
    message = str(err.value)
    assert other in message and "--data-parallel-sharding-strategy" in message and "\n" not in message

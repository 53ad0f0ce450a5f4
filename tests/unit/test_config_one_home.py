"""Issue 28 item 4: validation leaves the parsed flags as they were, every config field has one home, and the
sharding strategies and the batch divisibility rule are written once."""
import argparse
import copy
import dataclasses

import pytest

from llamapipe.core import config as core_config
from llamapipe.core.config import ArgumentError
from llamapipe.core.distributed import fsdp
from llamapipe.core.num_microbatches_calculator import build_num_microbatches_calculator, microbatches_per_step
from llamapipe.training.arguments.parser import build_parser, config_from_args
from llamapipe.training.config import Config
from llamapipe.training.flag_names import worded_as_flags

SHAPE = ["--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
         "--max-position-embeddings", "32", "--vocab-size", "256"]


class _Frozen(argparse.Namespace):
    """Flags that refuse writes once built, copies included: a write fails the test naming the flag."""

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        object.__setattr__(self, "_built", True)

    def __setattr__(self, name: str, value) -> None:
        assert not getattr(self, "_built", False), f"validation wrote args.{name} = {value!r} into the flags"
        super().__setattr__(name, value)


@pytest.mark.parametrize("world, flags", [
    (1, []),                                                   # the fallback preset and its sequence length
    (4, ["--model", "tiny", "--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage", "2",
         "--global-batch-size", "8", "--use-distributed-optimizer"]),
    (2, SHAPE + ["--data-parallel-sharding-strategy", "optim"]),
    (2, SHAPE + ["--use-torch-fsdp2"]),
])
def test_validation_leaves_the_parsed_flags_as_they_were(world, flags, monkeypatch):
    """No check writes a resolved value back into the flags for a later check to read (each takes it as an
    argument): a namespace that refuses writes goes through the whole validation."""
    parsed = vars(build_parser().parse_args(["--mock-data"] + flags))
    monkeypatch.setattr(argparse, "Namespace", _Frozen)     # a copy of the flags would refuse writes too
    args = _Frozen(**copy.deepcopy(parsed))
    config = config_from_args(args, world)
    parsed["_built"] = True
    assert vars(args) == parsed
    assert config.training.seq_length == (32 if "--seq-length" in flags else 128)
    assert config.model.num_layers == (4 if "--num-layers" in flags else 8)
    assert config.optimizer.use_distributed_optimizer is ("optim" in flags or "--use-distributed-optimizer" in flags)


def test_every_config_field_has_one_home():
    homes = {}
    for part in dataclasses.fields(Config):
        for field in dataclasses.fields(part.default_factory):
            homes.setdefault(field.name, []).append(part.name)
    shared = {name: parts for name, parts in homes.items() if len(parts) > 1}
    # the model's vocabulary (the tokenizer's size, padded inside the model) and the --vocab-size flag that
    # NullTokenizer reads (one less than the model's, for its eod) are two numbers with one name
    assert shared == {"vocab_size": ["model", "data"]}


def test_sharding_strategies_are_one_list():
    choices = next(a.choices for a in build_parser()._actions if a.dest == "data_parallel_sharding_strategy")
    assert tuple(choices) == core_config.SHARDING_STRATEGIES == fsdp.STRATEGIES
    assert fsdp.FSDP_STRATEGIES == ("optim_grads", "optim_grads_params")


@pytest.mark.parametrize("gbs, mbs, dp, m", [(12, 2, 3, 2), (8, 2, 1, 4), (6, 3, 2, 1)])
def test_batch_divisibility_is_one_rule(gbs, mbs, dp, m):
    assert microbatches_per_step(gbs, mbs, dp) == m
    assert build_num_microbatches_calculator(gbs, mbs, dp).get() == m
    for bad_gbs in (gbs + 1, gbs - 1):
        message = f"--global-batch-size {bad_gbs} is not divisible by --micro-batch-size ({mbs}) x data-parallel " \
                  f"size ({dp})"
        with pytest.raises(ArgumentError) as raised, worded_as_flags():
            microbatches_per_step(bad_gbs, mbs, dp)
        assert str(raised.value) == message
        with pytest.raises(ArgumentError) as raised, worded_as_flags():
            build_num_microbatches_calculator(bad_gbs, mbs, dp)
        assert str(raised.value) == message
        argv = ["--mock-data", "--micro-batch-size", str(mbs), "--global-batch-size", str(bad_gbs)]
        with pytest.raises(ArgumentError) as raised:
            config_from_args(build_parser().parse_args(argv), dp)
        assert str(raised.value) == message


def test_checkpoint_args_leave_the_parsed_flags_as_they_were(tmp_path):
    """--use-checkpoint-args takes the shape from the checkpoint into the config, not into the caller's flags."""
    from llamapipe.core.config import TrainingConfig
    from llamapipe.model.llama import LlamaConfig, LlamaModel
    from llamapipe.training.checkpointing.resharding import model_specs
    from llamapipe.training.checkpointing.io import write_layout
    saved = LlamaConfig(num_layers=2, hidden_size=32, ffn_hidden_size=64, num_attention_heads=4, num_query_groups=4,
                        vocab_size=100, max_position_embeddings=64)
    state = {name: p.detach() for name, p in LlamaModel(saved).named_parameters()}
    write_layout(str(tmp_path), 1, state, model_specs(saved, 1), dataclasses.asdict(saved), tp=1, pp=1,
                 config=dataclasses.asdict(Config(model=saved, training=TrainingConfig(seq_length=40))))
    args = build_parser().parse_args(["--mock-data", "--use-checkpoint-args", "--load", str(tmp_path)])
    parsed = copy.deepcopy(vars(args))
    config = config_from_args(args, 1)
    assert (config.model.num_layers, config.training.seq_length) == (2, 40) and vars(args) == parsed

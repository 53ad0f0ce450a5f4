"""The learning-rate schedule on resume (Megatron's rule): a difference between the command line and the
checkpoint in lr, min-lr, warmup, decay length or style is an error naming the flag and both values, unless
--override-opt_param-scheduler (the command line's) or --use-checkpoint-opt_param-scheduler (the
checkpoint's) says which wins; --train-iters alone may grow when --lr-decay-iters is given. Also through
load_checkpoint with the CheckpointConfig flags, and the argument check that refuses both flags."""
from __future__ import annotations

import dataclasses

import pytest

from llamapipe.core.config import OptimizerConfig
from llamapipe.core.optimizer import OptimizerParamScheduler
from llamapipe.core.parallel_state import ParallelState
from llamapipe.training.arguments.parser import ArgumentError, build_parser, config_from_args
from llamapipe.training.checkpointing.save_load import load_checkpoint, save_checkpoint
from llamapipe.training.config import CheckpointConfig
from llamapipe.training.flag_names import worded_as_flags
from tests.multiproc.test_checkpointing import CONFIG, make_chunks


class Groups:
    def __init__(self):
        self.param_groups = [{"lr": 0.0}]


COSINE = OptimizerConfig(lr=1e-3, min_lr=1e-5, lr_decay_style="cosine", lr_warmup_iters=1)


def saved(opt: OptimizerConfig = COSINE, train_iters: int = 4, steps: int = 4) -> dict:
    scheduler = OptimizerParamScheduler(Groups(), opt, train_iters)
    scheduler.step(steps)
    return scheduler.state_dict()


def test_longer_train_iters_without_lr_decay_iters_is_one_line_naming_both_values():
    resumed = OptimizerParamScheduler(Groups(), COSINE, 6)
    with pytest.raises(ValueError) as info, worded_as_flags():
        resumed.load_state_dict(saved())
    message = str(info.value)
    assert "\n" not in message
    assert "--train-iters gives the decay length in iters 6 but the checkpoint's schedule has 4" in message
    assert "--override-opt_param-scheduler" in message and "--use-checkpoint-opt_param-scheduler" in message


@pytest.mark.parametrize("change,flag", [(dict(lr=2e-3), "--lr"), (dict(min_lr=0.0), "--min-lr"),
                                         (dict(lr_warmup_iters=2), "--lr-warmup-iters"),
                                         (dict(lr_decay_style="linear"), "--lr-decay-style")])
def test_each_schedule_field_is_checked(change, flag):
    resumed = OptimizerParamScheduler(Groups(), dataclasses.replace(COSINE, **change), 4)
    with pytest.raises(ValueError, match=f"^{flag} gives"), worded_as_flags():
        resumed.load_state_dict(saved())


def test_override_keeps_the_command_line_and_use_checkpoint_takes_the_checkpoint():
    state = saved()
    ours = OptimizerParamScheduler(Groups(), COSINE, 6)
    ours.load_state_dict(state, override=True)
    assert ours.num_steps == 4 and ours.lr_decay_steps == 6
    assert ours.optimizer.param_groups[0]["lr"] == OptimizerParamScheduler(Groups(), COSINE, 6).get_lr(4)
    theirs = OptimizerParamScheduler(Groups(), dataclasses.replace(COSINE, lr=5.0), 6)
    theirs.load_state_dict(state, use_checkpoint=True)
    assert (theirs.lr_decay_steps, theirs.max_lr) == (4, 1e-3)
    assert theirs.get_lr() == 1e-5, "the checkpoint's 4-iteration cosine has ended at min-lr"
    with pytest.raises(ValueError, match="cannot be used together"):
        ours.load_state_dict(state, override=True, use_checkpoint=True)


def test_train_iters_may_grow_when_lr_decay_iters_is_given():
    opt = dataclasses.replace(COSINE, lr_decay_iters=4)
    resumed = OptimizerParamScheduler(Groups(), opt, 6)
    resumed.load_state_dict(saved(opt, train_iters=4))
    assert resumed.num_steps == 4 and resumed.get_lr(5) == 1e-5


def _load_with(tmp_path, checkpoint: CheckpointConfig, train_iters: int):
    chunks = make_chunks(ParallelState())
    config = dataclasses.replace(CONFIG, optimizer=COSINE, checkpoint=checkpoint)
    save_checkpoint(str(tmp_path), 4, model_chunks=chunks, optimizer=None, parallel_state=None, config=config,
                    scheduler=OptimizerParamScheduler(Groups(), COSINE, 4), consumed_samples=32)
    scheduler = OptimizerParamScheduler(Groups(), COSINE, train_iters)
    load_checkpoint(str(tmp_path), model_chunks=chunks, optimizer=None, scheduler=scheduler, parallel_state=None,
                    config=config)
    return scheduler


def test_load_checkpoint_applies_the_checkpoint_config_flags(tmp_path):
    with pytest.raises(ValueError, match=r"^checkpoint .*iter_0000004: --train-iters gives"):
        _load_with(tmp_path / "a", CheckpointConfig(), 6)
    assert _load_with(tmp_path / "b", CheckpointConfig(override_opt_param_scheduler=True), 6).lr_decay_steps == 6
    assert _load_with(tmp_path / "c", CheckpointConfig(use_checkpoint_opt_param_scheduler=True),
                      6).lr_decay_steps == 4


def test_the_two_flags_together_are_refused_and_megatron_defaults_are_off():
    base = ["--mock-data", "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
            "--max-position-embeddings", "64", "--seq-length", "32", "--vocab-size", "128"]
    parser = build_parser()
    args = parser.parse_args(base)
    assert (args.override_opt_param_scheduler, args.use_checkpoint_opt_param_scheduler, args.async_save) == \
        (False, False, False)
    both = base + ["--override-opt_param-scheduler", "--use-checkpoint-opt_param-scheduler"]
    with pytest.raises(ArgumentError, match="cannot be used together"):
        config_from_args(parser.parse_args(both), 1)


def test_constant_schedule_may_change_train_iters_and_min_lr():
    """Neither sets any learning rate under a constant style, so no drift is possible (a preempted job may
    be extended); the warmup still must match."""
    constant = dataclasses.replace(COSINE, lr_decay_style="constant")
    resumed = OptimizerParamScheduler(Groups(), dataclasses.replace(constant, min_lr=0.0), 1000)
    resumed.load_state_dict(saved(constant))
    assert resumed.get_lr() == 1e-3
    with pytest.raises(ValueError, match="^--lr-warmup-iters gives"), worded_as_flags():
        OptimizerParamScheduler(Groups(), dataclasses.replace(constant, lr_warmup_iters=3), 4).load_state_dict(
            saved(constant))

"""Issue 49: `--load` of a Megatron-LM save directory resumes it in training, with megatron-core as the reference.

megatron-core saves a GPTModel at iteration 7 with its FP32Optimizer (AdamW, 7 steps) and its
OptimizerParamScheduler (stepped 7 times by the global batch size). Staged for the load, Adam's moments and step,
the iteration, consumed samples and the schedule come over bit for bit; a run at pp 2 with `--load` of the
Megatron directory resumes at iteration 8 with the learning rate megatron-core's own scheduler gives there and
with the loss of the independent route (convert-megatron import, then --load of that at pp 1).
"""
from __future__ import annotations

import math
import os

import pytest
import torch

from tests import megatron_cpu as mc
from tests.cli import train

GBS, ITERATION = 4, 7
BASE = ["--mock-data", "--seed", "1234", "--lr", "1e-3", "--min-lr", "1e-4", "--lr-warmup-iters", "2",
        "--lr-decay-iters", "20", "--lr-decay-style", "cosine", "--clip-grad", "1.0", "--log-interval", "1",
        "--eval-iters", "0", "--num-workers", "0", "--micro-batch-size", "1", "--global-batch-size", str(GBS),
        "--use-checkpoint-args", "--weight-decay", "0.1", "--adam-beta2", "0.95"]


@pytest.fixture(scope="module")
def megatron_save(tmp_path_factory):
    """(save dir, megatron-core's model, its torch AdamW, the LR its scheduler logs at iteration 8)."""
    mc.require()
    import torch.distributed as dist
    from megatron.core import parallel_state
    root = tmp_path_factory.mktemp("megatron_resume")
    mc.init_parallel()
    try:
        model = mc.build_model(seed=4)
        optimizer, scheduler = mc.trained_optimizer(model, ITERATION, GBS)
        args = mc.megatron_args(global_batch_size=GBS, consumed_train_samples=ITERATION * GBS)
        mc.save_megatron(model, str(root / "meg"), ITERATION, args, optimizer, scheduler)
    finally:
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()
    scheduler.step(increment=GBS)    # Megatron's iteration 8: its log shows the LR after the scheduler's step
    lr = scheduler.get_lr(optimizer.optimizer.param_groups[0])
    return str(root / "meg"), model, optimizer.optimizer, lr


def _run_config(train_samples=None):  # the fields of Config that stage() reads
    import types
    return types.SimpleNamespace(
        checkpoint=types.SimpleNamespace(override_opt_param_scheduler=False, save=None),
        training=types.SimpleNamespace(train_samples=train_samples))


def _load_here(root: str, *extra: str):
    """(LoadResult, our Optimizer, our scheduler) after load_checkpoint of `root` into a single-process model built
    from the command line a run would have, in this process."""
    from llamapipe.core.optimizer.lr_scheduler import OptimizerParamScheduler
    from llamapipe.core.optimizer.optimizer import build_optimizer
    from llamapipe.core.parallel_state import ParallelState
    from llamapipe.model.families import family_of
    from llamapipe.training.arguments.parser import build_parser, config_from_args
    from llamapipe.training.checkpointing.save_load import load_checkpoint
    config = config_from_args(build_parser().parse_args(BASE + ["--load", root, "--train-iters", "8", *extra]), 1)
    ps = ParallelState()
    chunks = [family_of(config.model).model_class(config.model, ps)]
    optimizer = build_optimizer(chunks, config.optimizer, ps)
    scheduler = OptimizerParamScheduler(optimizer, config.optimizer, config.training.train_iters)
    result = load_checkpoint(root, model_chunks=chunks, optimizer=optimizer, scheduler=scheduler, parallel_state=ps,
                             config=config, finetune=config.checkpoint.finetune,
                             no_load_optim=config.checkpoint.no_load_optim)
    return result, optimizer, scheduler


def test_load_puts_megatrons_adam_state_iteration_and_schedule_into_ours_and_finetune_takes_weights_only(
        megatron_save):
    """Through load_checkpoint in this process: our Optimizer's moments are megatron-core's AdamW state bit for
    bit, the step, iteration, consumed samples and the schedule continue; --finetune: weights only, iteration 0."""
    from llamapipe.training.checkpointing import megatron_format as mf
    from llamapipe.training.checkpointing.megatron_resume import source
    root, model, adam, _ = megatron_save
    assert source(root) == ("megatron", root)
    result, optimizer, scheduler = _load_here(root)
    assert (result.iteration, result.consumed_samples) == (ITERATION, ITERATION * GBS)
    assert (scheduler.num_steps, scheduler.lr_warmup_steps, scheduler.lr_decay_steps) == (ITERATION, 2, 20)
    state = optimizer.state_dict()
    assert state["step"] == ITERATION
    names = dict(model.named_parameters())
    for field in ("exp_avg", "exp_avg_sq"):   # megatron-core's own AdamW state, under its parameter names
        want = mf.to_ours({name: adam.state[p][field] for name, p in names.items()}, 2, 4, 2, "reference")
        assert set(want) == set(state["param_state"])
        for key, tensor in want.items():
            assert torch.equal(state["param_state"][key][field], tensor), f"{key}/{field}"
    assert not os.path.exists(os.path.join(root, "megatron_import.tmp"))
    result, optimizer, _ = _load_here(root, "--finetune")
    assert (result.iteration, result.consumed_samples) == (0, 0)
    assert optimizer.state_dict()["step"] == 0
    assert all(not fields["exp_avg"].any() for fields in optimizer.state_dict()["param_state"].values())


def test_a_save_without_per_parameter_optimizer_state_asks_for_no_load_optim(megatron_save, tmp_path):
    import shutil
    from llamapipe.training.checkpointing.megatron_resume import stage
    root = tmp_path / "legacy"
    mc.save_megatron_legacy(megatron_save[1], str(root), 9)
    with pytest.raises(ValueError, match="cannot resume with its optimizer: it holds no optimizer state that "
                                         "llamapipe reads .*; pass --no-load-optim"):
        stage(str(root), str(tmp_path / "staged"), _run_config(), wants_optimizer=True)
    assert not (tmp_path / "staged").exists()
    stage(str(root), str(tmp_path / "staged"), _run_config(), wants_optimizer=False)
    shutil.rmtree(tmp_path / "staged")


@pytest.mark.slow
def test_load_of_a_megatron_save_resumes_at_the_next_iteration_with_megatrons_lr_and_the_imported_loss(
        megatron_save, tmp_path):
    from llamapipe.tools.convert_megatron import import_megatron
    root, _, _, lr = megatron_save
    flags = ["--train-iters", str(ITERATION + 1)]
    direct = train(2, flags + ["--load", root, "--save", str(tmp_path / "run"), "--pipeline-model-parallel-size",
                               "2"], str(tmp_path / "direct.jsonl"), tiny=BASE)
    import_megatron(root, str(tmp_path / "ours"))
    imported = train(1, flags + ["--load", str(tmp_path / "ours"), "--no-load-optim"],
                     str(tmp_path / "imported.jsonl"), tiny=BASE)
    assert [r["iteration"] for r in direct] == [ITERATION + 1]
    assert math.isclose(direct[0]["lr"], lr, rel_tol=1e-12), (direct[0]["lr"], lr)
    assert math.isclose(direct[0]["lm_loss"], imported[0]["lm_loss"], rel_tol=1e-5)
    assert not math.isclose(imported[0]["lr"], lr, rel_tol=1e-3)    # --no-load-optim: a fresh schedule
    assert not os.path.exists(tmp_path / "run" / "megatron_import.tmp")


SHAPE = ["--num-layers", "2", "--hidden-size", "64", "--ffn-hidden-size", "160", "--num-attention-heads", "4",
         "--group-query-attention", "--num-query-groups", "2", "--vocab-size", "128", "--seq-length", "32",
         "--max-position-embeddings", "32"]
PLAIN = [flag for flag in BASE if flag != "--use-checkpoint-args"] + SHAPE


@pytest.mark.slow
def test_ckpt_format_torch_dist_saves_what_megatron_core_loads_and_resumes_with_the_uninterrupted_losses(tmp_path):
    """pp 2 trains 4 iterations saving with --ckpt-format torch_dist at 2 and 4: megatron-core's
    dist_checkpointing.load of iter_0000004 into its GPTModel gives the logits of our checkpoint there (fp32,
    1e-5), and the directory as it was at iteration 2, resumed, continues with the uninterrupted run's losses."""
    import shutil
    mc.require()
    save, resumed = str(tmp_path / "save"), str(tmp_path / "resumed")
    flags = ["--pipeline-model-parallel-size", "2", "--save-interval", "2", "--ckpt-format", "torch_dist",
             "--train-iters", "4"]
    whole = train(2, flags + ["--save", save], str(tmp_path / "whole.jsonl"), tiny=PLAIN)
    assert sorted(os.listdir(save)) == ["iter_0000002", "iter_0000004", "latest_checkpointed_iteration.txt",
                                        "llamapipe"]
    _megatron_core_loads_our_logits(save, 4)
    shutil.copytree(save, resumed)           # the directory as it was after the save at iteration 2
    for directory in (resumed, os.path.join(resumed, "llamapipe")):
        shutil.rmtree(os.path.join(directory, "iter_0000004"))
        with open(os.path.join(directory, "latest_checkpointed_iteration.txt"), "w") as fh:
            fh.write("2")
    then = train(2, flags + ["--save", resumed, "--load", resumed], str(tmp_path / "then.jsonl"), tiny=PLAIN)
    assert [r["iteration"] for r in then] == [3, 4]
    for got, want in zip(then, whole[2:]):
        assert math.isclose(got["lm_loss"], want["lm_loss"], rel_tol=1e-5), (got, want)
    assert os.path.isdir(os.path.join(resumed, "iter_0000004", "llamapipe")) is False
    assert sorted(os.listdir(os.path.join(resumed, "iter_0000004"))) == sorted(
        os.listdir(os.path.join(save, "iter_0000004")))


def _megatron_core_loads_our_logits(save: str, iteration: int) -> None:
    import torch.distributed as dist
    from megatron.core import dist_checkpointing, parallel_state
    from tests.unit.test_megatron_checkpoints import _our_logits
    tokens = torch.randint(0, mc.TINY["vocab_size"], (2, 16), generator=torch.Generator().manual_seed(2))
    ours, _ = _our_logits(os.path.join(save, "llamapipe"), tokens)
    mc.init_parallel()
    try:
        model = mc.build_model(seed=9)
        assert (mc.forward(model, tokens) - ours).abs().max() > 1e-2     # other weights until the load
        with mc.cpu_patches():
            state = dist_checkpointing.load(model.sharded_state_dict(prefix=""),
                                            os.path.join(save, f"iter_{iteration:07d}"))
        model.load_state_dict(state, strict=False)
        torch.testing.assert_close(mc.forward(model, tokens), ours, rtol=0, atol=1e-5)
    finally:
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()


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


def _run_config(train_samples=None):
    import types
    return types.SimpleNamespace(
        checkpoint=types.SimpleNamespace(override_opt_param_scheduler=False, save=None),
        training=types.SimpleNamespace(train_samples=train_samples))


def test_the_staged_checkpoint_carries_adams_state_the_iteration_and_the_schedule_bit_for_bit(megatron_save,
                                                                                                   tmp_path):
    from llamapipe.tools import megatron_format as mf
    from llamapipe.training.checkpointing import io as cio
    from llamapipe.training.checkpointing.megatron_resume import source, stage
    root, model, adam, _ = megatron_save
    assert source(root) == ("megatron", root)
    line = stage(root, str(tmp_path / "staged"), _run_config(), wants_optimizer=True)
    assert "Megatron-LM save" in line and "Adam's state" in line
    reader = cio.CheckpointReader(cio.latest_checkpoint(str(tmp_path / "staged"))[1])
    assert (reader.meta["iteration"], reader.meta["consumed_samples"]) == (ITERATION, ITERATION * GBS)
    assert reader.meta["scheduler"] == {"num_steps": ITERATION, "max_lr": 1e-3, "min_lr": 1e-4, "lr_warmup_steps": 2,
                                        "lr_decay_steps": 20, "lr_decay_style": "cosine"}
    assert reader.load_pt(cio.OPTIM_COMMON)["step"] == ITERATION
    names = dict(model.named_parameters())
    for field in ("exp_avg", "exp_avg_sq"):   # megatron-core's own AdamW state, under its parameter names
        want = mf.to_ours({name: adam.state[p][field] for name, p in names.items()}, 2, 4, 2, "reference")
        for key, tensor in want.items():
            got = reader.logical(f"{key}/{field}", "optim")
            assert torch.equal(got[:tensor.shape[0]], tensor), f"{key}/{field}"


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

"""The training step's shared decision (training/step.SynchronousStep.conclude), which both of its forms call:
for every optimizer action and flag combination, whether the run stops, skips (one record, counted) or logs the
update (the LR schedule advances), and with which words. The end-to-end equality of the two forms is
tests/e2e/test_post_validation.py."""
from types import SimpleNamespace

import pytest

from llamapipe.core.config import OptimizerConfig, TrainingConfig
from llamapipe.training.config import Config
from llamapipe.training.post_validated import PostValidatedStep
from llamapipe.training.step import IterationRecord, StepParts, SynchronousStep, TrainState


class _Recorder:
    """Stands for the progress writer, the optimizer and the scheduler: remembers what the step asked of them."""

    def __init__(self) -> None:
        self.iterations, self.skips, self.scheduler_steps = [], [], []
        self.counts_samples = False

    def iteration(self, **kw) -> None:
        self.iterations.append(kw)

    def skipped(self, **kw) -> None:
        self.skips.append(kw)

    def step(self, n: int) -> None:
        self.scheduler_steps.append(n)

    def get_lr(self) -> float:
        return 1e-3

    def get_loss_scale(self) -> float:
        return 256.0


def _step(fp16: bool, skip: bool, form=SynchronousStep) -> tuple[SynchronousStep, _Recorder]:
    rec = _Recorder()
    config = Config(training=TrainingConfig(skip_nonfinite_steps=skip), optimizer=OptimizerConfig(fp16=fp16))
    parts = StepParts(config=config, ps=SimpleNamespace(), chunks=[], optimizer=rec, scheduler=rec, batches=None,
                      fb_func=None, grad_sync=None, progress=rec, state=TrainState(iteration=7))
    return form(parts, []), rec


RECORD = IterationRecord(iteration=7, consumed_samples=28, global_batch_size=4, seconds=0.5, extra={"x": 1})


@pytest.mark.parametrize("action", ["apply", "clip"])
def test_an_applied_update_is_logged_and_advances_the_lr_schedule(action):
    step, rec = _step(fp16=False, skip=False)
    assert step.conclude(RECORD, action, 2.5, 0.75) is None
    assert rec.scheduler_steps == [1] and not rec.skips
    [logged] = rec.iterations
    assert (logged["iteration"], logged["loss"], logged["grad_norm"], logged["extra"]) == (7, 2.5, 0.75, {"x": 1})


@pytest.mark.parametrize("fp16", [False, True])
def test_a_nonfinite_loss_stops_the_run_without_the_skip_flag(llamapipe_log, fp16):
    step, rec = _step(fp16=fp16, skip=False)
    assert step.conclude(RECORD, "nonfinite_loss", float("inf"), float("nan")) == 1
    assert not rec.iterations and not rec.skips and not rec.scheduler_steps
    assert "iteration 7: lm loss is inf; stopping before applying the update" in "\n".join(llamapipe_log)


def test_a_nonfinite_norm_stops_fp32_but_is_skipped_under_fp16(llamapipe_log):
    step, rec = _step(fp16=False, skip=False)
    assert step.conclude(RECORD, "nonfinite_norm", 2.0, float("nan")) == 1
    assert "iteration 7: gradient norm is not finite" in "\n".join(llamapipe_log) and not rec.skips
    step, rec = _step(fp16=True, skip=False)
    assert step.conclude(RECORD, "nonfinite_norm", 2.0, float("nan")) is None
    assert [r["reason"] for r in rec.skips] == ["inf/nan in gradients (loss scale now 256)"]


@pytest.mark.parametrize("action, reason", [("nonfinite_loss", "lm loss is nan"),
                                            ("nonfinite_norm", "inf/nan in gradients (loss scale now 256)"),
                                            ("found_inf", "inf/nan in gradients (loss scale now 256)")])
def test_skipped_steps_get_one_record_each_and_are_counted(llamapipe_log, action, reason):
    step, rec = _step(fp16=action == "found_inf", skip=action != "found_inf")
    for _ in range(2):
        assert step.conclude(RECORD, action, float("nan"), float("nan")) is None
    assert [r["reason"] for r in rec.skips] == [reason, reason]
    assert [r["skipped_iterations"] for r in rec.skips] == [1, 2] and step.parts.state.skipped_iterations == 2
    assert not rec.iterations and not rec.scheduler_steps     # a skipped step does not advance the LR schedule
    assert f"skipped iteration 7: {reason}" in "\n".join(llamapipe_log)


def test_sample_based_lr_schedule_advances_by_the_global_batch():
    step, rec = _step(fp16=False, skip=False)
    rec.counts_samples = True
    step.conclude(RECORD, "apply", 1.0, 1.0)
    assert rec.scheduler_steps == [4]


def test_both_forms_share_the_decision_and_only_the_post_validated_one_overlaps():
    sync, _ = _step(fp16=False, skip=False)
    pv, _ = _step(fp16=False, skip=False, form=PostValidatedStep)
    shared = ("forward_backward", "finalize_grads", "conclude", "log_iteration", "record_skip")
    assert all(getattr(type(pv), name) is getattr(SynchronousStep, name) for name in shared)
    assert (sync.overlapped, pv.overlapped) == (False, True)
    assert sync.drain() is None and pv.drain() is None          # nothing pending yet
    assert sync.summary() is None
    assert pv.summary() == ("post-validation: 0 speculative updates rolled back, 0 iterations run again (0.00 s, "
                            "0.0% of training time); speculation paused on 0 of 0 iterations")


def test_the_post_validation_flag_lives_in_the_config_the_step_reads():
    """--enable-optimizer-post-validation chooses the step's form (and the profiled schedules' objective), so it
    is TrainingConfig's; the optimizer never read it."""
    import dataclasses
    from llamapipe.training.arguments import parse_args
    assert "post_validation" not in {f.name for f in dataclasses.fields(OptimizerConfig)}
    config = parse_args(["--mock-data", "--enable-optimizer-post-validation", "--pipeline-model-parallel-size", "1"])
    assert config.training.post_validation is True
    assert parse_args(["--mock-data"]).training.post_validation is False

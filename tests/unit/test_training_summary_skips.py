"""The end-of-training summary counts skipped updates, and an fp16 run that skipped every one gets the hint
that its loss scale started too high (issue 39, item 5: the zero-bubble example's fp16 default ended with
"training done: 0 iterations" and nothing more)."""
from __future__ import annotations

from llamapipe.training.progress import SKIPPED_ALL_HINT
from tests.unit.test_training_log import _progress, _step


def _skip(progress, it: int, loss_scale: float) -> None:
    progress.skipped(iteration=it, consumed_samples=4 * it, global_batch_size=4, seconds=0.1, lr=1e-3,
                     loss_scale=loss_scale, skipped_iterations=it, reason=f"inf/nan in gradients (loss scale now "
                                                                          f"{loss_scale:g})")


def test_all_skipped_under_a_loss_scale_gets_the_hint(tmp_path):
    progress, writer, _ = _progress(tmp_path, log_interval=100)
    for it, scale in enumerate([2.0 ** 32, 2.0 ** 31, 2.0 ** 30], start=1):
        _skip(progress, it, scale)
    writer.close()
    summary = progress.summary()
    assert summary.startswith("training done: 0 iterations in ")
    assert summary.endswith("; 3 iteration(s) skipped their update (last: inf/nan in gradients (loss scale now "
                            "1.07374e+09))" + SKIPPED_ALL_HINT)
    assert "--initial-loss-scale 65536" in SKIPPED_ALL_HINT


def test_some_skipped_are_counted_without_the_hint(tmp_path):
    progress, writer, _ = _progress(tmp_path, log_interval=100)
    _skip(progress, 1, 2.0 ** 32)
    _step(progress, 2, 5.0, 0.5)
    writer.close()
    summary = progress.summary()
    assert "; 1 iteration(s) skipped their update (last: " in summary and SKIPPED_ALL_HINT not in summary
    assert summary.endswith("; lm loss 5.0000 at iteration 2 (one iteration: nothing to compare)")

"""--rampup-batch-size: the batch sizes, microbatch counts and consumed samples per iteration against
Megatron-LM's RampupBatchsizeNumMicroBatchesCalculator worked by hand, --train-samples iteration counts
(Megatron's update_train_iters), the one-line errors, and exact resume of the data sampler mid-ramp."""
import pytest

from llamapipe.core.config import ArgumentError
from llamapipe.core.num_microbatches_calculator import (build_num_microbatches_calculator, check_rampup_batch_size,
                                                        samples_for_iters, train_iters_for_samples)
from llamapipe.data.sampler import PretrainingSampler
from llamapipe.training.flag_names import worded_as_flags

# --global-batch-size 12 --rampup-batch-size 2 2 20, mbs 1, dp 2: 5 increments, one every 20 / 5 = 4.0 samples.
# Megatron: consumed <= 20 -> 2 + int(consumed / 4.0) * 2, else 12.
#   consumed before:  0  2  4  8 14 22 34      batch: 2 2 4 6 8 12 12      microbatches (/ 2): 1 1 2 3 4 6 6
RAMP = (2, 2, 20)
HAND_BATCHES = [2, 2, 4, 6, 8, 12, 12]
HAND_CONSUMED = [0, 2, 4, 8, 14, 22, 34]


def test_microbatches_and_consumed_samples_follow_megatrons_ramp():
    calc = build_num_microbatches_calculator(12, 1, 2, RAMP)
    consumed, batches, microbatches, before = 0, [], [], []
    for _ in range(len(HAND_BATCHES)):
        calc.update(consumed)
        before.append(consumed)
        batches.append(calc.get_current_global_batch_size())
        microbatches.append(calc.get())
        consumed += calc.get_current_global_batch_size()
    assert before == HAND_CONSUMED
    assert batches == HAND_BATCHES
    assert microbatches == [b // 2 for b in HAND_BATCHES] == [1, 1, 2, 3, 4, 6, 6]
    calc.update(22)          # resume: the batch size depends on consumed samples only
    assert calc.get_current_global_batch_size() == 12 and calc.get() == 6
    calc.update(8)
    assert calc.get_current_global_batch_size() == 6


def test_float_step_boundaries_match_megatron():
    # 4 -> 16 in steps of 4 over 10 samples: one step every 10 / 3 = 3.33.. samples (Megatron's float division)
    calc = build_num_microbatches_calculator(16, 1, 1, (4, 4, 10))
    sizes = {}
    for consumed in (0, 3, 4, 6, 7, 9, 10, 11):
        calc.update(consumed)
        sizes[consumed] = calc.get_current_global_batch_size()
    want = {c: 4 + int(c / (10 / 3)) * 4 if c <= 10 else 16 for c in sizes}
    assert sizes == want
    assert sizes[3] == 4 and sizes[4] == 8 and sizes[7] == 12 and sizes[11] == 16


def test_constant_calculator():
    calc = build_num_microbatches_calculator(12, 2, 3)
    calc.update(1000)
    assert (calc.get(), calc.get_current_global_batch_size()) == (2, 12)


@pytest.mark.parametrize("train_samples,want", [
    (40, 6),     # ramp: 2 2 4 6 8 (22 samples), then (40 - 22) // 12 = 1 full batch
    (10, 4),     # the ramp loop stops once more than 10 samples are consumed: 2 2 4 6
    (22, 5),     # exactly the ramp
    (100, 11),   # 5 ramp iterations + (100 - 22) // 12 = 6
])
def test_train_iters_for_samples_is_megatrons_update_train_iters(train_samples, want):
    assert train_iters_for_samples(train_samples, 12, RAMP) == want


def test_train_iters_and_samples_without_ramp():
    assert train_iters_for_samples(100, 12, None) == 8
    assert samples_for_iters(8, 12, None) == 96
    assert samples_for_iters(7, 12, RAMP) == sum(HAND_BATCHES)


@pytest.mark.parametrize("ramp,gbs,mbs,dp,pp,match", [
    ((2, 2, 0), 12, 1, 1, 1, r"--rampup-batch-size 2 2 0: the start batch size, increment and ramp-up samples"),
    ((12, 2, 8), 12, 1, 1, 1, r"starts at 12, not below --global-batch-size 12"),
    ((2, 4, 8), 12, 1, 1, 1, r"the ramp from 2 to --global-batch-size 12 \(10\) is not divisible by the increment 4"),
    ((2, 1, 8), 12, 1, 2, 1, r"reaches global batch size 3, which is not divisible by --micro-batch-size \(1\) x "
                             r"data-parallel size \(2\)"),
    ((4, 4, 8), 12, 2, 1, 4, r"starts with 2 microbatches \(4 / \(--micro-batch-size 2 x data-parallel size 1\)\), "
                             r"fewer than --pipeline-model-parallel-size \(4\)"),
])
def test_rampup_errors_are_one_line(ramp, gbs, mbs, dp, pp, match):
    with pytest.raises(ArgumentError, match=match) as err, worded_as_flags():
        check_rampup_batch_size(ramp, gbs, mbs, dp, pp)
    assert "\n" not in str(err.value)


def test_sampler_resumes_exactly_mid_ramp():
    """Each DP rank draws calc.get() microbatches per iteration; the union over ranks of iteration k is the
    consumed-sample range [consumed_k, consumed_k + batch_k), and a sampler restarted at consumed_k yields
    exactly the rest of the uninterrupted sequence."""
    mbs, dp, iters = 1, 2, len(HAND_BATCHES)
    total = samples_for_iters(iters, 12, RAMP)
    per_rank = [iter(PretrainingSampler(total, 0, mbs, r, dp)) for r in range(dp)]
    calc = build_num_microbatches_calculator(12, mbs, dp, RAMP)
    consumed = 0
    for k in range(iters):
        calc.update(consumed)
        drawn = [i for it in per_rank for _ in range(calc.get()) for i in next(it)]
        assert sorted(drawn) == list(range(consumed, consumed + HAND_BATCHES[k]))
        for r in range(dp):
            resumed = list(PretrainingSampler(total, consumed, mbs, r, dp))
            assert resumed == list(PretrainingSampler(total, 0, mbs, r, dp))[consumed // (mbs * dp):]
        consumed += calc.get_current_global_batch_size()
    assert consumed == total and all(next(it, None) is None for it in per_rank)

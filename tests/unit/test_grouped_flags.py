"""The flags of the grouped schedules: Megatron's --microbatch-group-size-per-virtual-pipeline-stage and the
zero-bubble fork's --interleave-group-size and --enable-1f1b-v become the schedule name and chunks the builders
take (schedule_specs "NAME:N"); bad values are one line naming the flag and the numbers."""
import pytest

from llamapipe.training.arguments.parser import ArgumentError, build_parser, config_from_args

BASE = ["--num-layers", "8", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
        "--max-position-embeddings", "32", "--micro-batch-size", "1", "--global-batch-size", "16", "--train-iters",
        "3", "--mock-data", "--vocab-size", "256", "--pipeline-model-parallel-size", "4"]


def choice(*extra):
    cfg = config_from_args(build_parser().parse_args(BASE + list(extra)), 4)
    return cfg.parallel.pipeline_schedule, cfg.parallel.vpp_size


@pytest.mark.parametrize("flags, want", [
    (["--num-virtual-stages-per-pipeline-rank", "2", "--microbatch-group-size-per-virtual-pipeline-stage", "4"],
     ("interleaved", 2)),                                       # Megatron's default, pp: today's order
    (["--num-virtual-stages-per-pipeline-rank", "2", "--microbatch-group-size-per-virtual-pipeline-stage", "8"],
     ("interleaved:8", 2)),
    (["--pipeline-schedule", "interleaved", "--num-layers-per-virtual-pipeline-stage", "1",
      "--microbatch-group-size-per-virtual-pipeline-stage", "5"], ("interleaved:5", 2)),
    (["--num-layers-per-virtual-pipeline-stage", "1", "--interleave-group-size", "2"], ("group-interleaved:2", 2)),
    (["--interleave-group-size", "4", "--num-virtual-stages-per-pipeline-rank", "2"], ("group-interleaved:4", 2)),
    (["--enable-1f1b-v"], ("1f1b-v", 2)),
    (["--pipeline-schedule", "1f1b-v"], ("1f1b-v", 2)),         # one shape: two chunks without a flag
])
def test_the_flags_become_the_schedule(flags, want):
    assert choice(*flags) == want


@pytest.mark.parametrize("flags, message", [
    (["--num-virtual-stages-per-pipeline-rank", "2", "--microbatch-group-size-per-virtual-pipeline-stage", "3"],
     "^--microbatch-group-size-per-virtual-pipeline-stage 3 must be at least --pipeline-model-parallel-size 4: "),
    (["--microbatch-group-size-per-virtual-pipeline-stage", "4", "--pipeline-schedule", "1f1b"],
     "^--microbatch-group-size-per-virtual-pipeline-stage 4 groups the interleaved schedule's microbatches; "
     "--pipeline-schedule 1f1b has no such groups"),
    (["--interleave-group-size", "-1", "--num-virtual-stages-per-pipeline-rank", "2"],
     r"^--interleave-group-size -1 must be a positive number of microbatches, or 0 for none$"),
    (["--interleave-group-size", "2"], "^--pipeline-schedule group-interleaved:2 needs 2 or more model chunks"),
    (["--enable-1f1b-v", "--zero-bubble-v-schedule"], "^--enable-1f1b-v runs a fused backward; it cannot be combined "
     r"with --zero-bubble-v-schedule \(as in the fork\)$"),
])
def test_bad_values_are_one_line(flags, message):
    with pytest.raises(ArgumentError, match=message) as err:
        choice(*flags)
    assert "\n" not in str(err.value)


def test_the_fork_flags_contradicting_a_schedule_stop_the_parser():
    with pytest.raises(SystemExit):
        build_parser().parse_args(BASE + ["--pipeline-schedule", "zbv", "--enable-1f1b-v"])


def test_the_zero_bubble_schedules_take_precedence_over_the_group_as_in_the_fork():
    args = build_parser().parse_args(BASE + ["--interleave-group-size", "2", "--zero-bubble-v-schedule"])
    cfg = config_from_args(args, 4)
    assert (cfg.parallel.pipeline_schedule, cfg.parallel.vpp_size) == ("zbv", 2)


def test_a_group_above_the_pipeline_size_is_capped_with_a_notice_as_the_fork_resets_it():
    from llamapipe.training.arguments.zb_fork_flags import check_fork_flags
    args = build_parser().parse_args(BASE + ["--interleave-group-size", "6", "--num-virtual-stages-per-pipeline-rank",
                                             "2"])
    assert check_fork_flags(args) == ["notice: --interleave-group-size 6 is more than --pipeline-model-parallel-size "
                                      "4: groups of 4 are built, as the fork resets it"]

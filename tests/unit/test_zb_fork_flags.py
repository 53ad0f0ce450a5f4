"""The zero-bubble fork's flags (training/arguments/zb_fork_flags.py): each setting of the fork's README and
examples/ becomes the schedule, chunks, memory cap and profiling window the fork's runtime would use, in any
flag order; contradictions, refused flags and the padding split are one line; no-effect flags one notice."""
import pytest

from llamapipe.core.pipeline_parallel.layout import layout_layer_counts
from llamapipe.training.arguments.parser import ArgumentError, build_parser, config_from_args
from llamapipe.training.arguments.zb_fork_flags import NOTICES, REFUSED

BASE = ["--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
        "--max-position-embeddings", "32", "--micro-batch-size", "1", "--global-batch-size", "8", "--train-iters",
        "3", "--mock-data", "--vocab-size", "256", "--pipeline-model-parallel-size", "2"]


def config(*extra, world=2):
    return config_from_args(build_parser().parse_args(BASE + list(extra)), world)


def run_choice(cfg):
    return (cfg.parallel.pipeline_schedule, cfg.parallel.vpp_size, cfg.parallel.pipeline_memory_limit,
            cfg.training.profile_iters)


@pytest.mark.parametrize("flags, want", [
    (["--zero-bubble-v-schedule"], ("zbv", 2, None, 3)),
    (["--zero-bubble-v-schedule", "--zero-bubble-v-schedule-mem-setup", "half"], ("v-half", 2, None, 3)),
    (["--zero-bubble-v-schedule-mem-setup", "min", "--zero-bubble-v-schedule"], ("v-min", 2, None, 3)),
    (["--enable-zero-bubble", "--zero-bubble-v-schedule", "--zero-bubble-max-pending-backward", "4"],
     ("zbv", 2, None, 3)),
    (["--enable-zero-bubble"], ("auto", 1, None, 110)),          # the fork's timers end at iteration 110
    (["--enable-zero-bubble", "--zero-bubble-max-pending-backward", "2", "--zero-bubble-pipeline-timers-end-iter",
      "5"], ("auto", 1, 2.0, 5)),                                 # ZB-1p's cap at p = 2
    (["--zero-bubble-pipeline-timers-end-iter", "4", "--zero-bubble-max-pending-backward", "4",
      "--enable-zero-bubble"], ("auto", 1, 4.0, 4)),              # ZB-2p's, flags in another order
    (["--enable-zero-bubble", "--zero-bubble-max-pending-backward", "4", "--zero-bubble-v-schedule"],
     ("zbv", 2, None, 3)),                                        # V drops the cap and the window it set
    ([], ("1f1b", 1, None, 3)),
])
def test_the_forks_settings_become_its_schedule(flags, want):
    assert run_choice(config(*flags)) == want


@pytest.mark.parametrize("flags", [
    ["--enable-zero-bubble", "--pipeline-schedule", "1f1b"],
    ["--zero-bubble-v-schedule", "--num-virtual-stages-per-pipeline-rank", "3"],
    ["--enable-zero-bubble", "--zero-bubble-max-pending-backward", "4", "--pipeline-memory-limit", "3"],
])
def test_a_contradicting_flag_after_the_fork_flag_is_one_error(flags):
    with pytest.raises(ArgumentError, match="contradicts .* that the zero-bubble fork's flags set; drop one"):
        config(*flags)


def test_a_contradicting_flag_before_the_fork_flag_stops_the_parser(capsys):
    with pytest.raises(SystemExit) as exit_info:
        build_parser().parse_args(BASE + ["--pipeline-schedule", "interleaved", "--zero-bubble-v-schedule"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.splitlines()[-1]
    assert err.endswith("--zero-bubble-v-schedule sets --pipeline-schedule zbv (the zero-bubble fork's meaning), "
                        "which contradicts --pipeline-schedule interleaved; drop one")


@pytest.mark.parametrize("flags, message", [
    (["--enable-zero-bubble", "--pipeline-model-parallel-size", "1"], "--enable-zero-bubble needs "
     "--pipeline-model-parallel-size > 1, got 1"),
    (["--enable-zero-bubble", "--num-virtual-stages-per-pipeline-rank", "2"], "runs one model chunk per rank"),
    (["--zero-bubble-v-schedule", "--num-layers-per-virtual-pipeline-stage", "1"], "sets two model chunks per rank"),
    (["--enable-zero-bubble", "--zero-bubble-max-pending-backward", "lots"], "must be a positive number"),
])
def test_what_the_fork_refuses_is_refused(flags, message):
    world = 1 if "1" in flags[-1:] and "--pipeline-model-parallel-size" in flags else 2
    with pytest.raises(ArgumentError, match=message):
        config(*flags, world=world)


@pytest.mark.parametrize("entry", REFUSED, ids=lambda e: e.flag)
def test_a_refused_fork_flag_says_what_to_use(entry):
    value = [] if entry.type is None else ["3"]
    with pytest.raises(ArgumentError) as err:
        config(entry.flag, *value)
    assert str(err.value).startswith(f"{entry.flag}{' 3' if value else ''} is not supported: ") and " use " in \
        str(err.value)
    if entry.off:
        config(entry.flag, str(entry.off[0]))       # the value that means off passes


@pytest.mark.parametrize("entry", NOTICES, ids=lambda e: e.flag)
def test_a_fork_flag_with_no_effect_is_one_notice(entry, llamapipe_log):
    value = [] if entry.type is None else ["0.5"]
    config(entry.flag, *value)
    lines = [line for line in llamapipe_log if f"notice: {entry.flag}" in line]
    assert lines == [f"notice: {entry.flag}{' 0.5' if value else ''} has no effect here: {entry.why}"]


def test_tuning_flags_without_zero_bubble_or_under_a_fixed_v_order_are_notices(llamapipe_log):
    config("--zero-bubble-pipeline-timers-end-iter", "5", "--zero-bubble-v-schedule-mem-setup", "half")
    config("--zero-bubble-v-schedule", "--zero-bubble-max-pending-backward", "4")
    config("--enable-zero-bubble")
    lines = [line for line in llamapipe_log if "zero-bubble" in line]
    assert lines == [
        "notice: --zero-bubble-v-schedule-mem-setup has no effect here: it needs --zero-bubble-v-schedule",
        "notice: --zero-bubble-pipeline-timers-end-iter has no effect here: it needs --enable-zero-bubble",
        "notice: --zero-bubble-max-pending-backward has no effect here: zbv is a fixed order, not fitted to "
        "profiled costs",
        "notice: --zero-bubble-max-pending-backward auto: the fork's adaptive cap is not implemented; auto plans "
        "under its default cap, 1F1B's activation memory (give N, e.g. 2p for ZB-2p, or --pipeline-memory-limit "
        "BYTES)",
        "notice: --zero-bubble-pipeline-timers-start-iter 100: every profiled iteration but the first (warm-up) is "
        "timed here"]


def _fork_padding(layers: int, stages: int, pp: int) -> list[int]:
    """The fork's rule, spelled independently: pad to a multiple of pp, split evenly over the virtual stages,
    take one padded layer off the last stage, then the first, the second, ..."""
    padded = -(-layers // pp) * pp
    counts = [padded // stages] * stages
    order = [stages - 1] + list(range(stages - 1))
    for stage in order[:padded - layers]:
        counts[stage] -= 1
    return counts


@pytest.mark.parametrize("layers, pp, v", [(6, 4, False), (7, 4, False), (5, 4, False), (7, 2, True),
                                           (14, 4, True)])
def test_padding_is_refused_with_the_layout_that_makes_the_forks_split(layers, pp, v, llamapipe_log):
    flags = ["--num-layers", str(layers), "--pipeline-model-parallel-size", str(pp), "--global-batch-size", "16",
             "--allow-padding-num-layers"] + (["--zero-bubble-v-schedule"] if v else [])
    with pytest.raises(ArgumentError) as err:
        config(*flags, world=pp)
    text = str(err.value).split('--pipeline-model-parallel-layout "')[1].rstrip('"')
    stages = pp * (2 if v else 1)
    assert layout_layer_counts(text, layers, pp) == _fork_padding(layers, stages, pp)
    cfg = config(*[f for f in flags if f != "--allow-padding-num-layers"], "--pipeline-model-parallel-layout", text,
                 world=pp)
    assert cfg.parallel.vpp_size == (2 if v else 1)       # the suggested line runs


def test_padding_that_two_chunks_per_rank_cannot_split_is_refused_as_the_fork_does():
    with pytest.raises(ArgumentError, match="pads --num-layers 10 to 12, which two model chunks on each of "
                                            "--pipeline-model-parallel-size 4 ranks cannot split evenly"):
        config("--num-layers", "10", "--pipeline-model-parallel-size", "4", "--global-batch-size", "16",
               "--allow-padding-num-layers", "--zero-bubble-v-schedule", world=4)

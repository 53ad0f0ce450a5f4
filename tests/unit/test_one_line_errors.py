"""Flag errors that were tracebacks or unclear lines (issue 40), each now one `pretrain_llama.py: error:` line
from the command line as the user types it: a layout whose repeat count would exhaust memory, a NaN data weight,
--save naming a file, a binary schedule file, a schedule file contradicted by a later --pipeline-schedule, HF's
--rope-theta, --use-torch-fsdp2 with a typed no_shard, and a timers window that ends before it starts."""
from __future__ import annotations

import os

import pytest

from llamapipe.training.arguments.parser import parse_args

TINY = ["--mock-data", "--model", "tiny"]


def error_line(argv: list[str], capsys, world: int = 1) -> str:
    with pytest.raises(SystemExit) as info:
        parse_args(argv, world_size=world)
    assert info.value.code == 2
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) in (1, 2) and lines[-1].startswith("pretrain_llama.py: error: "), lines  # 2: argparse's usage
    return lines[-1][len("pretrain_llama.py: error: "):]


def test_a_layout_that_would_expand_beyond_memory_is_one_line(capsys):
    """Before: a MemoryError traceback on every rank (the string was expanded before any check)."""
    assert error_line(TINY + ["--pipeline-model-parallel-layout", "Et*999999999999|tL"], capsys) == (
        "--pipeline-model-parallel-layout 'Et*999999999999|tL' expands to 1000000000003 letters; a layout names "
        "each decoder layer once (t), so it cannot be that long (at most 1000000)")
    assert error_line(TINY + ["--pipeline-model-parallel-layout", "((t*1000)*1000)*1000"], capsys).endswith(
        "expands to 1000000000 letters; a layout names each decoder layer once (t), so it cannot be that long "
        "(at most 1000000)")


@pytest.mark.parametrize("weight", ["nan", "inf", "-1"])
def test_a_data_weight_that_is_not_a_positive_number_is_one_line(tmp_path, capsys, weight):
    """Before: "cannot convert float NaN to integer"."""
    for name in ("a", "b"):
        for ext in (".bin", ".idx"):
            (tmp_path / (name + ext)).write_bytes(b"")
    argv = ["--model", "tiny", "--tokenizer-type", "NullTokenizer", "--vocab-size", "100", "--data-path",
            weight, str(tmp_path / "a"), "1", str(tmp_path / "b")]
    assert error_line(argv, capsys) == f"--data-path weight {weight} must be a positive number"


def test_save_naming_a_file_is_one_line(tmp_path, capsys):
    """Before: "cannot create its lock file llamapipe.lock (File exists)"."""
    path = tmp_path / "notes.txt"
    path.write_text("x")
    assert error_line(TINY + ["--save", str(path)], capsys) == \
        f"--save {path} is a file, not a directory; checkpoints go into a directory"


def test_a_dangling_save_link_and_a_fifo_tokenizer_are_named_for_what_they_are(tmp_path, capsys):
    """Issue 51: a dangling --save link was reported "is a file", a FIFO --tokenizer-model "does not exist"."""
    link, fifo = tmp_path / "ckpt", tmp_path / "tok.model"
    link.symlink_to(tmp_path / "gone")
    os.mkfifo(fifo)
    assert error_line(TINY + ["--save", str(link)], capsys) == \
        f"--save {link} is a dangling symbolic link (to {tmp_path / 'gone'}, which does not exist); create that " \
        "directory or give another --save"
    assert error_line(TINY + ["--tokenizer-model", str(fifo)], capsys) == \
        f"--tokenizer-model {fifo} is a FIFO (named pipe), not a regular file (a tokenizer model) or a directory " \
        "(an HF tokenizer)"


def test_a_binary_schedule_file_is_named(tmp_path, capsys):
    """Before: the UTF-8 decoder's message, without the file."""
    path = tmp_path / "plan.csv"
    path.write_bytes(b"0F0,\xff\xfe\x00garbage")
    assert error_line(TINY + ["--pipeline-model-parallel-size", "2", "--pipeline-schedule-file", str(path)],
                      capsys, world=2) == (f"--pipeline-schedule-file: schedule file {path} is not UTF-8 text (byte 4); "
                                           "give a torch CSV schedule")


def test_a_schedule_given_after_the_schedule_file_names_the_contradiction(tmp_path, capsys):
    """Before: a complaint about zbv's model chunks, as if the file were not there."""
    from llamapipe.core.pipeline_parallel.schedule_csv import to_csv
    from llamapipe.core.pipeline_parallel.schedule_specs import build
    path = tmp_path / "one_f_one_b.csv"
    path.write_text(to_csv(build("1f1b", 2, 1, 4)))
    argv = TINY + ["--pipeline-model-parallel-size", "2", "--pipeline-schedule-file", str(path),
                   "--pipeline-schedule", "zbv"]
    assert error_line(argv, capsys, world=2) == (f"--pipeline-schedule-file {path} sets --pipeline-schedule "
                                                 f"file:{path}, which contradicts --pipeline-schedule zbv; drop one")


def test_rope_theta_names_rotary_base(capsys):
    """Before: "did you mean --profile-step-start?"."""
    assert error_line(TINY + ["--rope-theta", "500000"], capsys) == (
        "--rope-theta 500000.0 is not supported: it is HF's config.json name for RoPE's base; the flag is "
        "--rotary-base (Megatron's)")


def test_fsdp2_with_a_typed_no_shard_is_a_contradiction(capsys):
    """Before: ZeRO-3 ran silently. The default (no strategy typed) still means ZeRO-3, as in Megatron."""
    assert error_line(TINY + ["--use-torch-fsdp2", "--data-parallel-sharding-strategy", "no_shard"], capsys) == (
        "--use-torch-fsdp2 selects ZeRO-3 (optim_grads_params) and cannot be combined with "
        "--data-parallel-sharding-strategy no_shard")
    assert parse_args(TINY + ["--use-torch-fsdp2"], world_size=2).parallel.data_parallel_sharding_strategy == \
        "optim_grads_params"


def test_a_timers_window_that_ends_before_it_starts_is_one_line(capsys):
    argv = TINY + ["--zero-bubble-pipeline-timers-start-iter", "10", "--zero-bubble-pipeline-timers-end-iter", "5"]
    assert error_line(argv, capsys) == ("--zero-bubble-pipeline-timers-start-iter 10 is after "
                                        "--zero-bubble-pipeline-timers-end-iter 5; the timers run from the start "
                                        "iteration to the end one")

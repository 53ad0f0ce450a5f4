"""Every inconsistent flag combination is rejected by training/arguments/parser.py with one plain sentence."""
import os
import subprocess
import sys

import pytest

from llamapipe.training.arguments.parser import ArgumentError, build_parser, config_from_args, parse_args

from tests.harness import ROOT


def cfg(argv, world=1):
    """The tiny preset on mock data, with `argv` on top."""
    return config_from_args(build_parser().parse_args(["--mock-data", "--model", "tiny"] + argv), world)


def rejects(argv, world, *fragments):
    with pytest.raises(ArgumentError) as info:
        cfg(argv, world)
    message = str(info.value)
    assert "\n" not in message
    for fragment in fragments:
        assert fragment in message, message
    return message


def test_defaults_are_consistent():
    c = cfg([])
    assert (c.parallel.tp_size, c.parallel.pp_size, c.parallel.dp_size, c.parallel.vpp_size) == (1, 1, 1, 1)
    assert c.parallel.pipeline_schedule == "1f1b"
    assert c.training.num_microbatches == 1
    assert c.model.num_layers == 8


def test_derived_sizes_and_default_interleaved_schedule():
    c = cfg(["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2",
             "--num-layers-per-virtual-pipeline-stage", "2", "--global-batch-size", "8"], world=8)
    assert (c.parallel.dp_size, c.parallel.vpp_size, c.parallel.pipeline_schedule) == (2, 2, "interleaved")
    assert c.training.num_microbatches == 4


def test_virtual_stages_per_rank_is_the_same_layout_as_layers_per_virtual_stage():
    by_chunks = cfg(["--pipeline-model-parallel-size", "2", "--num-virtual-stages-per-pipeline-rank", "2",
                     "--global-batch-size", "4"], world=2)
    by_layers = cfg(["--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage", "2",
                     "--global-batch-size", "4"], world=2)
    assert by_chunks == by_layers
    assert (by_chunks.parallel.vpp_size, by_chunks.parallel.pipeline_schedule) == (2, "interleaved")


def test_one_virtual_stage_per_rank_combines_with_an_uneven_split():
    c = cfg(["--pipeline-model-parallel-size", "2", "--num-virtual-stages-per-pipeline-rank", "1",
             "--decoder-last-pipeline-num-layers", "3", "--global-batch-size", "2"], world=2)
    assert (c.parallel.vpp_size, c.parallel.last_stage_layers) == (1, 3)


def test_preset_and_override():
    c = cfg(["--model", "llama2-70b", "--num-layers", "4"])
    assert (c.model.hidden_size, c.model.num_query_groups, c.model.num_layers) == (8192, 8, 4)


CASES = [
    (["--tensor-model-parallel-size", "3"], 4, ("world size 4", "--tensor-model-parallel-size (3)")),
    (["--pipeline-model-parallel-size", "3"], 3, ("--num-layers 8", "(3)")),
    (["--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage", "3"], 2,
     ("layers per pipeline rank (4", "--num-layers-per-virtual-pipeline-stage (3)")),
    (["--num-layers-per-virtual-pipeline-stage", "2"], 1, ("--pipeline-model-parallel-size > 1",)),
    (["--pipeline-model-parallel-size", "2", "--pipeline-schedule", "zbv", "--num-virtual-stages-per-pipeline-rank",
      "4", "--global-batch-size", "4"], 2, ("zbv", "exactly 2 model chunks", "got 4")),
    (["--pipeline-schedule", "zbv"], 1, ("zbv", "--pipeline-model-parallel-size > 1")),
    (["--global-batch-size", "10", "--micro-batch-size", "2"], 2,
     ("--global-batch-size 10", "--micro-batch-size (2)", "data-parallel size (2)")),
    (["--pipeline-model-parallel-size", "4", "--global-batch-size", "2"], 4,
     ("number of microbatches (2", "--pipeline-model-parallel-size (4)")),
    (["--num-attention-heads", "6", "--hidden-size", "192", "--tensor-model-parallel-size", "4"], 4,
     ("--num-attention-heads 6", "(4)")),
    (["--num-query-groups", "3", "--group-query-attention"], 1, ("--num-query-groups 3", "--num-attention-heads (4)")),
    (["--num-query-groups", "1", "--tensor-model-parallel-size", "2"], 2,
     ("--num-query-groups 1", "--tensor-model-parallel-size (2)")),
    (["--hidden-size", "130"], 1, ("--hidden-size 130", "--num-attention-heads (4)")),
    (["--seq-length", "512"], 1, ("--seq-length 512", "--max-position-embeddings (256)")),
    (["--fp16", "--bf16"], 1, ("--fp16", "--bf16")),
    (["--pipeline-schedule", "zb-h3"], 1, ("--pipeline-schedule zb-h3", "unknown")),
    (["--load", "/nonexistent/ckpt"], 1, ("--load /nonexistent/ckpt",)),
    (["--micro-batch-size", "0"], 1, ("--micro-batch-size 0", "positive")),
    (["--train-iters", "-1"], 1, ("--train-iters -1", "positive")),
    (["--lr", "0"], 1, ("--lr 0", "positive")),
    (["--tokenizer-model", "/nonexistent/tok.model"], 1, ("--tokenizer-model /nonexistent/tok.model",)),
    (["--pipeline-model-parallel-size", "2", "--pipeline-schedule", "interleaved"], 2, ("interleaved",)),
    (["--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage", "2",
      "--pipeline-schedule", "zb-h1", "--global-batch-size", "2"], 2, ("zb-h1", "one model chunk")),
    (["--ffn-hidden-size", "351", "--tensor-model-parallel-size", "2"], 2, ("--ffn-hidden-size 351",)),
    (["--split", "90,10,0,1"], 1, ("--split 90,10,0,1", "up to three")),
    (["--lr-warmup-iters", "20", "--train-iters", "10"], 1, ("--lr-warmup-iters 20", "(10")),
    (["--pipeline-model-parallel-size", "2", "--pipeline-schedule", "auto", "--pipeline-memory-limit", "0.5",
      "--global-batch-size", "2"], 2, ("--pipeline-memory-limit 0.5",)),
    (["--num-layers", "16", "--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage", "2",
      "--pipeline-schedule", "auto", "--global-batch-size", "2"], 2, ("auto supports 1 or 2", "got 4")),
    (["--split", "100,0,0", "--eval-iters", "2", "--eval-interval", "5"], 1,
     ("--eval-interval 5 needs validation data", "--split 100,0,0 gives it weight 0")),
    (["--recompute-num-layers", "2"], 1, ("--recompute-num-layers 2", "--recompute-granularity full")),
    (["--pipeline-model-parallel-size", "2", "--decoder-first-pipeline-num-layers", "5",
      "--decoder-last-pipeline-num-layers", "2", "--global-batch-size", "2"], 2,
     ("--decoder-first-pipeline-num-layers 5", "--decoder-last-pipeline-num-layers 2", "add up to --num-layers 8")),
    (["--pipeline-model-parallel-size", "4", "--decoder-last-pipeline-num-layers", "3", "--global-batch-size", "4"],
     4, ("--decoder-last-pipeline-num-layers 3 leaves 5", "other 3 pipeline stages")),
    (["--pipeline-model-parallel-size", "2", "--decoder-first-pipeline-num-layers", "0", "--global-batch-size", "2"],
     2, ("--decoder-first-pipeline-num-layers 0 must be at least 1",)),
    (["--decoder-last-pipeline-num-layers", "3"], 1, ("--pipeline-model-parallel-size > 1",)),
    (["--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage", "2",
      "--decoder-last-pipeline-num-layers", "2", "--global-batch-size", "2"], 2,
     ("--decoder-last-pipeline-num-layers 2", "cannot be combined with --num-layers-per-virtual-pipeline-stage 2")),
    (["--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage", "4",   # 1 chunk per rank
      "--decoder-last-pipeline-num-layers", "3", "--global-batch-size", "2"], 2,
     ("cannot be combined with --num-layers-per-virtual-pipeline-stage 4",)),
    (["--pipeline-model-parallel-size", "2", "--decoder-last-pipeline-num-layers", "3", "--pipeline-schedule", "zbv",
      "--global-batch-size", "2"], 2, ("--decoder-last-pipeline-num-layers 3 needs one model chunk",
                                       "--pipeline-schedule zbv")),
    (["--pipeline-model-parallel-size", "2", "--decoder-first-pipeline-num-layers", "9", "--global-batch-size", "2"],
     2, ("--decoder-first-pipeline-num-layers 9 is more than --num-layers 8",)),
    (["--attention-dropout", "0.1"], 1, ("--attention-dropout 0.1", "no dropout")),
    (["--ddp-bucket-size", "0"], 2, ("--ddp-bucket-size", "got 0")),
    (["--pipeline-model-parallel-size", "2", "--num-virtual-stages-per-pipeline-rank", "2",
      "--num-layers-per-virtual-pipeline-stage", "2"], 2,
     ("--num-layers-per-virtual-pipeline-stage 2 and --num-virtual-stages-per-pipeline-rank 2", "only one")),
    (["--num-virtual-stages-per-pipeline-rank", "2"], 1, ("--num-virtual-stages-per-pipeline-rank",
                                                          "--pipeline-model-parallel-size > 1")),
    (["--pipeline-model-parallel-size", "2", "--num-virtual-stages-per-pipeline-rank", "3",
      "--global-batch-size", "2"], 2, ("--num-layers 8 is not divisible by --pipeline-model-parallel-size 2 x "
                                       "--num-virtual-stages-per-pipeline-rank 3 (6 virtual stages)",)),
    (["--pipeline-model-parallel-size", "2", "--num-layers", "6", "--pipeline-schedule", "zbv",
      "--global-batch-size", "2"], 2, ("got 1, and --num-layers 6 is not divisible by the 2 x "
                                       "--pipeline-model-parallel-size 2 = 4 virtual stages",)),
    (["--pipeline-model-parallel-size", "2", "--num-virtual-stages-per-pipeline-rank", "4", "--pipeline-schedule",
      "auto", "--global-batch-size", "2"], 2, ("auto supports 1 or 2", "(from --num-virtual-stages-per-pipeline-rank 4)")),
    (["--pipeline-model-parallel-size", "2", "--num-virtual-stages-per-pipeline-rank", "2", "--pipeline-schedule",
      "zb-h2", "--global-batch-size", "2"], 2, ("drop --num-virtual-stages-per-pipeline-rank 2",)),
    (["--pipeline-model-parallel-size", "2", "--num-virtual-stages-per-pipeline-rank", "2",
      "--decoder-first-pipeline-num-layers", "3", "--global-batch-size", "2"], 2,
     ("cannot be combined with --num-virtual-stages-per-pipeline-rank 2",)),
    (["--pipeline-model-parallel-size", "2", "--num-layers", "7", "--num-layers-per-virtual-pipeline-stage", "3",
      "--account-for-loss-in-pipeline-split", "--global-batch-size", "2"], 2,
     ("(4 = (--num-layers 7 + 1 each for the loss) / --pipeline-model-parallel-size 2)",)),
    (["--pipeline-model-parallel-size", "2", "--num-layers", "6", "--num-layers-per-virtual-pipeline-stage", "2",
      "--account-for-loss-in-pipeline-split", "--global-batch-size", "2"], 2,
     ("(--num-layers 6 + 1 each for the loss) = 7 layers is not divisible by --pipeline-model-parallel-size 2",)),
    (["--pipeline-model-parallel-size", "2", "--num-layers", "6", "--pipeline-schedule", "zbv",
      "--num-layers-per-virtual-pipeline-stage", "4", "--account-for-embedding-in-pipeline-split",
      "--account-for-loss-in-pipeline-split", "--global-batch-size", "2"], 2,
     ("set --num-virtual-stages-per-pipeline-rank 2", "--num-layers-per-virtual-pipeline-stage 2)")),
    (["--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage", "2", "--pipeline-schedule",
      "zbv", "--account-for-loss-in-pipeline-split", "--global-batch-size", "2"], 2,
     ("(--num-layers 8 + 1 each for the loss) = 9 layers is not divisible",)),
    (["--pipeline-model-parallel-size", "2", "--account-for-loss-in-pipeline-split",
      "--decoder-last-pipeline-num-layers", "3", "--global-batch-size", "2"], 2,
     ("--account-for-loss-in-pipeline-split cannot be combined with --decoder-first/last",)),
    (["--pipeline-model-parallel-size", "2", "--pipeline-memory-limit", "4GiB", "--global-batch-size", "2"], 2,
     ("--pipeline-memory-limit caps the auto schedule's plan", "--pipeline-schedule 1f1b")),
    (["--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "2"], 1,
     ("--recompute-method uniform",)),
    # issue 32: absurd sizes, exits that stop at once, numbers torch would only fail on later
    (["--global-batch-size", "100000000000"], 1,
     ("--global-batch-size 100000000000 / (--micro-batch-size 1 x data-parallel size 1) = 100000000000 "
      "microbatches per step, more than 1000000",)),
    (["--global-batch-size", "4000004", "--micro-batch-size", "2"], 2, ("= 1000001 microbatches per step",)),
    (["--exit-duration-in-mins", "-1"], 1, ("--exit-duration-in-mins -1.0 must be positive",)),
    (["--exit-duration-in-mins", "0"], 1, ("--exit-duration-in-mins 0.0 must be positive",)),
    (["--exit-interval", "0"], 1, ("--exit-interval 0 must be positive",)),
    (["--exit-interval", "-5"], 1, ("--exit-interval -5 must be positive",)),
    (["--lr", "nan"], 1, ("--lr nan is not a finite number",)),
    (["--lr", "inf"], 1, ("--lr inf is not a finite number",)),
    (["--lr=-1e-3"], 1, ("--lr -0.001 must be positive",)),
    (["--min-lr", "nan"], 1, ("--min-lr nan is not a finite number",)),
    (["--min-lr=-1e-5"], 1, ("--min-lr -1e-05 must not be negative",)),
    (["--clip-grad=-inf"], 1, ("--clip-grad -inf is not a finite number",)),
    (["--clip-grad", "-1"], 1, ("--clip-grad -1.0 must not be negative",)),
    (["--weight-decay", "nan"], 1, ("--weight-decay nan is not a finite number",)),
    (["--weight-decay", "-0.1"], 1, ("--weight-decay -0.1 must not be negative",)),
    (["--adam-beta1", "1.0"], 1, ("--adam-beta1 1.0 must be in [0, 1)",)),
    (["--adam-beta2", "-0.5"], 1, ("--adam-beta2 -0.5 must be in [0, 1)",)),
    (["--adam-beta2", "nan"], 1, ("--adam-beta2 nan is not a finite number",)),
    (["--adam-eps", "0"], 1, ("--adam-eps 0.0 must be positive",)),
    (["--adam-eps=-1e-8"], 1, ("--adam-eps -1e-08 must be positive",)),
    (["--init-method-std", "0"], 1, ("--init-method-std 0.0 must be positive",)),
    (["--fp16", "--loss-scale", "0"], 1, ("--loss-scale 0.0 must be positive",)),
    (["--rotary-base", "inf"], 1, ("--rotary-base inf is not a finite number",)),
    (["--distributed-timeout-minutes", "nan"], 1, ("--distributed-timeout-minutes nan is not a finite number",)),
]


@pytest.mark.parametrize("argv,world,fragments", CASES, ids=[" ".join(c[0]) for c in CASES])
def test_rejected_with_plain_sentence(argv, world, fragments):
    rejects(argv, world, *fragments)


def test_missing_data_path_files_are_named(tmp_path):
    tok = tmp_path / "tok.model"
    tok.write_bytes(b"x")
    with pytest.raises(ArgumentError, match="corpus_text_document.bin does not exist"):
        config_from_args(build_parser().parse_args(
            ["--data-path", str(tmp_path / "corpus_text_document"), "--tokenizer-model", str(tok)]), 1)
    with pytest.raises(ArgumentError, match="--mock-data"):
        config_from_args(build_parser().parse_args([]), 1)


def test_sequence_parallel_with_tp1_is_a_notice_and_turns_off(llamapipe_log):
    c = cfg(["--sequence-parallel"])
    assert c.parallel.sequence_parallel is False
    assert [line for line in llamapipe_log if "--sequence-parallel" in line] == [
        "notice: --sequence-parallel has no effect with --tensor-model-parallel-size 1: there is no other "
        "tensor-parallel rank to split the sequence over (turned off)"]


@pytest.mark.parametrize("text,units,nbytes", [("6", 6.0, None), ("1.5", 1.5, None), ("24GiB", None, 24 * 2 ** 30),
                                              ("512MB", None, 512 * 10 ** 6), ("0.5 gib", None, 2 ** 29)])
def test_pipeline_memory_limit_in_units_or_bytes(text, units, nbytes):
    c = cfg(["--pipeline-model-parallel-size", "2", "--pipeline-schedule", "auto", "--global-batch-size", "2",
             "--pipeline-memory-limit", text], world=2)
    assert (c.parallel.pipeline_memory_limit, c.parallel.pipeline_memory_limit_bytes) == (units, nbytes)


def test_pipeline_memory_limit_that_is_no_size_exits_2_naming_the_flag(capsys):
    with pytest.raises(SystemExit) as info:
        parse_args(["--mock-data", "--pipeline-memory-limit", "lots"], world_size=1)
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "--pipeline-memory-limit" in err and "'lots' is neither a number of activation units" in err


def test_parse_args_exits_2_printing_one_line(capsys):
    with pytest.raises(SystemExit) as info:
        parse_args(["--mock-data", "--tensor-model-parallel-size", "3"], world_size=4)
    assert info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--tensor-model-parallel-size (3)" in err[0]


def test_cli_rejects_before_any_process_group():
    """`WORLD_SIZE=4 pretrain_llama.py --tensor-model-parallel-size 3`: exit 2, one line, no traceback.

    No MASTER_ADDR is set, so creating a process group would fail differently; the clean exit proves
    validation ran first."""
    env = dict(os.environ, WORLD_SIZE="4", RANK="0")
    env.pop("MASTER_ADDR", None)
    proc = subprocess.run([sys.executable, "pretrain_llama.py", "--mock-data", "--tensor-model-parallel-size", "3"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in proc.stderr
    assert "world size 4 is not divisible by --tensor-model-parallel-size (3)" in lines[0]
    other = subprocess.run([sys.executable, "pretrain_llama.py", "--mock-data", "--tensor-model-parallel-size", "3"],
                           cwd=ROOT, env=dict(env, RANK="1"), capture_output=True, text=True, timeout=120)
    assert other.returncode == 2 and other.stderr.strip() == ""   # only rank 0 speaks


@pytest.mark.slow
def test_under_torchrun_the_error_is_printed_once_by_rank_0_without_our_traceback():
    """torchrun adds its own failure report after the workers exit 2; our part is exactly one line."""
    from tests.cli import torchrun
    proc = torchrun(4, ["--mock-data", "--tensor-model-parallel-size", "3"], timeout=120)
    assert proc.returncode != 0
    ours = [line for line in proc.stderr.splitlines() if line.startswith("pretrain_llama.py: error:")]
    assert ours == ["pretrain_llama.py: error: world size 4 is not divisible by --tensor-model-parallel-size (3) "
                    "x --pipeline-model-parallel-size (1)"]
    assert proc.stderr.splitlines()[0] == ours[0]
    assert "[rank0]: Traceback" not in proc.stderr and "failed (exitcode: 2)" in proc.stderr


def test_recompute_method_uniform_means_every_layer_and_block_the_first_n():
    uniform = cfg(["--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "1"])
    block = cfg(["--recompute-granularity", "full", "--recompute-method", "block", "--recompute-num-layers", "3"])
    assert uniform.model.recompute_num_layers is None          # None: every layer of each chunk
    assert block.model.recompute_num_layers == 3


def test_uneven_pipeline_split_reaches_the_config():
    c = cfg(["--num-layers", "9", "--pipeline-model-parallel-size", "2", "--decoder-last-pipeline-num-layers", "4",
             "--global-batch-size", "2"], world=2)
    assert (c.parallel.first_stage_layers, c.parallel.last_stage_layers) == (None, 4)
